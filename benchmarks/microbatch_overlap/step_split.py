"""Where an overlapped step's time goes, from a trace of its two compute threads: the microbatch overlap's forward
thread (the caller's) and its backward thread.

A rank of the benchmark has about one core. At any moment of a step, either a compute thread runs (or is ready
to run) or both wait: the forward thread in a collective, in the hand-over (``MicrobatchOverlap.backward`` waiting
for the backward in flight) or in the window's close; the backward thread in a collective's wait or between two
backwards. Only the time both wait can an order of work still fill; the busy time stays, whatever the order.

``split_step`` sorts a traced step's time so:

  busy              some compute thread outside its recorded waits: the compute itself, what two threads cost it,
                    the CPU time the communication takes on the same core (gloo's threads, the lanes), and any
                    time a compute thread is blocked where the trace records no wait (a lock)
  idle, leading     both wait before the first backward starts: microbatch 0's forward collectives, with no
                    backward beside them
  idle, trailing    both wait after the last forward has handed its backward over: the last backward's
                    collectives, with no forward after them
  idle, middle      both wait in between: what a better order of the same work could still hide

Leading and trailing are the edges the benchmark's limit counts. Times are ``time.perf_counter_ns`` values (the
clock ``torch_ext.trace()`` stamps its events with).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..harness.timing import schedstat

Interval = tuple[int, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap or touch, sorted, empty ones dropped."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def minus(span: Interval, holes: Iterable[Interval]) -> list[Interval]:
    """``span`` less the union of ``holes``."""
    left, right = span
    pieces = []
    for start, end in union(holes):
        if end <= left or start >= right:
            continue
        if start > left:
            pieces.append((left, start))
        left = max(left, end)
    if left < right:
        pieces.append((left, right))
    return pieces


def within(intervals: Iterable[Interval], span: Interval) -> int:
    """Nanoseconds of the union of ``intervals`` inside ``span``."""
    left, right = span
    return sum(max(0, min(end, right) - max(start, left)) for start, end in union(intervals))


@dataclass(frozen=True)
class StepSplit:
    """A traced step's time, in ns (``split_step``); busy + the three idle parts = step."""

    step_ns: int
    busy_ns: int
    idle_leading_ns: int
    idle_middle_ns: int
    idle_trailing_ns: int


def split_step(
    step: Interval,
    forward_waits: Sequence[Interval],
    backward_calls: Sequence[Interval],
    backward_waits: Sequence[Interval],
    last_hand_over_end: int,
) -> StepSplit:
    """The split of ``step`` (its start and end). ``forward_waits``: where the forward thread waited (its
    collectives, the hand-overs, the close); it is busy the rest of the step. ``backward_calls``: the backward
    thread's backward calls, busy but for ``backward_waits`` (its waits on collectives' results).
    ``last_hand_over_end``: when the last microbatch's hand-over returned, the last forward done."""
    forward_busy = minus(step, forward_waits)
    backward_busy = [piece for call in backward_calls for piece in minus(call, backward_waits)]
    idle = minus(step, [*forward_busy, *backward_busy])
    first_backward = min((start for start, _ in backward_calls), default=step[1])
    leading = within(idle, (step[0], first_backward))
    trailing = within(idle, (max(first_backward, last_hand_over_end), step[1]))
    idle_total = within(idle, step)
    return StepSplit(
        step_ns=step[1] - step[0],
        busy_ns=step[1] - step[0] - idle_total,
        idle_leading_ns=leading,
        idle_middle_ns=idle_total - leading - trailing,
        idle_trailing_ns=trailing,
    )


def threads_schedstat() -> dict[int, tuple[int, int]]:
    """Each thread of this process: (ns it ran on a core, ns it waited, ready, for one), from the kernel's
    ``/proc/self/task/<tid>/schedstat``; empty where there is none (not Linux, or no schedstats)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    # A thread that has ended since the listing has no counts.
    counts = {int(tid): schedstat(f"/proc/self/task/{tid}/schedstat") for tid in tids}
    return {tid: count for tid, count in counts.items() if count is not None}


@dataclass(frozen=True)
class ComputeThreadTimes:
    """Where a step's compute threads spent it, in ns (``compute_thread_times``). The other threads' time on a core
    is the process's CPU time less the first: a lane's thread can end within the step, and ``threads_schedstat``
    no longer lists it, while the process's CPU clock keeps what it used."""

    # The compute threads' (the forward's and the backward's) time on a core.
    on_core_ns: int
    # Their time ready to run with no core free: while the other compute thread, another thread of the rank or
    # another rank's thread ran.
    ready_ns: int


def compute_thread_times(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], compute_threads: set[int]
) -> ComputeThreadTimes:
    """The step's ``ComputeThreadTimes`` from ``threads_schedstat`` at its start and at its end (``after`` holds each
    compute thread's last count: one that ended before the step did, its count before it ended). A thread that
    started during the step counts from 0."""

    def spent(tid: int, field: int) -> int:
        return after[tid][field] - before.get(tid, (0, 0))[field] if tid in after else 0

    return ComputeThreadTimes(
        on_core_ns=sum(spent(tid, 0) for tid in compute_threads), ready_ns=sum(spent(tid, 1) for tid in compute_threads)
    )
