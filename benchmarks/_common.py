"""Timing, statistics and CSV helpers shared by the benchmarks in this directory, and what each benchmark's
``summary_rows`` and ``plot`` (for ``python -m torch_ext bench``) build on: ``SummaryRow``, ``read_csv``, ``bar_chart``.

The three overlap benchmarks (overlap, recsys_torchrec, moe_sync) share one sweep of the dense backward against
T_comm: its settings (RATIOS, QUICK_RATIOS, SweepConfig), options and main (``sweep_parser``, ``run_sweep``: two
hosts, or a rank under torchrun), the repetitions (``timed_repetitions``), T_comm (``calibrate_t_comm``), the
ranks' times merged (``merge_ranks``), and the summary rows and plot (``sweep_summary_row``,
``plot_efficiency_curves``). All three measure exposed communication one way: each rank's backward thread's
blocked time (``timed_blocking``), read as what the slowest rank's backward waited beyond the longest time any
rank spent unblocked (``exposed_past_the_slowest_rank``, which says why not the slower rank's blocked time).

Benchmarks are scripts (``python benchmarks/<name>.py``); Python puts this directory on sys.path
for them, which is how they import this module. The sweep's helpers import ``_hosts`` when called: it imports
this module.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

# progress is re-exported: the scripts import it from here.
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    leave_rank,
    progress,
    run_on_two_hosts,
    write_rank_result,
)

T = TypeVar("T")

CSV_COLUMNS = ("what", "case", "size", "metric", "median", "p20", "p80", "torch_version", "git_sha")


def timed_call(fn: Callable[..., T], *args: object, **kwargs: object) -> tuple[int, T]:
    """Wall time of ``fn(*args, **kwargs)`` in nanoseconds, and its result, with Python's cyclic GC
    off during the call.

    A collection is triggered by allocations anywhere in the process (here mostly the graph-building
    forward), so leaving the GC on would charge an unrelated pass to whichever call happened to
    cross the threshold. The caller's GC state is restored afterwards, so collections still run
    between timed calls.
    """
    with gc_paused():
        start = time.perf_counter_ns()
        result = fn(*args, **kwargs)
        return time.perf_counter_ns() - start, result


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off inside the block (``timed_call`` says why), the caller's state restored after it."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc_was_enabled:
            gc.enable()


def schedstat(path: str) -> tuple[int, int] | None:
    """A thread's counts from the kernel's schedstat file at ``path`` (``/proc/thread-self/schedstat``,
    ``/proc/self/task/<tid>/schedstat``): (ns it ran on a CPU, ns it waited, runnable, for one); None where there is
    none (not Linux, no schedstats, a thread that has ended)."""
    try:
        with open(path) as f:
            on_cpu, run_delay = f.read().split()[:2]
        return int(on_cpu), int(run_delay)
    except (OSError, ValueError):
        return None


def _run_delay_ns() -> int:
    """This thread's time spent runnable but waiting for a CPU (schedstat's run delay; 0 where there is none)."""
    counts = schedstat("/proc/thread-self/schedstat")
    return 0 if counts is None else counts[1]


def timed_blocking(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, blocked seconds) of ``fn()`` on this thread. Blocked is the wall time it neither ran nor
    waited for a CPU: wall - the thread's CPU time - its run delay, the time it slept (in a collective's wait, for
    bytes still on the wire).

    A backward's exposed communication read this way is precise where a difference of two backward times is not:
    a compute-only backward on either engine read 0.00-0.02 ms blocked (45 dense layers, 8 calls each), while two
    neighbouring calls' times differed by ~5 ms beside other processes' load. Both engines run a CPU graph on the
    calling thread; without schedstat the time waiting for a CPU counts as blocked.
    """
    delay = _run_delay_ns()
    cpu = time.thread_time_ns()
    start = time.perf_counter_ns()
    fn()
    wall = time.perf_counter_ns() - start
    blocked = wall - (time.thread_time_ns() - cpu) - (_run_delay_ns() - delay)
    return wall / 1e9, max(0, blocked) / 1e9


@dataclass(frozen=True)
class Summary:
    median: float
    p20: float
    p80: float

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.p20:.3g}-{self.p80:.3g}]"


