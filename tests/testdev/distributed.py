"""``testdev_gloo``: a torch.distributed backend for testdev tensors.

Each collective runs through a gloo backend on CPU tensors that alias the device memory, on an internal
communication stream of the tensors' device, ordered after the caller's current stream, as NCCL's do: the call
returns at once, ``work.wait()`` makes the then-current stream wait for the collective without blocking the host
(with a timeout, or for a barrier, it blocks the host and raises the collective's error), ``work.is_completed()``
asks whether the stream has passed it, and ``work.get_future()`` completes with the outputs (or the error) once
the collective has run. The backend is ``ProcessGroupTestdev`` in tests/testdev/csrc/process_group.cpp.

Usage, after :func:`register_backend`::

    dist.init_process_group("cpu:gloo,testdev:testdev_gloo", rank=rank, world_size=n, init_method=...)
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

BACKEND_NAME = "testdev_gloo"


def register_backend() -> None:
    """Registers ``testdev_gloo`` for testdev tensors with torch.distributed (loading testdev if it is not);
    calling it again does nothing."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    _extension()  # fails here, not at the first process group, if testdev cannot be built
    dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=["testdev"])


def create_backend(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    """torch.distributed's creator for ``testdev_gloo``: the backend over a gloo backend of its own, which
    rendezvouses through ``store`` (the prefix store init_process_group / new_group gives this device)."""
    gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return _extension().ProcessGroupTestdev(rank, world_size, gloo)


def _extension():
    from . import load

    return load()
