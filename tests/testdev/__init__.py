"""testdev: a PrivateUse1 test accelerator whose streams really run asynchronously.

Each stream is a worker thread that runs its work later than it is issued, on host memory, so code that forgets a
stream wait, an event or a recordStream reads or frees memory at the wrong time and a test on a CPU-only machine fails,
as it would on a GPU. ``load()`` builds the C++ extension (``torch.utils.cpp_extension.load``, cached in
``tests/testdev/build/`` or ``$TESTDEV_BUILD_DIR``) and registers the device as ``testdev`` (``torch.testdev``,
``torch.accelerator``, ``Tensor.testdev()``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
from typing import Self

import torch

__all__ = ["SOURCES", "Gate", "hold", "is_available", "load"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")

# Listed, not globbed: the process-group backend appends its own file here.
SOURCES = [
    os.path.join(_CSRC, name)
    for name in (
        "streams.cpp",
        "allocator.cpp",
        "guard.cpp",
        "hooks.cpp",
        "ops.cpp",
        "fallback.cpp",
        "module.cpp",
        "process_group.cpp",
    )
]

_lock = threading.RLock()
_ext = None


def build_dir() -> str:
    return os.environ.get("TESTDEV_BUILD_DIR") or os.path.join(_HERE, "build")


def is_available() -> bool:
    """Whether the device is loaded or can be built here (a C++ compiler and ninja)."""
    if _ext is not None:
        return True
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    return is_ninja_available() and shutil.which(compiler) is not None


def load():
    """Builds (once per checkout; later calls reuse the cached build) and registers the device; returns the extension."""
    global _ext
    with _lock:
        if _ext is not None:
            return _ext
        from torch.utils.cpp_extension import load as load_extension

        directory = build_dir()
        os.makedirs(directory, exist_ok=True)
        ext = load_extension(
            name="torch_ext_testdev",
            sources=list(SOURCES),
            extra_include_paths=[_CSRC],
            # -O1: the kernels are thin wrappers over libtorch's CPU kernels; compile time matters more here.
            extra_cflags=["-O1"],
            build_directory=directory,
            verbose=os.environ.get("TESTDEV_VERBOSE") == "1",
        )
        from . import device

        device._ext = ext
        if torch._C._get_privateuse1_backend_name() != "testdev":
            torch.utils.rename_privateuse1_backend("testdev")
        if not hasattr(torch, "testdev"):
            torch._register_device_module("testdev", device)
        if not hasattr(torch.Tensor, "testdev"):
            torch.utils.generate_methods_for_privateuse1_backend()
        atexit.register(_drain)
        # The first op's Meta call imports torch._dynamo (~1 s): pay it here, not inside a test's timed window.
        torch.zeros(1, device="testdev").add_(1).cpu()
        _ext = ext
        return ext


def _drain() -> None:
    # Let queued work finish before interpreter teardown destroys what the kernels use. The stream threads are
    # leaked on purpose (joining them from static destructors could deadlock); an error a stream kept is moot now.
    try:
        _ext.synchronize(-1)
    except Exception:  # noqa: BLE001, S110 - exiting; nobody is left to report to
        pass


def hold(ms: float) -> None:
    """Keeps the current stream of the current device busy for ``ms`` milliseconds (like ``torch.cuda._sleep``).

    Issued asynchronously: returns at once; work issued after it on that stream runs after it.
    """
    load().hold(float(ms), -1)


class Gate:
    """A barrier the host opens: ``block()`` holds the current stream of the current device until ``open()``.

    Deterministic where ``hold`` only makes a race likely: work issued behind a closed gate cannot have run,
    whatever the machine's load. A gate never opened lets its stream go after ``timeout_s`` (so a test that
    waits for the wrong thing fails rather than hangs); one garbage-collected is opened. As a context manager
    it blocks on entry and opens on exit.
    """

    def __init__(self) -> None:
        self._gate = load().Gate()

    def block(self, timeout_s: float = 10.0) -> None:
        self._gate.block(timeout_s * 1000.0)

    def open(self) -> None:
        self._gate.open()

    @property
    def is_open(self) -> bool:
        return self._gate.is_open

    def __enter__(self) -> Self:
        self.block()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.open()

    def __del__(self) -> None:
        gate = getattr(self, "_gate", None)
        if gate is not None:
            gate.open()
