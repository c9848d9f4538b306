import os
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
    # Loading the test accelerator makes it the process's accelerator for good (torch.accelerator, stock's
    # device threads, torch_ext's stream paths): the tests that load it run after every other test, which
    # then sees the process as it is without one. A stable sort keeps each group's order.
    items.sort(key=lambda item: item.get_closest_marker("testdev") is not None)


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
