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
their backward) and its backward alone. The exposed communication is the time the wait node
(``All2All_Pooled_ReqBackward``) blocks, measured by hooks on that node (before and after it runs), the
slower rank's; overlap efficiency = 1 - exposed / T_comm: 0 when the whole transfer is waited for there, 1
when it had already arrived. (overlap.py and moe_sync.py take it from the backward thread's blocked time,
_common.timed_blocking; the wait node is where this step blocks on the transfer.) T_comm is how long stock's
wait node blocks in a DLRM with no dense layer to hide the transfer behind, the median of 15 steps' slower
rank (_common.slowest_rank_samples).

The dense arch is not wrapped in DistributedDataParallel (``init_data_parallel=False``): DDP's all_reduce of its
gradients would share the link with the all_to_all and set the dense arch's backward by its traffic.

Sizes: each rank looks up BATCH samples; the pooled gradient each rank sends the other is
BATCH * (TABLES / 2) * DIM floats (2 MiB with the defaults, 36-38 ms on the shaped link). The dense arch's
backward is swept over multiples of T_comm (``--ratios``; quick 0.5,1,2, full 0.25,0.5,1,1.5,2): the script
times the transfer and one Linear(HIDDEN, HIDDEN) layer's backward (both ranks agree on the larger) and gives
the dense arch the depth that makes its backward ``ratio`` x T_comm. Only the dense arch can hide the
transfer (the tables' backward needs its result): the ideal efficiency is min(1, ratio).

The ranks run as two hosts (``_hosts.run_on_two_hosts``: two network namespaces joined by a veth shaped
to 1 Gbit/s, each rank started by torchrun in its own), falling back as overlap.py says. Before timing,
one step of each engine must give torch.equal dense gradients, losses and local tables after the fused
update at every sweep point, or the script fails. With ``--timeline PNG`` rank 0 draws one traced torch_ext
backward at the point nearest ratio 1.

    python benchmarks/recsys_torchrec.py [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...]
        [--timeline PNG] [--out CSV]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _common import (
    Summary,
    SummaryRow,
    csv_row,
    dense_layer_backward_s,
    git_sha,
    parse_ratios,
    plot_efficiency_curves,
    progress,
    runnable_tasks,
    slowest_rank_samples,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_depth,
    write_csv,
)
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    agreed_max,
    leave_rank,
    run_on_two_hosts,
    timed_all_to_all,
    write_rank_result,
)

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
# The dense arch's backward as multiples of T_comm. Quick: three points, enough to see the curve bend.
RATIOS = (0.25, 0.5, 1.0, 1.5, 2.0)
QUICK_RATIOS = (0.5, 1.0, 2.0)
# T_comm: how long stock's backward waits for the all_to_all with no dense layer to hide it behind, the slower
# rank's (_common.slowest_rank_samples): the median of this many steps, after a few untimed ones (a process's first
# all_to_all is slower: 1.5x in moe_sync.py). ~2 s.
WARMUP_STEPS = 3
# Seconds of calls one dense layer's calibration takes at least (_common.dense_layer_backward_s).
CALIBRATION_S = 2.0
COMM_CALIBRATION_REPS = 15
LEARNING_RATE = 0.01
# TorchRec's Req/Wait pair for pooled embeddings: which node launches the backward all_to_all, which waits.
LAUNCH, WAIT = "All2All_Pooled_WaitBackward", "All2All_Pooled_ReqBackward"

VARIANTS = ("stock", "torch_ext", "comm")
ENGINE_VARIANTS = ("stock", "torch_ext")


@dataclass(frozen=True)
class Config:
    ratios: tuple[float, ...]
    reps: int
    warmup: int
    calibration_reps: int
    timeline_png: str | None = None


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


def _batch(rank: int, step: int):
    return dlrm_batch(
        seed=1000 * step + rank,
        batch=BATCH,
        dense_features=DENSE_FEATURES,
        tables=TABLES,
        rows=ROWS,
        ids_per_bag=(1, 4),
    )


