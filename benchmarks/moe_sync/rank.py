"""moe_sync on a rank: the layer, each variant's engine, the bits checked, the sweep's points timed."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import torch_ext

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.sweep import SweepConfig, sweep_depth, timed_repetitions, timed_variants
from ..harness.timing import timed_blocking
from ..moe_libraries import library_all_to_all, no_all_to_all
from . import CAPACITY, DENSE_ROWS, DIM, ENGINE_VARIANTS, MAX_DENSE_LAYERS, QUICK_LEFT_OUT, TIMED_VARIANTS, WORLD_SIZE


class Layer(nn.Module):
    """The expert-parallel layer beside ``dense_layers`` Linear + ReLU layers (the layer harness/calibration.py
    times); with none, the all_to_all has nothing to hide behind (T_comm's calibration)."""

    def __init__(self, all_to_all: Callable, dense_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(dense_layers)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else no_all_to_all
        group = dist.group.WORLD
        returned = all_to_all(group, self.expert(all_to_all(group, tokens)))
        moe = self.head(returned * torch.sigmoid(self.gate(tokens))).sum()
        if not self.dense:
            return moe
        return moe + self.dense(tokens[:DENSE_ROWS]).sum()


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The engine and declaration of ``variant``; the _AllToAll is back to undeclared afterwards."""
    if variant in ("stock", "compute"):
        yield
        return
    if variant == "torch_ext":
        with torch_ext.enable():
            yield
        return
    if variant == "priority":
        torch_ext.register_collective_backward(launches=function)
    else:
        torch_ext.run_in_lane(function)
    checked = variant == "checked"
    if checked:
        # Its group's mirror is made at the first checked backward, in _check_bits, before anything is timed.
        torch_ext.check_collective_order()
    try:
        with torch_ext.enable():
            yield
    finally:
        torch_ext.unregister_collective_backward(function)
        if checked:
            torch_ext.check_collective_order(False)


def _step(model: Layer, optimizer, tokens: torch.Tensor, variant: str, function: type) -> dict[str, float]:
    """Seconds of a forward, backward and SGD step (``step_s``), of its backward (``backward_s``) and blocked in
    the backward (``blocked_s``), the ranks started together."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, communicate=variant != "compute")
    with variant_engine(variant, function):
        backward_s, blocked_s = timed_blocking(loss.backward)
    optimizer.step()
    return {"step_s": time.perf_counter() - start, "backward_s": backward_s, "blocked_s": blocked_s}


def _check_bits(model: Layer, tokens: torch.Tensor, function: type, rank: int, library: str) -> None:
    grads = {}
    for variant in ENGINE_VARIANTS:
        model.zero_grad(set_to_none=True)
        loss = model(tokens)
        with variant_engine(variant, function):
            loss.backward()
        grads[variant] = [p.grad.clone() for p in model.parameters()]
    for variant in ENGINE_VARIANTS[1:]:
        if not all(torch.equal(a, b) for a, b in zip(grads["stock"], grads[variant], strict=True)):
            raise AssertionError(f"rank {rank}, {library}: {variant}'s gradients differ from stock's")


def _run_library(library: str, config: SweepConfig, t_layer: float) -> dict:
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(library)
    torch.manual_seed(rank)
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    probe = Layer(all_to_all, 0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)
    comm_s = calibrate_t_comm(lambda: _step(probe, probe_optimizer, tokens, "stock", function))
    t_comm = statistics.median(comm_s)
    points = []
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        model = Layer(all_to_all, dense_layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        _check_bits(model, tokens, function, rank, library)

        def measure(variant: str, _rep: int, model=model, optimizer=optimizer) -> dict[str, float]:
            return _step(model, optimizer, tokens, variant, function)

        variants = timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT)
        samples = timed_repetitions(variants, measure, config.reps, config.warmup)
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples})
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points}


def run_rank(libraries: Sequence[str], config: SweepConfig) -> dict:
    """One rank's part, in the process group: its times per library, sweep point and variant."""
    # Once, for every library, before any is imported.
    t_layer = dense_layer_s(DIM, DENSE_ROWS, config)
    return {library: _run_library(library, config, t_layer) for library in libraries}
