"""A synchronous MoE all_to_all (Megatron-core's and DeepSpeed's ``_AllToAll``): priority alone, and the lane.

Megatron-core and DeepSpeed write their expert all_to_all as an autograd Function whose backward runs the
gradient's all_to_all synchronously, inside its node. On 2 ranks as 2 hosts on the shaped link
(``_hosts.run_on_two_hosts``), an expert-parallel layer (tokens dispatched to one expert per rank at a fixed
capacity, combined back) beside a dense path, for each library:

  compute    stock's backward of the same layer with the all_to_all replaced by the identity (no communication)
  stock      the backward on PyTorch's engine: dense path first, then the all_to_all
  torch_ext  torch_ext with the _AllToAll undeclared, as a new user gets it: stock's order on its engine
  priority   torch_ext with the _AllToAll registered as a launch (torch_ext.register_collective_backward): the
             all_to_all first, still blocking the engine
  lane       torch_ext with torch_ext.run_in_lane(_AllToAll): the all_to_all dispatched first to its group's
             lane, the dense path run beside it
  checked    the lane with the collective order check on (torch_ext.check_collective_order): its cost
  comm       the all_to_all alone (T_comm)

The dense path's backward is swept over multiples of T_comm (--ratios): exposed communication is
backward - compute, overlap efficiency 1 - exposed / T_comm; the ideal is min(1, ratio) (only the dense path can
hide the all_to_all; the expert's backward needs its result). Reported per library and ratio: backward and step
time (forward, backward and an SGD step) as medians of the slower rank, and the efficiency. Before timing, one
backward of each engine variant must give torch.equal gradients to stock's.

    python benchmarks/moe_sync.py [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...] [--out CSV]
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
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from _common import SummaryRow, csv_row, git_sha, median_backward_s, progress, summarize, write_csv
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    agreed_max,
    leave_rank,
    run_on_two_hosts,
    timed_all_to_all,
    write_rank_result,
)
from torch import nn

import torch_ext

WORLD_SIZE = 2
# Tokens each rank sends each expert, and their width: 2048 x 256 floats = 2 MiB to the other rank, about
# 17 ms at 1 Gbit/s.
CAPACITY = 2048
DIM = 256
# The dense path reads this many of the tokens: one of its layers' backward is then ~4.5 ms here, a quarter of
# T_comm, fine enough a step for the sweep (all 4096 rows made a layer ~19 ms, the sweep's points 0.5 apart).
DENSE_ROWS = 1024
MAX_DENSE_LAYERS = 64
# The dense path's backward as multiples of T_comm. Quick: three points, enough to see the curve bend.
RATIOS = (0.25, 0.5, 1.0, 1.5, 2.0)
QUICK_RATIOS = (0.5, 1.0, 2.0)
# Untimed all_to_alls before calibrating: the first ones of a process are slower.
WARMUP_ALL_TO_ALLS = 3
ENGINE_VARIANTS = ("stock", "torch_ext", "priority", "lane", "checked")
TIMED_VARIANTS = ("compute", *ENGINE_VARIANTS)
LIBRARIES = ("megatron", "deepspeed")
LIBRARY_NAMES = {"megatron": "Megatron-core", "deepspeed": "DeepSpeed"}


def installed_libraries() -> list[str]:
    found = []
    for library, module in (("megatron", "megatron.core"), ("deepspeed", "deepspeed.moe")):
        if importlib.util.find_spec(library) is not None and importlib.util.find_spec(module) is not None:
            found.append(library)
    return found


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


def _identity(group, tokens: torch.Tensor) -> torch.Tensor:
    return tokens


class Layer(nn.Module):
    def __init__(self, all_to_all: Callable, dense_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(dense_layers)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else _identity
        group = dist.group.WORLD
        returned = all_to_all(group, self.expert(all_to_all(group, tokens)))
        moe = self.head(returned * torch.sigmoid(self.gate(tokens))).sum()
        return moe + self.dense(tokens[:DENSE_ROWS]).sum()


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The engine and declaration of ``variant``; the _AllToAll is back to undeclared afterwards."""
    if variant in ("stock", "compute"):
        yield
        return
    if variant == "torch_ext":
        with torch_ext.enabled():
            yield
        return
    if variant == "priority":
        torch_ext.register_collective_backward(launches=function)
    else:
        torch_ext.run_in_lane(function)
    checked = variant == "checked"
    if checked:
        # Its exchange group is made at the first check, in _check_bits, before anything is timed.
        torch_ext.check_collective_order(group=_check_group())
    try:
        with torch_ext.enabled():
            yield
    finally:
        torch_ext.unregister_collective_backward(function)
        if checked:
            torch_ext.check_collective_order(False)


_CHECK_GROUP = []


def _check_group():
    """One gloo group for the order check's exchanges, made once (new_group is itself collective)."""
    if not _CHECK_GROUP:
        _CHECK_GROUP.append(dist.new_group(backend="gloo"))
    return _CHECK_GROUP[0]


