"""recsys_torchrec on a rank: the sharded DLRM, a step on each engine, the bits checked, the sweep's points timed."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

import torch_ext
from torch_ext.testing import dlrm_batch, sharded_dlrm

from ..harness.calibration import calibrate_t_comm, dense_layer_s
from ..harness.sweep import SweepConfig, sweep_depth, timed_repetitions
from ..harness.timing import timed_blocking
from . import (
    BATCH,
    DENSE_FEATURES,
    DIM,
    ENGINE_VARIANTS,
    HIDDEN,
    LEARNING_RATE,
    MAX_DENSE_LAYERS,
    ROWS,
    TABLES,
    VARIANTS,
    WORLD_SIZE,
)


def _dlrm(dense_layers: int):
    # No DistributedDataParallel around the dense part: DDP's all_reduce of the dense gradients (256 KiB a layer)
    # shares the one link with the all_to_all, and at the x2 point (~47 layers) took ~100 ms of it, so the dense
    # arch's backward was set by that traffic rather than by its compute.
    return sharded_dlrm(
        tables=TABLES,
        rows=ROWS,
        dim=DIM,
        dense_features=DENSE_FEATURES,
        dense_layer_sizes=[HIDDEN] * dense_layers + [DIM],
        over_layer_sizes=[HIDDEN, 1],
        learning_rate=LEARNING_RATE,
        world_size=WORLD_SIZE,
        data_parallel=False,
    )


def _dense_params(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if "embedding_bags" not in name]


def _batch(rank: int, step: int):
    return dlrm_batch(
        seed=1000 * step + rank,
        batch=BATCH,
        dense_features=DENSE_FEATURES,
        tables=TABLES,
        rows=ROWS,
        ids_per_bag=(1, 4),
    )


def _engine(variant: str):
    return torch_ext.enable() if variant == "torch_ext" else contextlib.nullcontext()


def _step(model, dense_params, batch, variant: str) -> dict[str, float]:
    """Seconds of one training step (``step_s``), of its backward (``backward_s``) and blocked in the backward
    (``blocked_s``), the ranks started together."""
    dense, sparse, labels = batch
    dist.barrier()
    start = time.perf_counter()
    logits = model(dense, sparse).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    with _engine(variant):
        backward_s, blocked_s = timed_blocking(loss.backward)
    with torch.no_grad():
        for p in dense_params:
            p.add_(p.grad, alpha=-LEARNING_RATE)
            p.grad = None
    return {"step_s": time.perf_counter() - start, "backward_s": backward_s, "blocked_s": blocked_s}


def _comm_only() -> dict[str, float]:
    """The pooled gradient's all_to_all alone, started together (a barrier first): each rank sends the other
    BATCH * TABLES/2 * DIM floats (equal splits)."""
    send = torch.randn(WORLD_SIZE * BATCH * (TABLES // 2) * DIM)
    receive = torch.empty_like(send)
    dist.barrier()
    start = time.perf_counter()
    dist.all_to_all_single(receive, send)
    return {"backward_s": time.perf_counter() - start}


def _local_tables(model) -> list[torch.Tensor]:
    return [
        shard.tensor.clone()
        for value in model.state_dict().values()
        if hasattr(value, "local_shards")
        for shard in value.local_shards()
    ]


def _check_same_bits(dense_layers: int, rank: int) -> None:
    """One step of each engine from the same start: torch.equal losses, dense gradients and tables after."""
    results = {}
    for variant in ENGINE_VARIANTS:
        model = _dlrm(dense_layers)
        dense_params = _dense_params(model)
        dense, sparse, labels = _batch(rank, 0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(-1), labels)
        with _engine(variant):
            loss.backward()
        results[variant] = [loss.detach()] + [p.grad for p in dense_params] + _local_tables(model)
    for i, (stock, ours) in enumerate(zip(results["stock"], results["torch_ext"], strict=True)):
        if not torch.equal(stock, ours):
            raise AssertionError(f"rank {rank}: torch_ext's result {i} differs from stock's")


def _traced_backward(model, dense_params, batch) -> list[dict]:
    dense, sparse, labels = batch
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(-1), labels)
    dist.barrier()
    with torch_ext.enable(), torch_ext.trace() as trace:
        loss.backward()
    for p in dense_params:
        p.grad = None
    return [dict(event) for event in trace.events]


def run_rank(config: SweepConfig) -> dict:
    """One rank's part, in the process group: its times per sweep point and variant."""
    rank = dist.get_rank()
    probe = _dlrm(0)
    probe_params, probe_batch = _dense_params(probe), _batch(rank, 0)
    comm_s = calibrate_t_comm(lambda: _step(probe, probe_params, probe_batch, "stock"))
    t_comm = statistics.median(comm_s)
    t_layer = dense_layer_s(HIDDEN, BATCH, config)
    traced_ratio = min(config.ratios, key=lambda ratio: abs(ratio - 1.0))
    points, timeline = [], None
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        _check_same_bits(dense_layers, rank)
        model = _dlrm(dense_layers)
        dense_params = _dense_params(model)

        def measure(variant: str, rep: int, model=model, dense_params=dense_params) -> dict[str, float]:
            if variant == "comm":
                return _comm_only()
            # A batch of its own for each repetition, the same for every variant.
            return _step(model, dense_params, _batch(rank, rep + 1), variant)

        samples = timed_repetitions(VARIANTS, measure, config.reps, config.warmup)
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples})
        if config.timeline_png and ratio == traced_ratio and timeline is None:
            timeline = (_traced_backward(model, dense_params, _batch(rank, 0)), dense_layers)
    dist.barrier()
    if rank == 0 and timeline is not None:
        from torch_ext.tracing import plot_timelines

        plot_timelines(
            [("torch_ext", timeline[0])],
            config.timeline_png,
            title=f"TorchRec DLRM backward on rank 0 under torch_ext ({timeline[1]} dense layers)",
        )
        print(f"wrote {config.timeline_png}")
    return {"points": points, "comm_s": comm_s, "t_layer_s": t_layer}