def summarize(samples: Sequence[float]) -> Summary:
    """Median, 20th and 80th percentile (linear interpolation between samples)."""
    if len(samples) < 2:
        raise ValueError(f"need at least 2 samples for percentiles, got {len(samples)}")
    quintiles = statistics.quantiles(samples, n=5, method="inclusive")
    return Summary(statistics.median(samples), quintiles[0], quintiles[3])


def git_sha() -> str:
    """Short sha of the checkout this file lives in, or "nogit" (no git, not a checkout: installed from a wheel);
    the CSVs' git_sha column and the name of bench's results folder.

    The checkout's top level is this directory's parent (``benchmarks/`` in the checkout); installed as
    ``torch_ext/benchmarks`` in site-packages, any repository around it is not torch_ext's.
    """
    directory = os.path.dirname(os.path.realpath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.dirname(directory):
            return "nogit"
        return git("rev-parse", "--short", "HEAD") or "nogit"
    except (OSError, subprocess.CalledProcessError):
        return "nogit"


def csv_row(what: str, case: str, size: str, metric: str, summary: Summary, sha: str) -> dict[str, object]:
    return {
        "what": what,
        "case": case,
        "size": size,
        "metric": metric,
        "median": summary.median,
        "p20": summary.p20,
        "p80": summary.p80,
        "torch_version": torch.__version__,
        "git_sha": sha,
    }


def write_csv(path: str, rows: Iterable[dict[str, object]]) -> None:
    """Writes long-format rows (CSV_COLUMNS) to ``path``, creating its directory."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def print_columns(lines: Sequence[Sequence[str]]) -> None:
    """Prints rows of cells (the first one the header) as left-aligned columns two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())


# --- bench's summary table and plots (torch_ext/bench.py), from each benchmark's CSV ----------------------


@dataclass
class SummaryRow:
    """One line of the summary table; ``values`` are its numbers for summary.csv and the plots."""

    benchmark: str
    case: str
    variant: str
    baseline: str
    measured: str
    ratio: str
    notes: str = ""
    values: dict[str, float] = field(default_factory=dict)


def read_csv(path: Path) -> dict[tuple[str, str, str], dict[str, object]]:
    """A benchmark's long-format CSV, keyed by (what, case, metric); median, p20, p80 as floats."""
    with open(path, newline="") as f:
        rows = {}
        for row in csv.DictReader(f):
            for column in ("median", "p20", "p80"):
                row[column] = float(row[column])
            rows[(row["what"], row["case"], row["metric"])] = row
        return rows


def csv_cases(rows: dict, metric: str | None = None) -> list[str]:
    """Cases in the order the CSV has them."""
    return list(dict.fromkeys(case for _, case, row_metric in rows if metric is None or row_metric == metric))


