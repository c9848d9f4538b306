"""Timing and statistics: a call's wall time with the GC paused, a thread's blocked time, medians and
percentiles, and how loaded the machine was meanwhile. Imports no torch (a sweep's launcher uses it)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


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