def _step(model: Layer, optimizer, tokens: torch.Tensor, variant: str, function: type) -> tuple[float, float]:
    """(backward s, step s): forward, backward and an SGD step, the ranks started together."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, communicate=variant != "compute")
    with variant_engine(variant, function):
        backward_start = time.perf_counter()
        loss.backward()
        backward_s = time.perf_counter() - backward_start
    optimizer.step()
    return backward_s, time.perf_counter() - start


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


def _calibrate(calibration_reps: int) -> tuple[float, float]:
    """(T_comm, one dense layer's backward s), the slower rank's, before any library is imported."""
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    for _ in range(WARMUP_ALL_TO_ALLS):
        timed_all_to_all(tokens)
    t_comm = agreed_max(statistics.median(timed_all_to_all(tokens) for _ in range(calibration_reps)))
    layer = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
    x = torch.randn(DENSE_ROWS, DIM, requires_grad=True)
    t_layer = agreed_max(median_backward_s(lambda: layer(x).sum(), calibration_reps))
    return t_comm, t_layer


def _run_library(library: str, ratios: Sequence[float], reps: int, warmup: int, t_comm: float, t_layer: float) -> dict:
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(library)
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    points = []
    for ratio in ratios:
        dense_layers = int(min(MAX_DENSE_LAYERS, max(1, round(ratio * t_comm / t_layer))))
        torch.manual_seed(rank)
        model = Layer(all_to_all, dense_layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        _check_bits(model, tokens, function, rank, library)
        samples = {variant: {"backward_s": [], "step_s": []} for variant in TIMED_VARIANTS}
        comm = []
        for rep in range(warmup + reps):
            shift = rep % len(TIMED_VARIANTS)
            for variant in TIMED_VARIANTS[shift:] + TIMED_VARIANTS[:shift]:
                backward_s, step_s = _step(model, optimizer, tokens, variant, function)
                if rep >= warmup:
                    samples[variant]["backward_s"].append(backward_s)
                    samples[variant]["step_s"].append(step_s)
            if rep >= warmup:
                comm.append(timed_all_to_all(tokens))
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples, "comm_s": comm})
    return {"t_comm": t_comm, "t_layer": t_layer, "points": points}


def _run_rank(libraries: Sequence[str], ratios: Sequence[float], reps: int, warmup: int, calibration_reps: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        # Once, for every library: calibrated after each library's import, the first one's T_comm read 1.5-1.8x
        # the all_to_all's time in its timed repetitions (28.9 and 37.1 ms against about 20), so its sweep points
        # were that much longer than the ratios asked for.
        t_comm, t_layer = _calibrate(calibration_reps)
        result = {library: _run_library(library, ratios, reps, warmup, t_comm, t_layer) for library in libraries}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def report(results: list[dict], link: str, out: str) -> None:
    sha = git_sha()
    rows = []
    for library in results[0]:
        calibration = results[0][library]
        print(
            f"\nmoe_sync, {LIBRARY_NAMES[library]}: {CAPACITY} tokens x {DIM}d per expert, {link}; "
            f"T_comm {calibration['t_comm'] * 1e3:.1f} ms, one dense layer {calibration['t_layer'] * 1e3:.2f} ms"
        )
        print(
            f"{'ratio':>5} {'layers':>6} {'variant':<9} {'backward ms':>12} {'/stock':>7} {'step ms':>9} "
            f"{'/stock':>7} {'efficiency':>10} {'ideal':>6}"
        )
        for index, point in enumerate(calibration["points"]):

            def slowest(variant: str, metric: str, index=index, library=library) -> list[float]:
                per_rank = [r[library]["points"][index]["samples"][variant][metric] for r in results]
                return [max(times) for times in zip(*per_rank, strict=True)]

            comm = [max(times) for times in zip(*(r[library]["points"][index]["comm_s"] for r in results))]
            t_comm = statistics.median(comm)
            compute = slowest("compute", "backward_s")
            case = f"{library} x{point['ratio']:g}"
            size = f"{CAPACITY} tokens x {DIM}d per expert, {point['dense_layers']} dense layers, {link}"
            rows.append(csv_row("comm", case, size, "backward_ms", summarize([t * 1e3 for t in comm]), sha))
            stock_backward = statistics.median(slowest("stock", "backward_s"))
            stock_step = statistics.median(slowest("stock", "step_s"))
            ideal = min(1.0, point["ratio"])
            for variant in TIMED_VARIANTS:
                backward = slowest(variant, "backward_s")
                step = slowest(variant, "step_s")
                backward_summary = summarize([t * 1e3 for t in backward])
                step_summary = summarize([t * 1e3 for t in step])
                rows.append(csv_row(variant, case, size, "backward_ms", backward_summary, sha))
                rows.append(csv_row(variant, case, size, "step_ms", step_summary, sha))
                efficiency = ""
                if variant != "compute":
                    # Per repetition: the same repetition's compute-only backward is the baseline.
                    exposed = [b - c for b, c in zip(backward, compute, strict=True)]
                    eff = summarize([1 - e / t_comm for e in exposed])
                    rows.append(csv_row(variant, case, size, "efficiency", eff, sha))
                    efficiency = f"{eff.median:10.2f}"
                print(
                    f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<9} {backward_summary.median:12.1f} "
                    f"{backward_summary.median / 1e3 / stock_backward:7.2f} {step_summary.median:9.1f} "
                    f"{step_summary.median / 1e3 / stock_step:7.2f} {efficiency:>10} {ideal:6.2f}"
                )
    write_csv(out, rows)
    print(f"wrote {out}")


def _ratios(text: str) -> tuple[float, ...]:
    ratios = tuple(float(part) for part in text.split(","))
    if not ratios or any(r <= 0 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be positive numbers separated by commas, got {text!r}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sweep points")
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant")
    parser.add_argument("--ratios", type=_ratios, help="dense backward / T_comm to sweep, e.g. 0.5,1,2")
    parser.add_argument("--network", choices=MODES, default=MODES[0], help="where the 2 ranks run (default two-hosts)")
    parser.add_argument("--out", default="results/moe_sync.csv", help="long-format CSV to write")
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    libraries = installed_libraries()
    if not libraries:
        print(
            "moe_sync: skipped: neither Megatron-core nor DeepSpeed is installed "
            "(pip install torch==2.13.0 megatron-core==0.16.1 deepspeed==0.19.8)"
        )
        return 0
    reps = args.reps or (5 if args.quick else 15)
    ratios = args.ratios or (QUICK_RATIOS if args.quick else RATIOS)
    warmup, calibration_reps = (1, 5) if args.quick else (2, 9)
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        results = _run_rank(libraries, ratios, reps, warmup, calibration_reps)
        if args.rank_results is not None:
            write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
        elif os.environ["RANK"] == "0":
            report(results, f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
        leave_rank()
    progress(
        f"moe_sync: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {', '.join(libraries)}, "
        f"ratios {','.join(f'{r:g}' for r in ratios)}, {reps} repetitions"
    )
    forwarded = sys.argv[1:] if argv is None else list(argv)
    run = run_on_two_hosts(__file__, forwarded, mode=args.network)
    report(run.results, run.network.label, args.out)
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def _sweep(rows: dict) -> dict[str, list[tuple[float, str]]]:
    """library -> [(ratio, case)] in the CSV's order."""
    sweep: dict[str, list[tuple[float, str]]] = {}
    for what, case, metric in rows:
        if what == "stock" and metric == "backward_ms":
            library, _, ratio = case.partition(" x")
            sweep.setdefault(library, []).append((float(ratio), case))
    return sweep


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library and engine variant. The headline is the sweep's mean overlap efficiency, beside the
    ideal's mean; step time against stock is the median over the sweep."""
    summary = []
    for library, points in _sweep(rows).items():
        link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")[2]
        ideal = statistics.mean(min(1.0, ratio) for ratio, _ in points)
        for variant in ENGINE_VARIANTS:
            if (variant, points[0][1], "efficiency") not in rows:
                continue  # a CSV from before the variant existed
            efficiencies = [rows[(variant, case, "efficiency")]["median"] for _, case in points]
            step_ratios = [
                rows[(variant, case, "step_ms")]["median"] / rows[("stock", case, "step_ms")]["median"]
                for _, case in points
            ]
            backward_ratios = [
                rows[(variant, case, "backward_ms")]["median"] / rows[("stock", case, "backward_ms")]["median"]
                for _, case in points
            ]
            mean_efficiency = statistics.mean(efficiencies)
            step_ratio = statistics.median(step_ratios)
            values = {
                "efficiency": mean_efficiency,
                "ideal_efficiency": ideal,
                "step_ratio": step_ratio,
                "ratio": statistics.median(backward_ratios),
                # The curve, for the plot.
                **{f"efficiency x{ratio:g}": eff for (ratio, _), eff in zip(points, efficiencies, strict=True)},
            }
            per_point = ", ".join(f"x{ratio:g}: {eff:.2f}" for (ratio, _), eff in zip(points, efficiencies))
            summary.append(
                SummaryRow(
                    "moe_sync",
                    f"{LIBRARY_NAMES.get(library, library)}, {link}",
                    variant,
                    "stock",
                    f"efficiency {mean_efficiency:.2f} (ideal {ideal:.2f})",
                    f"{values['ratio']:.2f}",
                    f"step / stock {step_ratio:.2f}; efficiency by dense/comm ratio {per_point}",
                    values,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases, strict=True):
        ratios: list[float] = []
        for row in (r for r in rows if r.case == case):
            curve = sorted(
                (float(key.removeprefix("efficiency x")), value)
                for key, value in row.values.items()
                if key.startswith("efficiency x")
            )
            ratios = [ratio for ratio, _ in curve]
            ax.plot(ratios, [eff for _, eff in curve], marker="o", label=row.variant)
        ax.plot(ratios, [min(1.0, r) for r in ratios], linestyle="--", color="black", label="ideal")
        ax.set_xlabel("dense backward / T_comm")
        ax.set_ylabel("overlap efficiency (1: all hidden)")
        ax.set_title(case, fontsize=9)
        ax.legend(fontsize=8)
    figure.suptitle("Synchronous MoE all_to_all: stock, priority alone, the collective lane")


if __name__ == "__main__":
    sys.exit(main())