def bar_chart(ax, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, line: float | None) -> None:
    width = 0.8 / len(series)
    for i, (name, heights) in enumerate(series.items()):
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(positions, heights, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if line is not None:
        ax.axhline(line, color="black", linewidth=0.8, linestyle="--")
    if len(series) > 1:
        ax.legend(fontsize=8)


# --- the sweep of the dense backward against the communication (overlap, recsys_torchrec, moe_sync) -------------

# The dense backward as multiples of T_comm. The summary's headline reads one point, HEADLINE_RATIO: a dense
# backward as long as the communication, where a perfect overlap hides all of it with nothing to spare. A full run
# sweeps the curve around it, a quick run that point alone, so the two headlines measure the same thing and differ
# only by their repetitions. The sweep's mean, the headline before, could not agree: a full run's five points and
# a quick run's three had different means. Three points took the whole quick run ~6 minutes here; one, 166-172 s
# (docs/benchmarks.md, "How stability was checked").
HEADLINE_RATIO = 1.0
RATIOS = (0.25, 0.5, HEADLINE_RATIO, 1.5, 2.0)
QUICK_RATIOS = (HEADLINE_RATIO,)
# T_comm: how long stock's backward waits for the collective with nothing to hide it behind (calibrate_t_comm),
# the median of this many steps after a few untimed ones (a process's first all_to_alls are slower: in moe_sync
# the first library's read 1.5-1.8x the later ones'). ~2 s.
WARMUP_STEPS = 3
COMM_CALIBRATION_REPS = 15
# Seconds of calls one dense layer's calibration takes at least (dense_layer_backward_s).
CALIBRATION_S = 2.0


@dataclass(frozen=True)
class SweepConfig:
    ratios: tuple[float, ...]
    # Timed repetitions of every variant at every point, after ``warmup`` untimed ones.
    reps: int
    warmup: int
    # Calls of the calibration's stack of layers at least (dense_layer_backward_s).
    calibration_reps: int
    # A quick run (--quick): a script may also time fewer variants (``timed_variants``).
    quick: bool
    # Where rank 0 draws a traced backward (None: not traced).
    timeline_png: str | None


def parse_ratios(text: str) -> tuple[float, ...]:
    """``--ratios`` of a sweep: positive numbers separated by commas (an argparse ``type``)."""
    import argparse

    try:
        ratios = tuple(float(part) for part in text.split(","))
    except ValueError:
        ratios = ()
    if not ratios or any(r <= 0 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be positive numbers separated by commas, got {text!r}")
    return ratios


def sweep_parser(doc: str, name: str, quick_help: str, timeline_help: str | None = None):
    """A sweep script's argument parser (its module docstring ``doc``): the options every sweep takes, and
    ``--timeline PNG`` where it draws one (``timeline_help``). The script adds its own before parsing them with
    ``parse_sweep_args``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant at every sweep point")
    parser.add_argument("--ratios", type=parse_ratios, help="dense backward / T_comm to sweep, e.g. 0.5,1,2")
    parser.add_argument(
        "--network",
        choices=MODES,
        default=MODES[0],
        help="where the 2 ranks run (default two-hosts; what cannot be made falls back to the next)",
    )
    parser.add_argument("--out", default=f"results/{name}.csv", help="long-format CSV to write")
    if timeline_help is not None:
        parser.add_argument("--timeline", metavar="PNG", help=timeline_help)
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)  # set by the launcher on each rank
    return parser


def parse_sweep_args(parser, argv: list[str] | None):
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    return args


def sweep_config(args, name: str, quick_reps: int, reps: int) -> SweepConfig:
    """The settings of ``sweep_parser``'s options: ``quick_reps`` or ``reps`` repetitions unless ``--reps``."""
    timeline_png = None
    if getattr(args, "timeline", None) is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            progress(f"{name}: --timeline skipped: matplotlib is not installed (pip install 'torch_ext[bench]')")
        else:
            timeline_png = os.path.abspath(args.timeline)
    return SweepConfig(
        ratios=args.ratios or (QUICK_RATIOS if args.quick else RATIOS),
        reps=args.reps or (quick_reps if args.quick else reps),
        # Two untimed repetitions in a quick run too: with one, three quick runs' first (and only) point read the
        # microbatch overlap's exposure 0.42-0.46 of stock's against a full run's 0.40 there, and moe_sync's lane
        # 0.94-0.99 against 0.999, each quick run on the same side of the full one (a fresh process's first steps).
        warmup=2,
        calibration_reps=25 if args.quick else 31,
        quick=args.quick,
        timeline_png=timeline_png,
    )


def _on_every_rank(run_rank: Callable[[], object]) -> list:
    """In a rank started by torchrun: ``run_rank()`` in the gloo process group of torchrun's environment, with one
    intra-op thread (two ranks may share two cores); every rank's result, in rank order."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    # Deep Linear + ReLU stacks reach denormal floats in backward, which x86 computes many times slower: a 138-layer
    # stack's backward took 16.5 s alone, 1.1 s with denormals flushed, so a point meant as x2 of T_comm measured
    # ~x30. Flushed on every rank, for stock and torch_ext alike (torch_ext's threads take the setting from theirs).
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        result = run_rank()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def run_sweep(
    script: str, args, argv: list[str] | None, run_rank: Callable[[], object], report: Callable, announce: str
):
    """A sweep script's main. Started by torchrun (by ``_hosts.run_on_two_hosts``, ``--rank-results``, or by a user on
    two machines, where rank 0 reports): ``run_rank()`` (this rank's part, in the process group; its result
    JSON-serializable) on every rank, and leaves. Otherwise runs the script on 2 ranks as 2 hosts, sampling the
    runnable tasks meanwhile, and reports: ``report(results, link, out, load)``, every rank's result in rank
    order, prints the table and writes the CSV. Returns the exit status."""
    # Started by torchrun (it sets TORCHELASTIC_RUN_ID): one of the ranks.
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        results = _on_every_rank(run_rank)
        if args.rank_results is not None:
            write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
        elif os.environ["RANK"] == "0":
            report(results, f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
        # An exception above still exits with its traceback and status 1.
        leave_rank()
    progress(announce)
    forwarded = sys.argv[1:] if argv is None else list(argv)
    with runnable_tasks() as load:
        run = run_on_two_hosts(script, forwarded, mode=args.network)
    report(run.results, run.network.label, args.out, load())
    return 0


def timed_variants(config: SweepConfig, variants: Sequence[str], left_out_when_quick: Sequence[str]) -> tuple[str, ...]:
    """The variants a sweep times: all of ``variants``, less ``left_out_when_quick`` in a quick run. A quick run leaves
    out the variants whose figures only confirm another's (each script says which and why), to keep the README's
    first command short; a full run times them all. The summary rows show what was timed."""
    return tuple(v for v in variants if not (config.quick and v in left_out_when_quick))


def sweep_depth(ratio: float, t_comm: float, t_layer: float, max_layers: int) -> int:
    """Dense layers whose backward takes about ``ratio`` x ``t_comm``, one layer's taking ``t_layer``."""
    return int(min(max_layers, max(1, round(ratio * t_comm / t_layer))))


def timed_repetitions(
    variants: Sequence[str], measure: Callable[[str, int], dict[str, float]], reps: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """At one sweep point, on every rank: ``measure(variant, repetition)`` (seconds by metric) of every variant in
    ``warmup + reps`` repetitions, the warm-up left out: ``{variant: {metric: [seconds per repetition]}}``. The
    variants alternate within each repetition, the first rotating, so drift in the machine's load spreads evenly
    over them."""
    samples: dict[str, dict[str, list[float]]] = {variant: {} for variant in variants}
    for rep in range(warmup + reps):
        shift = rep % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            measured = measure(variant, rep)
            if rep >= warmup:
                for metric, seconds in measured.items():
                    samples[variant].setdefault(metric, []).append(seconds)
    return samples


def exposed_past_the_slowest_rank(walls: Sequence[float], blocked: Sequence[float]) -> float:
    """One step's exposed communication from each rank's backward: (wall seconds, blocked seconds) per rank, as
    ``timed_blocking`` measured them. The step ends with its slowest rank's backward; what it waited beyond the
    longest time any rank spent unblocked (computing, or waiting for a CPU) is communication nothing hid.

    Not the slower rank's blocked time: a rank that reaches the collective first also waits for the other to
    arrive. On the shaped link one rank's dense backward ending 5-14 ms after the other's at every deep point of a
    quick run read as stock waiting 40-50 ms for an all_to_all that took 36 ms with no dense path (36 in the
    runs before and after). Not the rank that waited least either: gloo's all_to_all keeps one rank ~20 ms and
    the other ~36 ms in the same call, and the step pays the 36.
    """
    unblocked = max(wall - waited for wall, waited in zip(walls, blocked, strict=True))
    return max(0.0, max(walls) - unblocked)


def _exposed_of_each_step(walls_per_rank: Sequence[Sequence[float]], blocked_per_rank: Sequence[Sequence[float]]):
    """exposed_past_the_slowest_rank of each step, from every rank's seconds per step."""
    return [
        exposed_past_the_slowest_rank(walls, blocked)
        for walls, blocked in zip(zip(*walls_per_rank, strict=True), zip(*blocked_per_rank, strict=True), strict=True)
    ]


def calibrate_t_comm(step: Callable[[], dict[str, float]]) -> list[float]:
    """T_comm's samples, on every rank (the same on each): WARMUP_STEPS untimed calls of ``step``, then
    COMM_CALIBRATION_REPS timed ones, each step's exposed communication read as the sweep's points read theirs
    (exposed_past_the_slowest_rank). ``step()`` runs stock's backward of the model with no dense layer, the ranks
    started together, and returns its ``backward_s`` and ``blocked_s`` (``timed_blocking``).

    Stock's wait where nothing can hide the collective, not the all_to_all timed alone: on the shaped veth the
    wait was 35-38 ms for 2 MiB each way in every run, loaded or not, while the all_to_all alone, back to back or
    between steps, took either ~36 or ~19 ms on the slower rank (both directions at the link's rate), and which of
    the two dominated changed from run to run (medians of 36, 28 and 24 ms between steps in three runs; 24 ms for
    25 back to back in a fourth, then 36-38 ms in its steps).
    """
    import torch.distributed as dist

    for _ in range(WARMUP_STEPS):
        step()
    steps = [step() for _ in range(COMM_CALIBRATION_REPS)]
    mine = torch.tensor([[s["backward_s"], s["blocked_s"]] for s in steps], dtype=torch.float64)
    every_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, mine)
    return _exposed_of_each_step(
        [rank[:, 0].tolist() for rank in every_rank], [rank[:, 1].tolist() for rank in every_rank]
    )


def merge_ranks(points_of_each_rank: Sequence[Sequence[dict]]) -> list[dict]:
    """A sweep's points as the step sees them, from every rank's (``{"ratio", "dense_layers", "samples"}``, the
    samples as ``timed_repetitions`` gives them): each metric per repetition the slowest rank's (the step waits for
    it), and where a variant has ``blocked_s``, its ``exposed_s`` per repetition, exposed_past_the_slowest_rank of
    every rank's ``backward_s`` and ``blocked_s``."""
    merged = []
    for index, point in enumerate(points_of_each_rank[0]):
        per_rank = [points[index]["samples"] for points in points_of_each_rank]
        samples = {}
        for variant, metrics in point["samples"].items():
            samples[variant] = {
                metric: [max(values) for values in zip(*(s[variant][metric] for s in per_rank), strict=True)]
                for metric in metrics
            }
            if "blocked_s" in metrics:
                samples[variant]["exposed_s"] = _exposed_of_each_step(
                    [s[variant]["backward_s"] for s in per_rank], [s[variant]["blocked_s"] for s in per_rank]
                )
        merged.append({**point, "samples": samples})
    return merged


def exposure(exposed_s: Sequence[float], t_comm_s: float) -> tuple[Summary, Summary]:
    """Exposed communication in ms and overlap efficiency (1 - exposed / T_comm) of a point's repetitions."""
    return summarize([e * 1e3 for e in exposed_s]), summarize([1 - e / t_comm_s for e in exposed_s])


def step_efficiency(backward_s: Sequence[float], compute_s: Sequence[float], t_comm_s: float) -> Summary:
    """Overlap efficiency by step time, of a point's repetitions: 1 - (backward - the same repetition's
    communication-free backward) / T_comm. Beside ``exposure``'s, which counts only the time a rank was blocked:
    this one also counts what the communication costs the compute (gloo's threads on the same cores), and it reads
    below the blocked-time one where that cost is real."""
    return summarize([1 - (b - c) / t_comm_s for b, c in zip(backward_s, compute_s, strict=True)])


def measured_ratio(compute_s: Sequence[float], t_comm_s: float) -> float:
    """The compute/communication ratio a sweep point really had: its communication-free backward's median over
    T_comm. The sweep asks for a ratio of dense layers, from one layer's calibrated time; the whole backward's
    compute is what could hide the transfer, so the point's ideal efficiency is min(1, this)."""
    return statistics.median(compute_s) / t_comm_s


def print_t_comm(comm: Summary, steps: int) -> None:
    print(f"T_comm {comm} ms (stock's wait with no dense layer, {steps} steps; efficiency = 1 - exposed / its median)")


def print_load(load: Summary | None) -> None:
    if load is not None:
        print(f"runnable tasks while the ranks ran: {load} (the ranks make 2; more: other processes on the 2 cores)")


def sweep_case(name: str, ratio: float) -> str:
    """The CSV case of one sweep point: ``"<name> x<ratio>"``."""
    return f"{name} x{ratio:g}"


def sweep_cases(rows: dict, what: str, metric: str) -> list[tuple[float, str]]:
    """[(ratio, case)] of the sweep points ``sweep_case`` named, in the CSV's order, from ``what``'s ``metric``."""
    return [
        (float(case.rpartition(" x")[2]), case)
        for row_what, case, row_metric in rows
        if row_what == what and row_metric == metric
    ]


def scenario_and_link(size: str) -> tuple[str, str]:
    """A sweep point's CSV size, ``"<scenario>, <n> dense layers, <link>"``, as (scenario, link)."""
    scenario, _, link = size.rpartition(", ")
    return scenario.rpartition(", ")[0], link


def headline_point(points: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The sweep point (ratio, case) a summary's headline reads: HEADLINE_RATIO's, or where a sweep left it out
    (``--ratios``), the point nearest it."""
    return min(points, key=lambda point: abs(math.log(point[0] / HEADLINE_RATIO)))


def headline_over_stock(rows: dict, variant: str, points: Sequence[tuple[float, str]], metric: str) -> float:
    """``variant``'s ``metric`` / stock's at the sweep's headline point (``headline_point``)."""
    _, case = headline_point(points)
    return rows[(variant, case, metric)]["median"] / rows[("stock", case, metric)]["median"]


def load_note(rows: dict, case: str) -> str:
    """The summary notes' runnable tasks while the ranks ran (the CSV's ``machine`` row), where known."""
    load = rows.get(("machine", case, "runnable_tasks"))
    return "" if load is None else f"; runnable tasks {load['median']:g} (the ranks: 2)"


def sweep_summary_row(
    benchmark: str,
    case: str,
    variant: str,
    rows: dict,
    points: Sequence[tuple[float, str]],
    over_stock: dict[str, float],
    *,
    lead: str = "",
    exposed: bool = True,
    stock_note: str = "",
) -> SummaryRow:
    """A variant's line of the summary table from a sweep's CSV ``rows`` at ``points`` (``sweep_cases``): the headline
    is the overlap efficiency at the headline point (``headline_point``) beside its ideal, min(1, the ratio the
    point measured: ``point_ratio``), and the efficiency by step time there where the CSV has it; the ratio column
    is ``over_stock["ratio"]`` (the callers' ``headline_over_stock``). The notes: ``lead``, the efficiency at each
    point, the exposed ms at the headline point (``exposed``), and on stock's line ``stock_note``. The values: the
    headline's efficiency and ideal, its exposed ms, ``over_stock``, and the curve for the plot
    (``"efficiency x<ratio>"``)."""
    efficiencies = [rows[(variant, point, "efficiency")]["median"] for _, point in points]
    measured = [point_ratio(rows, ratio, point) for ratio, point in points]
    has_measured = all(_measured_ratio_key(point) in rows for _, point in points)
    headline_ratio, headline = headline_point(points)
    efficiency = rows[(variant, headline, "efficiency")]["median"]
    ideal = min(1.0, point_ratio(rows, headline_ratio, headline))
    values = {"efficiency": efficiency, "ideal_efficiency": ideal}
    by_step = rows.get((variant, headline, "step_efficiency"))
    if by_step is not None:
        values["step_efficiency"] = by_step["median"]
    if exposed:
        values["exposed_ms"] = rows[(variant, headline, "exposed_ms")]["median"]
    values.update(over_stock)
    values.update({f"efficiency x{ratio:g}": eff for (ratio, _), eff in zip(points, efficiencies, strict=True)})
    if has_measured:
        values.update({f"ideal x{ratio:g}": min(1.0, real) for (ratio, _), real in zip(points, measured, strict=True)})
    per_point = ", ".join(
        f"x{ratio:g}{f' (measured x{real:.2g})' if has_measured else ''}: {eff:.2f}"
        for (ratio, _), real, eff in zip(points, measured, efficiencies, strict=True)
    )
    notes = f"headline at x{headline_ratio:g}; {lead}efficiency by dense/comm ratio {per_point}"
    if exposed:
        notes += f"; exposed {values['exposed_ms']:.1f} ms at x{headline_ratio:g}"
    if variant == "stock":
        notes += stock_note
    return SummaryRow(
        benchmark,
        case,
        variant,
        "stock",
        f"efficiency {efficiency:.2f} (ideal {ideal:.2f})"
        + (f", by step time {values['step_efficiency']:.2f}" if "step_efficiency" in values else ""),
        f"{values['ratio']:.2f}",
        notes,
        values,
    )


def _measured_ratio_key(case: str) -> tuple[str, str, str]:
    """The CSV key (what, case, metric) of sweep point ``case``'s measured ratio."""
    return ("compute", case, "measured_ratio")


def measured_ratio_row(case: str, size: str, ratio: float, sha: str) -> dict[str, object]:
    """The CSV row of the ratio sweep point ``case`` measured (``measured_ratio``), which ``point_ratio`` reads."""
    what, _, metric = _measured_ratio_key(case)
    return csv_row(what, case, size, metric, Summary(ratio, ratio, ratio), sha)


def point_ratio(rows: dict, ratio: float, case: str) -> float:
    """The ratio sweep point ``case`` measured (its ``measured_ratio_row``), or the one it asked for, ``ratio``, in a
    CSV without it."""
    row = rows.get(_measured_ratio_key(case))
    return ratio if row is None else row["median"]


def plot_efficiency_curves(ax, rows: Sequence[SummaryRow], title: str) -> None:
    """Each row's overlap efficiency against dense backward / T_comm (its ``"efficiency x<ratio>"`` values),
    and the ideal, dashed: min(1, the ratio each point measured) (``"ideal x<ratio>"``), or min(1, ratio)."""
    ratios: list[float] = []
    for row in rows:
        curve = sorted(
            (float(key.removeprefix("efficiency x")), value)
            for key, value in row.values.items()
            if key.startswith("efficiency x")
        )
        ratios = sorted({*ratios, *(ratio for ratio, _ in curve)})
        ax.plot([ratio for ratio, _ in curve], [eff for _, eff in curve], marker="o", label=row.variant)
    measured_ideal = sorted(
        (float(key.removeprefix("ideal x")), value)
        for key, value in (rows[0].values.items() if rows else ())
        if key.startswith("ideal x")
    )
    if measured_ideal:
        ax.plot(*zip(*measured_ideal, strict=True), linestyle="--", color="black", label="ideal (measured ratio)")
    else:
        if ratios and ratios[0] < 1.0 < ratios[-1]:
            ratios = sorted({*ratios, 1.0})  # the ideal's corner
        ax.plot(ratios, [min(1.0, r) for r in ratios], linestyle="--", color="black", label="ideal")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xlabel("dense backward / T_comm")
    ax.set_ylabel("overlap efficiency (1: all hidden)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


# A dense layer's backward is calibrated on this many layers one after the other: calls of 8-20 ms here, not 1-2.
CALIBRATION_LAYERS = 8


def dense_layer_backward_s(hidden: int, rows: int, reps: int, min_s: float) -> float:
    """Seconds of one Linear(hidden, hidden) + ReLU layer's backward at ``rows`` rows: the lower quartile of the
    backward calls of a stack of CALIBRATION_LAYERS such layers (after one untimed call), ``reps`` of them and as
    many more as ``min_s`` seconds take, over their number; this process's, timed while the other rank times its.

    A stack, not one layer: a median of 9 calls of 1-2 ms spans ~20 ms, and a moment of another process's load set
    the whole sweep's depths (one layer read 5.4 ms instead of 1.9 beside a pytest run). The lower quartile, not
    the median: with nothing else running, medians of 9 calls of the stack still read 1.57, 2.89 and 1.86 ms in
    three runs of recsys_torchrec (torch_ext's x1 point 0.99, 0.49, 0.90 with them). Seconds of calls, not a count:
    the lower quartile of 25 calls (~0.3 s) read 1.00, 1.04 and 1.36 ms for overlap's layer in three quiet runs
    whose sweeps' compute-only backward gave 1.00, 0.91 and 0.98 ms a layer, so a slow spell of a second can fill
    such a window; over 2 s it fills less than the three quarters the quartile needs.
    """
    stack = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(CALIBRATION_LAYERS))
    )
    x = torch.randn(rows, hidden)
    stack(x).sum().backward()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < reps or time.perf_counter() - started < min_s:
        loss = stack(x).sum()
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.quantiles(times, n=4, method="inclusive")[0] / CALIBRATION_LAYERS


def _runnable_tasks() -> int:
    """Tasks running or waiting for a CPU on the machine now (/proc/stat's procs_running), the caller excluded."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running "):
                return int(line.split()[1]) - 1
    return 0


@contextlib.contextmanager
def runnable_tasks(every_s: float = 0.2) -> Iterator[Callable[[], Summary]]:
    """Samples how many tasks are running or waiting for a CPU, every ``every_s`` seconds while the block runs (a
    benchmark's ranks); yields a function giving the samples' median and percentiles. A benchmark's two ranks make
    2 while they compute on this 2-core machine; more is other processes sharing the cores, under which overlap
    figures move: a rank that blocks on the network lends its core to them, one that computes competes. (The load
    average says it a minute late, if at all: another engineer's moe_sync running beside a 40 s overlap run, whose
    torch_ext read 0.67 instead of 0.87-0.91, left the 1-minute load average at 1.7.)"""
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append(_runnable_tasks())
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        # A run shorter than two samples still has its one.
        yield lambda: summarize(samples if len(samples) > 1 else samples * 2)
    finally:
        stop.set()
        thread.join()
