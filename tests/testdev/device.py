"""torch.testdev: the device module of the testdev accelerator (what ``torch.get_device_module("testdev")`` gives).

Mirrors the parts of ``torch.cuda`` that generic code calls. ``_ext`` is set by ``testdev.load()``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_ext: Any = None
# torch.utils.checkpoint saves and restores a device's RNG state only where the device module has
# `_initialized` set (torch.cuda's attribute): without it, recomputed dropout draws different masks.
_initialized = True

Stream = torch.Stream
Event = torch.Event


def _index(device: Any = None) -> int:
    """A device index from an int, a str, a torch.device or None (the current device)."""
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "testdev":
        raise ValueError(f"not a testdev device: {device}")
    return _ext.current_device() if device.index is None else device.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _ext.device_count()


def current_device() -> int:
    return _ext.current_device()


def set_device(device: Any) -> None:
    _ext.set_device(_index(device))


class device:
    """Context manager that makes ``device`` the current testdev device."""

    def __init__(self, device: Any) -> None:
        self.idx = _index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = _ext.current_device()
        _ext.set_device(self.idx)

    def __exit__(self, *exc_info: object) -> None:
        _ext.set_device(self.prev_idx)


def synchronize(device: Any = None) -> None:
    """Waits for all work queued on every stream of the device."""
    _ext.synchronize(_index(device))


def current_stream(device: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("testdev", _index(device)))


def default_stream(device: Any = None) -> torch.Stream:
    current = current_stream(device)
    return torch.Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None):
    """Makes ``stream`` current (and its device) inside the block, as ``torch.cuda.stream``."""
    if stream is None:
        yield
        return
    with stream:
        yield


def hold(ms: float, device: Any = None) -> None:
    """Keeps the device's current stream busy for ``ms`` milliseconds; returns at once."""
    _ext.hold(float(ms), _index(device))


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What torch.autocast asks a custom backend (torch.utils.checkpoint enters autocast for the device)."""
    return [torch.float16, torch.bfloat16]


def manual_seed(seed: int) -> None:
    _ext.manual_seed(-1, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        _ext.manual_seed(index, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def seed() -> None:
    _ext.seed(-1)


def seed_all() -> None:
    for index in range(device_count()):
        _ext.seed(index)


def initial_seed() -> int:
    return _ext.initial_seed(-1)


def get_rng_state(device: Any = "testdev") -> torch.Tensor:
    """The device generator's state (a CPU ByteTensor); waits for the device's queued work first."""
    state = _ext.get_rng_state(_index(device))
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device: Any = "testdev") -> None:
    _ext.set_rng_state(_index(device), new_state.contiguous().cpu().numpy().tobytes())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


def memory_stats(device: Any = None) -> dict[str, int]:
    """The caching allocator's counters: allocated/peak/reserved bytes, allocations, reuses, frees, pending blocks."""
    return _ext.memory_stats(_index(device))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["peak_allocated_bytes"]


def memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _ext.reset_peak_memory_stats(_index(device))


def empty_cache() -> None:
    """Waits for every device, then returns every cached block to the OS."""
    _ext.empty_cache()
