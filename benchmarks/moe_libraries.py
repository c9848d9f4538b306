"""The MoE libraries whose synchronous expert all_to_all moe_sync and microbatch_overlap run: Megatron-core's and
DeepSpeed's ``_AllToAll``, an autograd Function whose backward runs the gradient's all_to_all inside its node.
Imports neither library (nor torch) until ``library_all_to_all``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from collections.abc import Callable

LIBRARIES = ("megatron", "deepspeed")
LIBRARY_NAMES = {"megatron": "Megatron-core", "deepspeed": "DeepSpeed"}
# What a benchmark that needs one says when none is installed.
INSTALL_HINT = "pip install torch==2.13.0 megatron-core==0.16.1 deepspeed==0.19.8"


def installed_libraries() -> list[str]:
    """The libraries installed here, in LIBRARIES' order."""
    modules = {"megatron": "megatron.core", "deepspeed": "deepspeed.moe"}
    return [library for library in LIBRARIES if _installed(modules[library])]


def _installed(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing the packages above it: find_spec of a
    dotted name imports its parents, and deepspeed's __init__ imports torch and much more (3.3 s in a sweep's
    launcher, which imports no torch, before its hosts could start)."""
    top, *parts = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in parts:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


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
