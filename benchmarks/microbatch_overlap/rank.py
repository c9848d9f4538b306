"""microbatch_overlap on a rank: per shape, T_comm; per sweep point, the bits checked, the activations counted,
the variants timed, and --timeline's traces."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.report import sweep_case
from ..harness.sweep import HEADLINE_RATIO, SweepConfig, sweep_depth, timed_repetitions, timed_variants
from ..harness.timing import timed_blocking
from ..moe_libraries import library_all_to_all
from . import DIM, MAX_DENSE_LAYERS, N_MICROBATCHES, QUICK_LEFT_OUT, ROWS, TIMED_VARIANTS
from .memory import check_bits_and_memory
from .shapes import ModelShape
from .traces import trace_point
from .variants import step


def microbatches(rank: int, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(1000 * seed + rank)
    return [torch.randn(ROWS, DIM) for _ in range(N_MICROBATCHES)]


def run_shape(
    library: str, shape: ModelShape, config: SweepConfig, t_layer: float, dense_layers_pinned: int | None
) -> dict:
    """``shape``'s T_comm, then its sweep: per point, the bits checked, the activations counted, the variants
    timed. ``dense_layers_pinned`` (--dense-layers): the one point's dense layers, whatever T_comm reads."""
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(library)
    batches = microbatches(rank, 0)
    torch.manual_seed(rank)
    probe = shape.build(all_to_all, 0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)

    def probe_step() -> dict[str, float]:
        """One microbatch's forward and backward on stock, nothing to hide its all_to_alls behind."""
        dist.barrier()
        probe_optimizer.zero_grad(set_to_none=True)
        wall, blocked = timed_blocking(lambda: probe(batches[0]).backward())
        probe_optimizer.step()
        return {"backward_s": wall, "blocked_s": blocked}

    comm_s = calibrate_t_comm(probe_step)
    t_comm = statistics.median(comm_s)
    # --timeline traces the point nearest the headline's.
    traced_ratio = min(config.ratios, key=lambda r: abs(math.log(r / HEADLINE_RATIO)))
    points = []
    for ratio in config.ratios:
        dense_layers = dense_layers_pinned or sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS * shape.moe_layers)
        torch.manual_seed(rank)
        model = shape.build(all_to_all, dense_layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        memory = check_bits_and_memory(model, batches, function, rank, sweep_case(shape.case_prefix(library), ratio))

        def measure(variant: str, _rep: int, model=model, optimizer=optimizer) -> dict[str, float]:
            return step(model, optimizer, batches, variant, function)

        samples = timed_repetitions(
            timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT), measure, config.reps, config.warmup
        )
        point = {"ratio": ratio, "dense_layers": dense_layers, "samples": samples, "memory": memory}
        if config.timeline_png is not None and ratio == traced_ratio:
            point["trace"] = trace_point(model, optimizer, batches, function, config, samples, shape, dense_layers)
        points.append(point)
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points}


def run_rank(library: str, config: SweepConfig, shapes: Sequence[ModelShape], dense_layers_pinned: int | None) -> dict:
    """One rank's part, in the process group: its times per shape, sweep point and variant, under each shape's
    ``case_prefix``."""
    t_layer = dense_layer_s(DIM, ROWS, config)
    return {
        shape.case_prefix(library): run_shape(library, shape, config, t_layer, dense_layers_pinned) for shape in shapes
    }
