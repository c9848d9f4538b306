"""The MoE libraries whose synchronous expert all_to_all moe_sync, microbatch_overlap and trainer_overlap run:
Megatron-core's and DeepSpeed's ``_AllToAll``, an autograd Function whose backward runs the gradient's all_to_all
inside its node. Imports neither library (nor torch) until ``library_all_to_all`` or ``in_lane_on_torch_ext``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .harness.sweep import module_installed

LIBRARIES = ("megatron", "deepspeed")
LIBRARY_NAMES = {"megatron": "Megatron-core", "deepspeed": "DeepSpeed"}
# What a benchmark that needs one says when none is installed.
INSTALL_HINT = "pip install torch==2.13.0 megatron-core==0.16.1 deepspeed==0.19.8"


def installed_libraries() -> list[str]:
    """The libraries installed here, in LIBRARIES' order."""
    modules = {"megatron": "megatron.core", "deepspeed": "deepspeed.moe"}
    return [library for library in LIBRARIES if module_installed(modules[library])]


def library_all_to_all(library: str) -> tuple[Callable, type]:
    """``all_to_all(group, tokens)`` through the library's ``_AllToAll``, and that Function class."""
    if library == "megatron":
        from megatron.core.tensor_parallel.mappings import _AllToAll, all_to_all

        return all_to_all, _AllToAll
    import deepspeed.comm
    from deepspeed.moe.sharded_moe import _AllToAll

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return _AllToAll.apply, _AllToAll


def no_all_to_all(group, tokens):
    """The communication-free stand-in for ``all_to_all(group, tokens)``: the tokens as they are."""
    return tokens


@contextlib.contextmanager
def in_lane_on_torch_ext(function: type) -> Iterator[None]:
    """The library's ``_AllToAll`` (``function``) declared with ``torch_ext.run_in_lane`` and torch_ext's engine
    switched on, for the block; the class is back to undeclared afterwards."""
    import torch_ext

    torch_ext.run_in_lane(function)
    try:
        with torch_ext.enable():
            yield
    finally:
        torch_ext.unregister_collective_backward(function)
