"""Timing, statistics and CSV helpers shared by the benchmarks in this directory, and what each benchmark's
``summary_rows`` and ``plot`` (for ``python -m torch_ext bench``) build on: ``SummaryRow``, ``read_csv``, ``bar_chart``.

Benchmarks are scripts (``python benchmarks/<name>.py``); Python puts this directory on sys.path
for them, which is how they import this module.
"""

from __future__ import annotations

import contextlib
import csv
import gc
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
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        result = fn(*args, **kwargs)
        return time.perf_counter_ns() - start, result
    finally:
        if gc_was_enabled:
            gc.enable()


def _run_delay_ns() -> int:
    """This thread's time spent runnable but waiting for a CPU (schedstat's run delay; 0 where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


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


def progress(message: str) -> None:
    """Prints a progress line: to stderr, flushed at once, so that stdout carries only results and
    whoever watches a run (a terminal, ``python -m torch_ext bench`` reading the log) sees where it is."""
    print(message, file=sys.stderr, flush=True)


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


# --- sweeps of the dense backward against the communication (overlap, recsys_torchrec) -------------------


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


def sweep_depth(ratio: float, t_comm: float, t_layer: float, max_layers: int) -> int:
    """Dense layers whose backward takes about ``ratio`` x ``t_comm``, one layer's taking ``t_layer``."""
    return int(min(max_layers, max(1, round(ratio * t_comm / t_layer))))


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


def plot_efficiency_curves(ax, rows: Sequence[SummaryRow], title: str) -> None:
    """Each row's overlap efficiency against dense backward / T_comm (its ``"efficiency x<ratio>"`` values),
    and the ideal, min(1, ratio), dashed."""
    ratios: list[float] = []
    for row in rows:
        curve = sorted(
            (float(key.removeprefix("efficiency x")), value)
            for key, value in row.values.items()
            if key.startswith("efficiency x")
        )
        ratios = sorted({*ratios, *(ratio for ratio, _ in curve)})
        ax.plot([ratio for ratio, _ in curve], [eff for _, eff in curve], marker="o", label=row.variant)
    if ratios and ratios[0] < 1.0 < ratios[-1]:
        ratios = sorted({*ratios, 1.0})  # the ideal's corner
    ax.plot(ratios, [min(1.0, r) for r in ratios], linestyle="--", color="black", label="ideal")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xlabel("dense backward / T_comm")
    ax.set_ylabel("overlap efficiency (1: all hidden)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


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


def slowest_rank_samples(measure: Callable[[], float], reps: int) -> list[float]:
    """In a benchmark's rank, on every rank: ``reps`` calls of ``measure()`` (each starting the ranks together),
    each call's value the slowest rank's.

    For T_comm, the benchmarks measure how long stock's backward waits for the collective where nothing can hide
    it: on the shaped veth that was 35-38 ms for 2 MiB each way in every run, loaded or not. The all_to_all alone
    was not a steady yardstick: back to back or between steps, the slower rank's took either ~36 or ~19 ms (both
    directions at the link's rate), and which of the two dominated changed from run to run (medians of 36, 28 and
    24 ms between steps in three runs; 24 ms for 25 back to back in a fourth, then 36-38 ms in its steps). The
    ranks' own times differ within a call (one rank 20 ms, the other 36), hence the slowest rank per call.
    """
    import torch.distributed as dist

    samples = torch.tensor([measure() for _ in range(reps)], dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return samples.tolist()


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
