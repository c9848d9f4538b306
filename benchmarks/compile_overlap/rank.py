"""compile_overlap on a rank: the block, its compiled setups, the bits checked, the sweep's points timed."""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import torch_ext
from torch_ext.compiler import MATMULS_PER_REGION

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.sweep import SweepConfig, sweep_depth, timed_repetitions, timed_variants
from ..harness.timing import timed_blocking
from . import CAPACITY, COMPUTE_VARIANTS, DENSE_ROWS, DIM, MAX_DENSE_LAYERS, QUICK_LEFT_OUT, TIMED_VARIANTS, WORLD_SIZE

FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single
TORCH_EXT_VARIANTS = ("torch_ext", "torch_ext_compiled", "hand_compiled")
# The passes torch/_inductor/config.py recommends for reorder_for_compute_comm_overlap (torch 2.13).
REORDER_PASSES = [
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
]
REORDER_OPTIONS = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": REORDER_PASSES}


def _identity(tokens: torch.Tensor, group) -> torch.Tensor:
    return tokens


def _all_to_all(tokens: torch.Tensor, group) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(tokens, None, None, group)


class Block(nn.Module):
    """The expert-parallel block beside ``dense_layers`` Linear + ReLU layers (the layer harness/calibration.py times);
    with none, the all_to_all has nothing to hide behind (T_comm's calibration)."""

    def __init__(self, dense_layers: int) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(dense_layers)])

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        exchange = _all_to_all if communicate else _identity
        group = dist.group.WORLD
        returned = exchange(self.expert(exchange(self.router(tokens), group)), group)
        moe = self.head(returned).sum()
        if not self.dense:
            return moe
        return moe + self.dense(tokens[:DENSE_ROWS]).sum()


class Setups:
    """One block per compiled setup, each a copy of the eager one (so their optimizers' steps stay apart)."""

    def __init__(self, dense_layers: int, variants: Sequence[str], backend_options: dict) -> None:
        self.eager = Block(dense_layers)
        self.modules = {"stock": self.eager, "torch_ext": self.eager, "compute": self.eager}
        self.callables = dict(self.modules)
        for variant, compile_kwargs in (
            ("compiled", {}),
            ("reordered", {"options": REORDER_OPTIONS}),
            ("torch_ext_compiled", {"backend": torch_ext.compile_backend(**backend_options), "fullgraph": True}),
        ):
            module = copy.deepcopy(self.eager)
            self.modules[variant] = module
            self.callables[variant] = torch.compile(module, **compile_kwargs)
        if "hand_compiled" in variants:
            module = copy.deepcopy(self.eager)
            module.dense, module.expert = torch.compile(module.dense), torch.compile(module.expert)
            self.modules["hand_compiled"] = self.callables["hand_compiled"] = module
        self.modules["compiled_compute"] = self.modules["compiled"]
        self.callables["compiled_compute"] = self.callables["compiled"]
        self.optimizers = {
            variant: torch.optim.SGD(module.parameters(), lr=1e-4) for variant, module in self.modules.items()
        }


@functools.cache
def _reordering_backward_compiler():
    # One for the process: compiled autograd caches its graphs per compiler.
    return torch.compile(backend="inductor", options=REORDER_OPTIONS)


def _engine(variant: str):
    if variant == "reordered":
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(_reordering_backward_compiler())
    return torch_ext.enable() if variant in TORCH_EXT_VARIANTS else contextlib.nullcontext()


def _step(setups: Setups, tokens: torch.Tensor, variant: str) -> dict[str, float]:
    """Seconds of a forward, backward and SGD step (``step_s``), of its backward (``backward_s``) and blocked in
    the backward (``blocked_s``), the ranks started together."""
    model, optimizer = setups.callables[variant], setups.optimizers[variant]
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, communicate=variant not in COMPUTE_VARIANTS)
    with _engine(variant):
        backward_s, blocked_s = timed_blocking(loss.backward)
    optimizer.step()
    return {"step_s": time.perf_counter() - start, "backward_s": backward_s, "blocked_s": blocked_s}


def _gradients(setups: Setups, tokens: torch.Tensor, variant: str, engine: str) -> list[torch.Tensor]:
    """``variant``'s model's gradients, its backward run as ``engine``'s (a variant's name) is."""
    module = setups.modules[variant]
    module.zero_grad(set_to_none=True)
    loss = setups.callables[variant](tokens)
    with _engine(engine):
        loss.backward()
    return [p.grad.clone() for p in module.parameters()]


def _check_bits(setups: Setups, tokens: torch.Tensor, rank: int) -> None:
    """torch_ext's gradients against PyTorch's engine on the same model: eager, and the split compiled one. Compiles
    every setup on the way (the first call of each), before anything is timed."""
    pairs = [("torch_ext", "stock"), ("torch_ext_compiled", "torch_ext_compiled")]
    if "hand_compiled" in setups.modules:
        pairs.append(("hand_compiled", "hand_compiled"))
    for variant, reference in pairs:
        expected = _gradients(setups, tokens, reference, engine="stock")
        got = _gradients(setups, tokens, variant, engine=variant)
        if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
            raise AssertionError(f"rank {rank}: {variant}'s gradients differ from PyTorch's engine on the same model")
    for variant in ("compiled", "reordered"):
        _gradients(setups, tokens, variant, engine=variant)
    for variant in COMPUTE_VARIANTS:
        setups.callables[variant](tokens, communicate=False).backward()


def run_rank(config: SweepConfig, backend_options: dict) -> dict:
    """One rank's part, in the process group: T_comm, then each sweep point's times per variant."""
    rank = dist.get_rank()
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    t_layer = dense_layer_s(DIM, DENSE_ROWS, config)
    torch.manual_seed(rank)
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    probe = Block(0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)

    def stock_step() -> dict[str, float]:
        dist.barrier()
        probe_optimizer.zero_grad(set_to_none=True)
        loss = probe(tokens)
        backward_s, blocked_s = timed_blocking(loss.backward)
        probe_optimizer.step()
        return {"backward_s": backward_s, "blocked_s": blocked_s}

    comm_s = calibrate_t_comm(stock_step)
    t_comm = statistics.median(comm_s)
    points = []
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        torch._dynamo.reset()
        variants = timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT)
        setups = Setups(dense_layers, variants, backend_options)
        compile_start = time.perf_counter()
        _check_bits(setups, tokens, rank)
        compile_s = time.perf_counter() - compile_start

        def measure(variant: str, _rep: int, setups=setups) -> dict[str, float]:
            return _step(setups, tokens, variant)

        samples = timed_repetitions(variants, measure, config.reps, config.warmup)
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples, "compile_s": compile_s})
    torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)
    matmuls_per_region = backend_options.get("matmuls_per_region", MATMULS_PER_REGION)
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points, "matmuls_per_region": matmuls_per_region}
