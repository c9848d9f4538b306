"""Peak CPU tensor memory of one region of code, such as one backward call.

    with PeakMemory() as memory:
        loss = model(x).sum()          # built under the tracker: its saved tensors' frees are seen
        with memory.region():
            loss.backward()
    memory.peak_bytes                  # most bytes above the level at the region's start

Method: ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` is on for the whole
``with`` block, and ``record_function`` marks the region. With memory profiling on, c10's CPU allocator
reports every allocation and free (c10::ProfiledCPUMemoryReporter) with the running total of the bytes
it has handed out and not yet taken back, computed under the reporter's lock, so allocations from every
thread are summed in the order they happened. The profiler keeps these as allocation events
(``kineto_results.experimental_event_tree()``, ``total_allocated``: an experimental API of torch 2.13).
The region's peak is the largest running total reported during it, minus the total just before its
first event. Tensors a region frees count only if they were allocated inside the ``with`` block (build the
graph there): the reporter may also report frees of blocks an earlier profiler saw allocated, and those are
left out by address.

Not seen: allocations on a thread that does not carry the profiler's thread-local state (a plain
Python thread started in the region), and CUDA memory. The profiler also turns on RecordFunction
callbacks, which changes code paths (an engine then records a range per node).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Self

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

_region_numbers = itertools.count()


class PeakMemory:
    """Tracks CPU allocations while active; ``peak_bytes`` is set on exit from its one ``region()``."""

    def __init__(self) -> None:
        self._profiler: profile | None = None
        self._region_name: str | None = None
        self.peak_bytes: int | None = None

    def __enter__(self) -> Self:
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        if self._profiler is None:
            raise RuntimeError("PeakMemory.region() must be entered inside `with PeakMemory() as memory:`")
        if self._region_name is not None:
            raise RuntimeError("PeakMemory measures one region; use a new PeakMemory for another")
        self._region_name = f"torch_ext.memory.region.{next(_region_numbers)}"
        with record_function(self._region_name):
            yield

    def __exit__(self, *exc_info) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(*exc_info)
        if exc_info[0] is None:
            if self._region_name is None:
                raise RuntimeError("PeakMemory: no region() was entered, so there is nothing to measure")
            self.peak_bytes = _region_peak_bytes(profiler, self._region_name)


def _all_events(roots) -> list:
    events, stack = [], list(roots)
    while stack:
        event = stack.pop()
        events.append(event)
        stack.extend(event.children)
    return events


def _key(event) -> tuple[int, int, int]:
    # The tree's Python wrappers are made anew on each access: an event is known by what it reports.
    return (event.start_time_ns, event.typed[1].alloc_size, event.typed[1].total_allocated)


def _region_peak_bytes(profiler: profile, region_name: str) -> int:
    events = _all_events(profiler.profiler.kineto_results.experimental_event_tree())
    (region,) = [event for event in events if event.name == region_name]
    # The region's own thread's allocations are its descendants in the tree, whatever their timestamps say: a
    # test's one allocation inside a region was once left out, its timestamp read just outside the region's span
    # (the region read 0 bytes, on a loaded machine). Other threads' are found by their timestamps.
    inside = dict.fromkeys(_key(event) for event in _all_events([region]) if event.tag == _EventType.Allocation)
    inside.update(
        dict.fromkeys(
            _key(event)
            for event in events
            if event.tag == _EventType.Allocation and region.start_time_ns <= event.start_time_ns <= region.end_time_ns
        )
    )
    if not inside:
        return 0
    levels = _levels_without_unknown_frees(events)
    allocations = sorted(inside, key=lambda key: key[0])  # by start time, ties in the order found
    level, counted = levels[allocations[0]]
    level_at_start = level - counted
    return max(0, max(levels[key][0] for key in allocations) - level_at_start)


def _levels_without_unknown_frees(events: list) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Each allocation event's (running total, bytes it counted for), leaving out the frees of blocks this
    session did not see allocated.

    The reporter learns a block's size at its allocation while any memory profiling is on, and forgets it only
    at a free while profiling is on. So it reports the free of a block an earlier profiler saw allocated, and of
    a later block at the address of one allocated under an earlier profiler and freed after it (with the old
    size). Such a block was made before this session, so its free must not count. Counted, it is the likely
    reason a test region's 4000 bytes read 0 in about 1 of 3 full-suite runs, after other tests had profiled
    memory (the first case reproduces that reading: test_backward_memory.py).
    """
    allocations = sorted((e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    live: set[int] = set()
    uncounted = 0
    levels = {}
    for event in allocations:
        fields = event.typed[1]
        counted = fields.alloc_size
        if fields.alloc_size > 0:
            live.add(fields.ptr)
        elif fields.ptr in live:
            live.discard(fields.ptr)
        else:
            uncounted -= fields.alloc_size
            counted = 0
        levels[_key(event)] = (fields.total_allocated + uncounted, counted)
    return levels
