"""overlap on a rank: the model, each variant's exchange and engine, the bits checked, the sweep's points timed, and
the traced backwards of --timeline."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import torch_ext
import torch_ext.ops

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.results import progress
from ..harness.sweep import sweep_depth, timed_repetitions, timed_variants
from ..harness.timing import timed_blocking
from . import (
    BATCH,
    COLLECTIVE_VARIANTS,
    FEATURES,
    HIDDEN,
    MAX_DENSE_LAYERS,
    ON_TORCH_EXT,
    QUICK_LEFT_OUT,
    SPARSE_LAYERS,
    VARIANTS,
    Config,
)
from .timeline import stock_backward_events, write_timelines

# _set_sequence_nr boost, as PR #114120 suggests: above every sequence number a forward makes.
SEQUENCE_NR_BOOST = 2**62
# The variants that declare PyTorch's functional all_to_all to a lane (process-wide, so toggled per step).
FUNCOL_LANE_VARIANTS = ("torch_ext(funcol lane)",)
FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single


class Model(nn.Module):
    def __init__(self, dim: int, dense_layers: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(BATCH * FEATURES, dim) * 0.1)
        # Cheap per-row layers between the all_to_all and the loss: several nodes, little compute.
        self.sparse_scale = nn.ParameterList(nn.Parameter(torch.ones(dim)) for _ in range(SPARSE_LAYERS))
        self.sparse_shift = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(SPARSE_LAYERS))
        self.dense = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(dense_layers))
        self.over = nn.Sequential(nn.Linear(dim + HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, lookups: torch.Tensor, dense_in: torch.Tensor, exchange) -> torch.Tensor:
        rows = F.embedding(lookups, self.table)
        exchanged = exchange(rows)
        sparse = exchanged
        for scale, shift in zip(self.sparse_scale, self.sparse_shift, strict=True):
            sparse = torch.relu(sparse * scale + shift)
        pooled = sparse.view(BATCH, FEATURES, -1).sum(1)
        dense = dense_in
        for layer in self.dense:
            dense = torch.relu(layer(dense))
        return self.over(torch.cat([pooled, dense], dim=1)).sum()


def _funcol_exchange(rows: torch.Tensor) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(rows, None, None, dist.group.WORLD)


def _boosted_funcol_exchange(rows: torch.Tensor) -> torch.Tensor:
    exchanged = _funcol_exchange(rows)
    # The result's grad_fn is _c10d_functional::_wrap_tensor_autograd, an identity in front of the
    # all_to_all's own node; boosting only the wrapper would leave the collective at its own number.
    exchanged.grad_fn._set_sequence_nr(SEQUENCE_NR_BOOST)
    exchanged.grad_fn.next_functions[0][0]._set_sequence_nr(SEQUENCE_NR_BOOST)
    return exchanged


def _torch_ext_exchange(rows: torch.Tensor) -> torch.Tensor:
    return torch_ext.ops.all_to_all_single(rows)


def _local_exchange(rows: torch.Tensor) -> torch.Tensor:
    return rows * 1.0


EXCHANGES = {
    "stock": _funcol_exchange,
    "stock+seq_nr": _boosted_funcol_exchange,
    "torch_ext": _torch_ext_exchange,
    "torch_ext(funcol)": _funcol_exchange,
    "torch_ext(funcol lane)": _funcol_exchange,
    "compute": _local_exchange,
    "compute(torch_ext)": _local_exchange,
}


def _exchange(variant: str) -> tuple:
    """``variant``'s exchange, and whether it runs on torch_ext's engine."""
    return EXCHANGES[variant], variant in ON_TORCH_EXT


def _declare_funcol_lane(variant: str) -> None:
    """run_in_lane for PyTorch's functional all_to_all for the variants that ask for it, undone for the others."""
    if variant in FUNCOL_LANE_VARIANTS:
        torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    else:
        torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)


def _backward(loss: torch.Tensor, on_torch_ext: bool) -> None:
    if on_torch_ext:
        torch_ext.backward(loss)
    else:
        loss.backward()


def _timed_backward(loss: torch.Tensor, on_torch_ext: bool) -> dict[str, float]:
    """Seconds of the backward call and blocked in it, the ranks started together."""
    dist.barrier()
    backward_s, blocked_s = timed_blocking(lambda: _backward(loss, on_torch_ext))
    return {"backward_s": backward_s, "blocked_s": blocked_s}