class WaitTimer:
    """Hooks on the graph's wait node: how long it ran (the time the step blocked on the transfer)."""

    def __init__(self) -> None:
        self.start = self.seconds = None

    def attach(self, loss: torch.Tensor) -> None:
        self.start = self.seconds = None
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node.name() == WAIT:
                node.register_prehook(self._before)
                node.register_hook(self._after)
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _before(self, grads):
        self.start = time.perf_counter()

    def _after(self, grads_in, grads_out):
        self.seconds = time.perf_counter() - self.start


def _engine(variant: str):
    return torch_ext.enable() if variant == "torch_ext" else contextlib.nullcontext()


def _step(model, dense_params, batch, variant: str, wait_timer: WaitTimer) -> tuple[float, float, float | None]:
    """One training step: (whole step s, backward s, wait node s)."""
    dense, sparse, labels = batch
    dist.barrier()
    start = time.perf_counter()
    logits = model(dense, sparse).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    wait_timer.attach(loss)
    backward_start = time.perf_counter()
    with _engine(variant):
        loss.backward()
    backward_end = time.perf_counter()
    with torch.no_grad():
        for p in dense_params:
            p.add_(p.grad, alpha=-LEARNING_RATE)
            p.grad = None
    end = time.perf_counter()
    return end - start, backward_end - backward_start, wait_timer.seconds


