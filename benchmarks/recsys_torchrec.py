"""TorchRec's own embedding all_to_all in backward: stock PyTorch against torch_ext, on 2 ranks as 2 hosts.

The model is TorchRec's DLRM (``torchrec.models.dlrm.DLRM``): an EmbeddingBagCollection of TABLES
tables sharded table-wise over the 2 ranks by ``DistributedModelParallel``, with the fused CPU kernel
(the tables' SGD update runs inside their backward), a dense arch of the depth the sweep asks for and an over
arch.
TorchRec writes its collectives by hand as Req/Wait pairs of autograd Functions
(``torchrec/distributed/comm_ops.py``): in backward, ``All2All_Pooled_WaitBackward`` launches the pooled
embeddings' gradient all_to_all and ``All2All_Pooled_ReqBackward`` waits for it. Stock runs them back to
back after the dense arch, so the communication is exposed. torch_ext knows these classes
(``torch_ext.collectives``): it drives to the launch first and runs the wait as late as the nodes reading
its result allow, so the dense arch's backward runs while the bytes move. Nothing TorchRec-specific is
written by the user: ``torch_ext.enable()`` (here ``with torch_ext.enable():`` around the variant's steps).

Variants, alternating within every repetition, the slowest rank's time counting:

  stock      the training step on PyTorch's engine
  torch_ext  the same step under ``torch_ext.enable()``
  comm       the backward all_to_all alone: ``dist.all_to_all_single`` of the same pooled gradient
             bytes, between the steps (reported; T_comm is stock's wait with no dense layer, below)

Each step is timed as a whole (forward, backward, the dense SGD update; the tables' update is fused into
their backward) and its backward alone, with the time its thread was blocked in it (``_common.timed_blocking``:
in the wait node, ``All2All_Pooled_ReqBackward``, where the step blocks on the transfer). The exposed
communication is the slowest rank's backward minus the longest time any rank spent unblocked in it
(``_common.exposed_past_the_slowest_rank``: a rank's wait for the other to arrive is not communication), as
overlap.py and moe_sync.py read it; overlap efficiency = 1 - exposed / T_comm: 0 when the whole transfer is
waited for, 1 when it had already arrived. T_comm is the same measure of stock's backward in a DLRM with no
dense layer to hide the transfer behind, the median of 15 steps (_common.calibrate_t_comm).

The dense arch is not wrapped in DistributedDataParallel (``init_data_parallel=False``): DDP's all_reduce of its
gradients would share the link with the all_to_all and set the dense arch's backward by its traffic.

Sizes: each rank looks up BATCH samples; the pooled gradient each rank sends the other is
BATCH * (TABLES / 2) * DIM floats (2 MiB with the defaults, 36-38 ms on the shaped link). The dense arch's
backward is swept over multiples of T_comm (``--ratios``; full 0.25,0.5,1,1.5,2, quick 1 alone: the headline's point): the script
measures T_comm and one Linear(HIDDEN, HIDDEN) layer's backward (both ranks agree on the larger) and gives
the dense arch the depth that makes its backward ``ratio`` x T_comm. Each point also reports the ratio it
measured: its compute over T_comm, the compute being stock's backward less its exposed time, repetition by
repetition (there is no communication-free variant of a sharded TorchRec model). The ideal efficiency is min(1,
that): no more communication can hide than there is compute beside it. Beside each torch_ext efficiency stands one
by step time: 1 - (its backward - the same repetition's stock compute) / T_comm.

The ranks run as two hosts (``_hosts.run_on_two_hosts``: two network namespaces joined by a veth shaped
to 1 Gbit/s, each rank started by torchrun in its own), falling back as overlap.py says. Before timing,
one step of each engine must give torch.equal dense gradients, losses and local tables after the fused
update at every sweep point, or the script fails. With ``--timeline PNG`` rank 0 draws one traced torch_ext
backward at the point nearest ratio 1.

    python benchmarks/recsys_torchrec.py [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...]
        [--timeline PNG] [--out CSV]
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from _common import (
    CALIBRATION_S,
    Summary,
    SummaryRow,
    SweepConfig,
    calibrate_t_comm,
    csv_row,
    dense_layer_backward_s,
    exposure,
    git_sha,
    headline_over_stock,
    load_note,
    measured_ratio,
    measured_ratio_row,
    merge_ranks,
    parse_sweep_args,
    plot_efficiency_curves,
    print_load,
    print_t_comm,
    run_sweep,
    scenario_and_link,
    step_efficiency,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_config,
    sweep_depth,
    sweep_parser,
    sweep_summary_row,
    timed_blocking,
    timed_repetitions,
    write_csv,
)
from _hosts import agreed_max, timed_all_to_all

import torch_ext
from torch_ext.testing import dlrm_batch, sharded_dlrm

WORLD_SIZE = 2
TABLES = 8
ROWS = 20_000
DIM = 256
BATCH = 512
DENSE_FEATURES = 256
HIDDEN = 256
# One dense layer's backward is 1-2 ms here against a ~36 ms transfer: the x2 point needs up to ~72 layers.
MAX_DENSE_LAYERS = 160
LEARNING_RATE = 0.01
VARIANTS = ("stock", "torch_ext", "comm")
ENGINE_VARIANTS = ("stock", "torch_ext")


def has_torchrec() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))


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
    """The pooled gradient's all_to_all alone: each rank sends the other BATCH * TABLES/2 * DIM floats."""
    return {"backward_s": timed_all_to_all(torch.randn(WORLD_SIZE * BATCH * (TABLES // 2) * DIM))}


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


def _run_rank(config: SweepConfig) -> dict:
    """One rank's part, in the process group: its times per sweep point and variant."""
    rank = dist.get_rank()
    probe = _dlrm(0)
    probe_params, probe_batch = _dense_params(probe), _batch(rank, 0)
    comm_s = calibrate_t_comm(lambda: _step(probe, probe_params, probe_batch, "stock"))
    t_comm = statistics.median(comm_s)
    t_layer = agreed_max(dense_layer_backward_s(HIDDEN, BATCH, config.calibration_reps, CALIBRATION_S))
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


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV from every rank's result; ``load``: the runnable tasks while the ranks
    ran, where known."""
    sha = git_sha()
    # The calibration is the same on every rank (agreed, or from every rank's times).
    result = results[0]
    print(
        f"\nrecsys_torchrec: DLRM {TABLES} tables x {DIM}d table-wise, {link}; calibration: T_comm "
        f"{statistics.median(result['comm_s']) * 1e3:.1f} ms, one dense layer {result['t_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<10} {'step ms: median [p20-p80]':<26} {'/stock':>6} "
        f"{'backward ms':<22} {'/stock':>6} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>5}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (_common.calibrate_t_comm says why not the comm
    # variant).
    all_comm = summarize([t * 1e3 for t in result["comm_s"]])
    t_comm = all_comm.median / 1e3
    scenario = f"DLRM {TABLES} tables x {DIM}d table-wise"
    rows = [csv_row("comm", "recsys", f"{scenario}, {link}", "t_comm_ms", all_comm, sha)]
    for point in merge_ranks([r["points"] for r in results]):
        samples = point["samples"]
        comm = summarize([t * 1e3 for t in samples["comm"]["backward_s"]])
        stock_step = statistics.median(samples["stock"]["step_s"])
        stock_backward = statistics.median(samples["stock"]["backward_s"])
        case = sweep_case("recsys", point["ratio"])
        size = f"{scenario}, {point['dense_layers']} dense layers, {link}"
        # Stock's compute, repetition by repetition: its backward less the communication it waited for.
        stock_compute = [
            b - e for b, e in zip(samples["stock"]["backward_s"], samples["stock"]["exposed_s"], strict=True)
        ]
        ratio = measured_ratio(stock_compute, t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in ENGINE_VARIANTS:
            step = summarize([t * 1e3 for t in samples[variant]["step_s"]])
            backward = summarize([t * 1e3 for t in samples[variant]["backward_s"]])
            exposed, efficiency = exposure(samples[variant]["exposed_s"], t_comm)
            rows.append(csv_row(variant, case, size, "step_ms", step, sha))
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            rows.append(csv_row(variant, case, size, "exposed_ms", exposed, sha))
            rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
            by_step_text = ""
            if variant != "stock":
                by_step = step_efficiency(samples[variant]["backward_s"], stock_compute, t_comm)
                rows.append(csv_row(variant, case, size, "step_efficiency", by_step, sha))
                by_step_text = f"{by_step.median:.2f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<10} {step!s:<26} "
                f"{step.median / 1e3 / stock_step:6.2f} {backward!s:<22} "
                f"{backward.median / 1e3 / stock_backward:6.2f} {exposed.median:10.1f} {efficiency.median:10.2f} "
                f"{by_step_text:>7} {ideal:5.2f}"
            )
        rows.append(csv_row("comm", case, size, "backward_ms", comm, sha))
        print(f"{point['ratio']:5g} {point['dense_layers']:6d} {'comm':<10} {'':<26} {'':>6} {comm!s:<22}")
        print(f"{point['ratio']:5g} {point['dense_layers']:6d} measured ratio (stock's compute / T_comm) {ratio:.2f}")
    if load is not None:
        rows.append(csv_row("machine", "recsys", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print_t_comm(all_comm, len(result["comm_s"]))
    print_load(load)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        __doc__,
        "recsys_torchrec",
        quick_help="fewer repetitions and sweep points",
        timeline_help="draw one traced torch_ext backward of rank 0",
    )
    args = parse_sweep_args(parser, argv)
    if not has_torchrec():
        # bench lists a benchmark that exits 0 with this line as skipped.
        print("recsys_torchrec: skipped: TorchRec is not installed (README, 'TorchRec')")
        return 0
    config = sweep_config(args, "recsys_torchrec", quick_reps=11, reps=20)
    announce = (
        f"recsys_torchrec: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    return run_sweep(__file__, args, argv, lambda: _run_rank(config), report, announce)


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per engine. The headline is the overlap efficiency at the headline point
    (``_common.headline_point``), beside its ideal, and step and backward time against stock there."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "DLRM ..., <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, link = scenario_and_link(rows[("stock", points[0][1], "step_ms")]["size"])
    t_comm = rows[("comm", "recsys", "t_comm_ms")]["median"]
    summary = []
    for variant in ENGINE_VARIANTS:
        step, backward = (headline_over_stock(rows, variant, points, metric) for metric in ("step_ms", "backward_ms"))
        summary.append(
            sweep_summary_row(
                "recsys_torchrec",
                link,
                variant,
                rows,
                points,
                {"ratio": step, "backward_ratio": backward},
                lead=f"step / stock {step:.2f}, backward {backward:.2f}; ",
                stock_note=f"; T_comm {t_comm:.3g} ms, {scenario}" + load_note(rows, "recsys"),
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("TorchRec DLRM: its embedding all_to_all's backward beside the dense arch, 2 gloo ranks")


if __name__ == "__main__":
    sys.exit(main())