def _comm_only(dim: int) -> dict[str, float]:
    rows = torch.randn(BATCH * FEATURES, dim, requires_grad=True)
    exchanged = _funcol_exchange(rows)
    loss = (exchanged * 1.0).sum()
    return {"backward_s": _timed_backward(loss, on_torch_ext=False)["backward_s"]}


def _step(model: Model, inputs, variant: str, dim: int) -> dict[str, float]:
    if variant == "comm":
        return _comm_only(dim)
    exchange, on_torch_ext = _exchange(variant)
    _declare_funcol_lane(variant)
    model.zero_grad(set_to_none=True)
    loss = model(*inputs, exchange)
    return _timed_backward(loss, on_torch_ext)


def _check_same_gradients(model: Model, inputs) -> None:
    """Every collective variant computes the same gradients, bit for bit."""
    reference = None
    for variant in COLLECTIVE_VARIANTS:
        exchange, on_torch_ext = _exchange(variant)
        _declare_funcol_lane(variant)
        model.zero_grad(set_to_none=True)
        _backward(model(*inputs, exchange), on_torch_ext)
        grads = [p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference = grads
        elif not all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)):
            raise AssertionError(f"{variant} computed different gradients from stock")


def run_rank(config: Config) -> dict:
    """One rank's part, in the process group: its times per sweep point and variant (the step takes as long as the
    slowest rank: harness.exposure.merge_ranks)."""
    rank = dist.get_rank()
    dim = config.embedding_dim
    torch.manual_seed(rank)
    probe, inputs = Model(dim, 0), (torch.randperm(BATCH * FEATURES), torch.randn(BATCH, HIDDEN))
    comm_s = calibrate_t_comm(lambda: _step(probe, inputs, "stock", dim))
    t_comm = statistics.median(comm_s)
    t_layer = dense_layer_s(HIDDEN, BATCH, config)
    # The timeline is of the point nearest ratio 1, where the two orders differ most.
    traced_ratio = min(config.ratios, key=lambda ratio: abs(ratio - 1.0))
    # What bit-stable accumulation holds back while the engine runs producers out of stock's order.
    torch_ext._C._held_gradient_stats(True)
    points, timelines = [], None
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        model = Model(dim, dense_layers)
        inputs = (torch.randperm(BATCH * FEATURES), torch.randn(BATCH, HIDDEN))
        _check_same_gradients(model, inputs)

        def measure(variant: str, _rep: int, model=model, inputs=inputs) -> dict[str, float]:
            return _step(model, inputs, variant, dim)

        samples = timed_repetitions(
            timed_variants(config, VARIANTS, QUICK_LEFT_OUT), measure, config.reps, config.warmup
        )
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples})
        if config.timeline_png is not None and ratio == traced_ratio and timelines is None:
            timelines = (_traced_timelines(model, inputs), dense_layers)
    held = torch_ext._C._held_gradient_stats(True)
    # Both ranks are past their last collective: a failure here must not leave the other waiting in one.
    dist.barrier()
    if rank == 0 and timelines is not None:
        try:
            write_timelines(timelines[0], config.timeline_png, timelines[1], dim)
        except Exception as error:  # noqa: BLE001 - the picture is optional, the timings are not
            progress(f"overlap: warning: could not write the timeline {config.timeline_png}: {error!r}")
    return {
        "points": points,
        "dim": dim,
        "calibration": {"comm_s": comm_s, "dense_layer_s": t_layer},
        "held": held,
    }


TIMELINE_ROWS = (("stock PyTorch", "stock"), ("torch_ext", "torch_ext"))


def _traced_timelines(model: Model, inputs) -> list[tuple[str, list[dict]]]:
    """One traced backward of each of TIMELINE_ROWS' variants; every rank runs them (the collectives
    need both), each tracing its own."""
    rows = []
    for label, variant in TIMELINE_ROWS:
        exchange, on_torch_ext = _exchange(variant)
        model.zero_grad(set_to_none=True)
        loss = model(*inputs, exchange)
        dist.barrier()
        if on_torch_ext:
            with torch_ext.trace() as trace:
                torch_ext.backward(loss)
            events = [dict(event) for event in trace.events]
        else:
            events = stock_backward_events(loss)
        rows.append((label, events))
    return rows
