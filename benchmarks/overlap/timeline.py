"""The overlap's timelines (--timeline): a stock backward traced by torch.profiler in torch_ext.trace()'s event
format (``stock_backward_events``), and rank 0's traced backwards drawn one above the other."""

from __future__ import annotations

import json
import os
import time

import torch

# The profiler's name for one node run by the stock engine.
PROFILER_NODE_PREFIX = "autograd::engine::evaluate_function: "
# A process group's ops (c10d::alltoall_base_, c10d::allreduce_, ...): a node inside which one runs
# launched a collective.
PROFILER_COLLECTIVE_PREFIX = "c10d::"
# Where a functional collective blocks for its result (inside the collective's own backward node).
PROFILER_WAIT_OPS = ("_c10d_functional::wait_tensor",)
# Node._sequence_nr() of a node without one (AccumulateGrad) is UINT64_MAX; the trace format has -1.
FIRST_INVALID_SEQUENCE_NR = 2**63


def stock_backward_events(loss: torch.Tensor) -> list[dict]:
    """``loss.backward()`` on the stock engine, under torch.profiler, as a timeline in the event format
    of ``torch_ext.trace()``: one ``backward`` event for the call, one ``node`` event per node the
    engine ran (``collective`` when a process-group op ran inside it) and one ``collective_wait``
    per functional collective's wait, with ``wait_for`` the ``id`` of the collective node's event it
    waits in. Events are sorted by start (enclosing spans first) and ``id`` is the index in the list;
    ``sequence_nr`` is -1 for nodes without one (AccumulateGrad). Stock has no priorities:
    ``priority`` is 0, ``priority_from`` None.

    Times are on ``time.perf_counter_ns``'s clock, as torch_ext's: the profiler stamps events with
    wall-clock (Unix) time, so they are shifted by the two clocks' difference, read back to back.
    (Anchoring on a ``record_function`` mark instead was off by up to 0.8 ms: its start is stamped
    before the first call's dispatch overhead, measured here.)
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start_ns = time.perf_counter_ns()
        loss.backward()
        end_ns = time.perf_counter_ns()
    to_perf_counter = _perf_counter_minus_wall_clock_ns()
    events = profile.profiler.kineto_results.events()
    nodes = sorted((e for e in events if e.name().startswith(PROFILER_NODE_PREFIX)), key=lambda e: e.start_ns())

    def innermost_node(event):
        enclosing = [
            node
            for node in nodes
            if node.start_thread_id() == event.start_thread_id()
            and node.start_ns() <= event.start_ns()
            and event.end_ns() <= node.end_ns()
        ]
        return max(enclosing, key=lambda node: node.start_ns(), default=None)

    def sequence_nr(node) -> int:
        number = node.sequence_nr()
        return -1 if number < 0 or number >= FIRST_INVALID_SEQUENCE_NR else number

    launched_in = {id(innermost_node(e)) for e in events if e.name().startswith(PROFILER_COLLECTIVE_PREFIX)}
    backward_thread = nodes[0].start_thread_id() if nodes else None
    timeline = [_timeline_event("backward", "backward", -1, start_ns, end_ns, backward_thread, False)]
    event_of_node = {}
    for node in nodes:
        event = _timeline_event(
            "node",
            node.name().removeprefix(PROFILER_NODE_PREFIX),
            sequence_nr(node),
            node.start_ns() + to_perf_counter,
            node.end_ns() + to_perf_counter,
            node.start_thread_id(),
            id(node) in launched_in,
        )
        event_of_node[id(node)] = event
        timeline.append(event)
    # (wait event, the collective node's event it waits in, or None)
    waits = []
    for wait in (e for e in events if e.name() in PROFILER_WAIT_OPS):
        node = innermost_node(wait)
        event = _timeline_event(
            "collective_wait",
            wait.name(),
            -1 if node is None else sequence_nr(node),
            wait.start_ns() + to_perf_counter,
            wait.end_ns() + to_perf_counter,
            wait.start_thread_id(),
            True,
        )
        launch = event_of_node.get(id(node)) if node is not None else None
        waits.append((event, launch if launch is not None and launch["collective"] else None))
        timeline.append(event)
    # As torch_ext.trace() orders its events: by start, enclosing spans first among equal starts.
    timeline.sort(key=lambda event: (event["start_ns"], -event["end_ns"]))
    for index, event in enumerate(timeline):
        event["id"] = index
    for event, launch in waits:
        event["wait_for"] = None if launch is None else launch["id"]
    return timeline


def _perf_counter_minus_wall_clock_ns() -> int:
    before = time.perf_counter_ns()
    wall = time.time_ns()
    after = time.perf_counter_ns()
    return (before + after) // 2 - wall


def _timeline_event(kind, name, sequence_nr, start_ns, end_ns, thread, collective) -> dict:
    return {
        "id": None,  # the index in the sorted list, set by stock_backward_events
        "kind": kind,
        "name": name,
        "sequence_nr": sequence_nr,
        "priority": 0,
        "priority_from": None,
        "priority_origin": None,
        "start_ns": start_ns,
        "end_ns": end_ns,
        "thread": thread,
        "backward_id": 0,
        "collective": collective,
        "wait_for": None,
    }


def write_timelines(rows: list[tuple[str, list[dict]]], png_path: str, dense_layers: int, dim: int) -> None:
    from torch_ext.tracing import plot_timelines

    directory = os.path.dirname(png_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    json_path = os.path.splitext(png_path)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump([{"label": label, "events": events} for label, events in rows], f, indent=1)
    title = f"backward of the overlap scenario on rank 0 ({dim}d all_to_all, {dense_layers} dense layers)"
    plot_timelines(rows, png_path, title=title)
    print(f"wrote {png_path} and {json_path}")
