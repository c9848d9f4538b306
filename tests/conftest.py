import os
import subprocess
import sys

import pytest
import torch

try:
    import torch_ext  # noqa: F401 - installed with `pip install --no-build-isolation -e .`
except ImportError:
    # Not installed: use the checkout this conftest lives in (built in place).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    # Every test that spawns ranks is slow: `python -m pytest -m "not slow"` leaves them all out.
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    config.pluginmanager.register(_TestDeviceApart(), "torch_ext_test_device_apart")


class _TestDeviceApart:
    """The tests that load the test accelerator (tests/testdev, marked ``testdev``) run in a pytest process of
    their own, at the end of the session, when the session has other tests too.

    Loaded, the device is the process's accelerator for good, and stock's engine cannot run its nodes if the
    process ran a backward before: stock sizes its device threads' queues once, at its first backward, from the
    devices there are then (engine.cpp's start_device_threads; a later device fails its INTERNAL ASSERT). The
    other tests see the process as CPU users have it, without an accelerator.
    """

    # Set in the process that runs them.
    CHILD = "TORCH_EXT_TESTDEV_CHILD"

    def __init__(self) -> None:
        self.deferred: list[str] = []

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected
    def pytest_collection_modifyitems(self, items):
        if os.environ.get(self.CHILD):
            return
        loading = [item for item in items if item.get_closest_marker("testdev") is not None]
        if loading and len(loading) < len(items):
            items[:] = [item for item in items if item.get_closest_marker("testdev") is None]
            self.deferred = [item.nodeid for item in loading]

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.deferred or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_sep("=", f"{len(self.deferred)} tests on the test accelerator, in a process of their own")
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *self.deferred],
            cwd=session.config.rootpath,
            env={**os.environ, self.CHILD: "1"},
            capture_output=True,
            text=True,
            check=False,
        )
        reporter.write(done.stdout + done.stderr)
        if done.returncode != 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def seed_torch():
    torch.manual_seed(0)


@pytest.fixture
def one_intra_op_thread():
    """One intra-op thread while a test runs (modules that need it: ``pytestmark = pytest.mark.usefixtures(...)``).

    On this busy 2-core machine OpenMP's second thread made tiny graphs many times slower: a round of
    test_threads' graphs took 1-13 s instead of 0.3 s, and test_verify's backward calls stalled for ~0.5 s.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank_world():
    """A one-rank gloo world for the test (an in-memory store), torn down after it with the order check off."""
    import torch.distributed as dist

    import torch_ext  # here, not at the top: conftest loads before any test chooses how torch_ext is imported

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch_ext.check_collective_order(False)
        dist.destroy_process_group()
