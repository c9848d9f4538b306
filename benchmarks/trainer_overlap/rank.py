"""trainer_overlap on a rank: T_comm, the dense layers it asks for, each library's loop checked and timed."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.sweep import HEADLINE_RATIO, SweepConfig, sweep_depth, timed_repetitions
from ..harness.timing import gc_paused, timed_blocking
from ..moe_layer import moe_layer
from ..moe_libraries import in_lane_on_torch_ext, library_all_to_all
from . import DIM, MAX_DENSE_LAYERS, N_MICROBATCHES, ROWS, VARIANTS
from .loops import LOOPS


def _microbatches(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(rank)
    return [torch.randn(ROWS, DIM) for _ in range(N_MICROBATCHES)]


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The switch's engine and lane; the own loops run on PyTorch's engine with nothing declared."""
    if variant != "switch":
        yield
        return
    with in_lane_on_torch_ext(function):
        yield


def _timed_step(loop, batches, variant: str, function: type) -> dict[str, float]:
    dist.barrier()
    with gc_paused():
        start = time.perf_counter()
        with variant_engine(variant, function):
            loop.step(batches, variant)
        return {"step_s": time.perf_counter() - start}


def _check_bits(loop, model: torch.nn.Module, batches, function: type, library: str) -> None:
    """One step of the own loop and one of the switch from the same parameters: the same gradients, bit for bit
    (read before the optimizer's step by a pre-hook), the parameters put back after each."""
    start = [p.detach().clone() for p in model.parameters()]
    grads = {}
    for variant in ("own", "switch"):
        seen: list[list[torch.Tensor]] = []

        def read_grads(*_, seen=seen) -> None:
            seen.append([p.grad.clone() for p in model.parameters()])

        handle = loop.optimizer(variant).register_step_pre_hook(read_grads)
        try:
            with variant_engine(variant, function):
                loop.step(batches, variant)
        finally:
            handle.remove()
        grads[variant] = seen[0]
        with torch.no_grad():
            for p, value in zip(model.parameters(), start, strict=True):
                p.copy_(value)
    if not all(torch.equal(a, b) for a, b in zip(grads["own"], grads["switch"], strict=True)):
        raise AssertionError(f"rank {dist.get_rank()}, {library}: the switch's gradients differ from the own loop's")


def _run_library(library: str, all_to_all_library: str, config: SweepConfig, t_layer: float) -> dict:
    """``library``'s T_comm, its loop's bits checked, its variants timed, with ``all_to_all_library``'s _AllToAll."""
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(all_to_all_library)
    batches = _microbatches(rank)
    torch.manual_seed(rank)
    probe = moe_layer(all_to_all, DIM, 0, N_MICROBATCHES)

    def probe_step() -> dict[str, float]:
        """One microbatch's forward and backward on stock, nothing to hide its all_to_alls behind."""
        dist.barrier()
        probe.zero_grad(set_to_none=True)
        wall, blocked = timed_blocking(lambda: probe(batches[0]).backward())
        return {"backward_s": wall, "blocked_s": blocked}

    comm_s = calibrate_t_comm(probe_step)
    dense_layers = sweep_depth(HEADLINE_RATIO, statistics.median(comm_s), t_layer, MAX_DENSE_LAYERS)
    torch.manual_seed(rank)
    model = moe_layer(all_to_all, DIM, dense_layers, N_MICROBATCHES)
    loop = LOOPS[library](model)
    _check_bits(loop, model, batches, function, library)

    def measure(variant: str, _rep: int) -> dict[str, float]:
        return _timed_step(loop, batches, variant, function)

    samples = timed_repetitions(VARIANTS, measure, config.reps, config.warmup)
    return {"comm_s": comm_s, "dense_layers": dense_layers, "samples": samples}


def run_rank(libraries: Sequence[str], all_to_all_of: dict[str, str], config: SweepConfig) -> dict:
    """One rank's part, in the process group: its times per library and variant. ``all_to_all_of``: the library
    whose _AllToAll each library's model runs (its own, where it has one)."""
    if "deepspeed" in all_to_all_of.values():
        # DeepSpeed finds no accelerator here and picks its CPU one; this says so, before it is imported.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Once, for every library, before any is imported.
    t_layer = dense_layer_s(DIM, ROWS, config)
    if "megatron" in libraries:
        from megatron.core import parallel_state

        # What Megatron's schedule asks of its parallel state: no model parallelism.
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    return {library: _run_library(library, all_to_all_of[library], config, t_layer) for library in libraries}