def _comm_only() -> float:
    """The pooled gradient's all_to_all alone: each rank sends the other BATCH * TABLES/2 * DIM floats."""
    return timed_all_to_all(torch.randn(WORLD_SIZE * BATCH * (TABLES // 2) * DIM))


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
        dense_params = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
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


def _time_point(model, dense_params, rank: int, config: Config) -> dict[str, dict[str, list[float]]]:
    """Every variant's step, backward and wait seconds at one sweep point, ``config.reps`` after the warm-up."""
    wait_timer = WaitTimer()
    samples: dict[str, dict[str, list[float]]] = {
        variant: {"step_s": [], "backward_s": [], "wait_s": []} for variant in ENGINE_VARIANTS
    }
    samples["comm"] = {"backward_s": []}
    for rep in range(config.warmup + config.reps):
        batch = _batch(rank, rep + 1)
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for variant in order:
            if variant == "comm":
                measured = {"backward_s": _comm_only()}
            else:
                step_s, backward_s, wait_s = _step(model, dense_params, batch, variant, wait_timer)
                measured = {"step_s": step_s, "backward_s": backward_s, "wait_s": wait_s}
            if rep >= config.warmup:
                for key, value in measured.items():
                    samples[variant][key].append(value)
    return samples


def _run_rank(config: Config) -> list[dict]:
    torch.set_num_threads(1)  # two ranks may share two cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        probe = _dlrm(0)
        probe_params = [p for name, p in probe.named_parameters() if "embedding_bags" not in name]
        probe_batch, wait_timer = _batch(rank, 0), WaitTimer()
        for _ in range(WARMUP_STEPS):
            _step(probe, probe_params, probe_batch, "stock", wait_timer)
        comm_s = slowest_rank_samples(
            lambda: _step(probe, probe_params, probe_batch, "stock", wait_timer)[2], COMM_CALIBRATION_REPS
        )
        t_comm = statistics.median(comm_s)
        t_layer = agreed_max(dense_layer_backward_s(HIDDEN, BATCH, config.calibration_reps, CALIBRATION_S))
        traced_ratio = min(config.ratios, key=lambda ratio: abs(ratio - 1.0))
        points, timeline = [], None
        for ratio in config.ratios:
            dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
            _check_same_bits(dense_layers, rank)
            model = _dlrm(dense_layers)
            dense_params = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
            samples = _time_point(model, dense_params, rank, config)
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
        result = {"points": points, "comm_s": comm_s, "t_layer_s": t_layer}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def slowest_rank(results: list[dict]) -> dict:
    """Each repetition's times, the wait's included, as its slowest rank's (the step waits for it)."""
    first = results[0]
    points = []
    for index, point in enumerate(first["points"]):
        merged = {
            variant: {
                metric: [
                    max(per_rank)
                    for per_rank in zip(*(r["points"][index]["samples"][variant][metric] for r in results))
                ]
                for metric in metrics
            }
            for variant, metrics in point["samples"].items()
        }
        points.append({**point, "samples": merged})
    return {**first, "points": points}


def report(result: dict, link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    print(
        f"\nrecsys_torchrec: DLRM {TABLES} tables x {DIM}d table-wise, {link}; calibration: T_comm "
        f"{statistics.median(result['comm_s']) * 1e3:.1f} ms, one dense layer {result['t_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<10} {'step ms: median [p20-p80]':<26} {'/stock':>6} "
        f"{'backward ms':<22} {'/stock':>6} {'exposed ms':>10} {'efficiency':>10} {'ideal':>5}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (_common.slowest_rank_samples says why not the
    # comm variant).
    all_comm = summarize([t * 1e3 for t in result["comm_s"]])
    t_comm = all_comm.median / 1e3
    scenario = f"DLRM {TABLES} tables x {DIM}d table-wise"
    rows = [csv_row("comm", "recsys", f"{scenario}, {link}", "t_comm_ms", all_comm, sha)]
    for point in result["points"]:
        samples = point["samples"]
        comm = summarize([t * 1e3 for t in samples["comm"]["backward_s"]])
        stock_step = statistics.median(samples["stock"]["step_s"])
        stock_backward = statistics.median(samples["stock"]["backward_s"])
        ideal = min(1.0, point["ratio"])
        case = sweep_case("recsys", point["ratio"])
        size = f"{scenario}, {point['dense_layers']} dense layers, {link}"
        for variant in ENGINE_VARIANTS:
            step = summarize([t * 1e3 for t in samples[variant]["step_s"]])
            backward = summarize([t * 1e3 for t in samples[variant]["backward_s"]])
            exposed = summarize([t * 1e3 for t in samples[variant]["wait_s"]])
            efficiency = summarize([1 - t / t_comm for t in samples[variant]["wait_s"]])
            rows.append(csv_row(variant, case, size, "step_ms", step, sha))
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            rows.append(csv_row(variant, case, size, "exposed_ms", exposed, sha))
            rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<10} {step!s:<26} "
                f"{step.median / 1e3 / stock_step:6.2f} {backward!s:<22} "
                f"{backward.median / 1e3 / stock_backward:6.2f} {exposed.median:10.1f} {efficiency.median:10.2f} "
                f"{ideal:5.2f}"
            )
        rows.append(csv_row("comm", case, size, "backward_ms", comm, sha))
        print(f"{point['ratio']:5g} {point['dense_layers']:6d} {'comm':<10} {'':<26} {'':>6} {comm!s:<22}")
    if load is not None:
        rows.append(csv_row("machine", "recsys", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print(
        f"T_comm {all_comm} ms (stock's wait with no dense layer, {len(result['comm_s'])} steps; "
        "efficiency = 1 - exposed / its median)"
    )
    if load is not None:
        print(f"runnable tasks while the ranks ran: {load} (the ranks make 2; more: other processes on the 2 cores)")
    print(f"wrote {out}")


def _config(args: argparse.Namespace) -> Config:
    timeline_png = None
    if args.timeline is not None:
        if importlib.util.find_spec("matplotlib") is None:
            progress(
                "recsys_torchrec: --timeline skipped: matplotlib is not installed (pip install 'torch_ext[bench]')"
            )
        else:
            timeline_png = os.path.abspath(args.timeline)
    return Config(
        ratios=args.ratios or (QUICK_RATIOS if args.quick else RATIOS),
        reps=args.reps or (11 if args.quick else 20),
        warmup=1 if args.quick else 2,
        # Calls of the calibration's stack of layers at least (_common.dense_layer_backward_s).
        calibration_reps=25 if args.quick else 31,
        timeline_png=timeline_png,
    )


def _rank_main(args: argparse.Namespace) -> None:
    results = _run_rank(_config(args))
    if args.rank_results is not None:
        write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
    elif os.environ["RANK"] == "0":
        report(slowest_rank(results), f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
    leave_rank()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sweep points")
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant at every sweep point")
    parser.add_argument("--ratios", type=parse_ratios, help="dense backward / T_comm to sweep, e.g. 0.5,1,2")
    parser.add_argument("--network", choices=MODES, default=MODES[0], help="where the 2 ranks run (default two-hosts)")
    parser.add_argument("--out", default="results/recsys_torchrec.csv", help="long-format CSV to write")
    parser.add_argument("--timeline", metavar="PNG", help="draw one traced torch_ext backward of rank 0")
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    if not has_torchrec():
        # bench lists a benchmark that exits 0 with this line as skipped.
        print("recsys_torchrec: skipped: TorchRec is not installed (README, 'TorchRec')")
        return 0
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        _rank_main(args)
    config = _config(args)
    progress(
        f"recsys_torchrec: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    forwarded = sys.argv[1:] if argv is None else list(argv)
    with runnable_tasks() as load:
        run = run_on_two_hosts(__file__, forwarded, mode=args.network)
    report(slowest_rank(run.results), run.network.label, args.out, load())
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per engine. The headline is the sweep's mean overlap efficiency, beside the ideal's mean; step and
    backward time against stock are medians over the sweep."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "DLRM ..., <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, _, link = rows[("stock", points[0][1], "step_ms")]["size"].rpartition(", ")
    scenario = scenario.rpartition(", ")[0]
    ideal = statistics.mean(min(1.0, ratio) for ratio, _ in points)
    t_comm = rows[("comm", "recsys", "t_comm_ms")]["median"]

    def over_stock(variant: str, metric: str) -> float:
        return statistics.median(
            rows[(variant, case, metric)]["median"] / rows[("stock", case, metric)]["median"] for _, case in points
        )

    summary = []
    for variant in ENGINE_VARIANTS:
        efficiencies = [rows[(variant, case, "efficiency")]["median"] for _, case in points]
        exposed = [rows[(variant, case, "exposed_ms")]["median"] for _, case in points]
        mean_efficiency = statistics.mean(efficiencies)
        values = {
            "efficiency": mean_efficiency,
            "ideal_efficiency": ideal,
            "exposed_ms": statistics.mean(exposed),
            "ratio": over_stock(variant, "step_ms"),
            "backward_ratio": over_stock(variant, "backward_ms"),
            # The curve, for the plot.
            **{f"efficiency x{ratio:g}": eff for (ratio, _), eff in zip(points, efficiencies, strict=True)},
        }
        per_point = ", ".join(f"x{ratio:g}: {eff:.2f}" for (ratio, _), eff in zip(points, efficiencies, strict=True))
        notes = (
            f"step / stock {values['ratio']:.2f}, backward {values['backward_ratio']:.2f}; efficiency by dense/comm "
            f"ratio {per_point}; exposed {values['exposed_ms']:.1f} ms on average"
        )
        if variant == "stock":
            notes += f"; T_comm {t_comm:.3g} ms, {scenario}"
            load = rows.get(("machine", "recsys", "runnable_tasks"))
            if load is not None:
                notes += f"; runnable tasks {load['median']:g} (the ranks: 2)"
        summary.append(
            SummaryRow(
                "recsys_torchrec",
                link,
                variant,
                "stock",
                f"efficiency {mean_efficiency:.2f} (ideal {ideal:.2f})",
                f"{values['ratio']:.2f}",
                notes,
                values,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("TorchRec DLRM: its embedding all_to_all's backward beside the dense arch, 2 gloo ranks")


if __name__ == "__main__":
    sys.exit(main())
