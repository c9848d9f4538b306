"""Tracing: what torch_ext's engine ran, in which order, at which priority and why.

    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    t.events                        # plain dicts, below
    t.save_chrome_trace("bw.json")  # Perfetto (ui.perfetto.dev) or chrome://tracing
    t.plot("bw.png")                # a timeline (needs matplotlib: pip install torch_ext[bench])

Every backward that torch_ext's engine runs while the ``with`` block is active is recorded, on any
thread: ``torch_ext.backward``/``grad``, ``loss.backward()`` under :func:`torch_ext.enable`, and
the two passes of split backward. A call is recorded if tracing was on when it started and it
finished before the block ended. ``Trace.events`` is filled when the block exits. Traces do not
nest: entering one while another is active (on any thread) raises ``RuntimeError``.

Each event of ``Trace.events`` is a dict; the list is sorted by ``start_ns`` (an enclosing span
before what it encloses):

    id              int: the event's index in ``events``.
    kind            "backward": one backward call (discovery, its nodes, its final waits);
                    "node": one node (hooks, apply, routing its outputs);
                    "collective_wait": the engine blocked on a collective's in-flight result.
    name            node: ``grad_fn.name()``; backward: "backward", "grad", "backward_input" or
                    "backward_weight"; collective_wait: the node that read the result first and so
                    waited (the consumer), or "end of backward" when no node read it, or "error"
                    when a backward error made the engine wait before raising.
    sequence_nr     the node's (a wait's: its consumer's); -1 where there is none (backward spans,
                    AccumulateGrad, the end-of-backward wait).
    priority        the node's effective priority in that call (0 for other kinds).
    priority_from   None (the default priority), "set_priority" (set_priority/launch_first on the
                    node itself), "priorities" (the call's ``priorities=`` argument), "collective"
                    (the automatic priority of a collective) or "propagated" (from a node it
                    leads to, see priority_origin).
    priority_origin for "propagated": {"name", "sequence_nr", "priority_from"} of the node whose
                    priority this is (its priority_from is one of the first three); else None.
    start_ns        start, end: time.perf_counter_ns() clock (CLOCK_MONOTONIC; the engine reads
    end_ns          it as trace_clock_ns()).
    thread          threading.get_native_id() of the thread that ran it.
    backward_id     the backward call it belongs to (the "backward" event with the same id
                    encloses it); unique in the process.
    collective      True for a node that launched a collective and left its result in flight
                    (the launch) or that the engine prioritised as a collective.
    wait_for        collective_wait: the ``id`` of the launching node's event; else None.

:func:`plot_timelines` draws any lists of such dicts (for instance stock PyTorch's backward
converted from ``torch.profiler``); of the keys it reads only ``start_ns`` and ``end_ns`` are
required.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from torch_ext._loader import _C

_KINDS = _C.trace_kinds
_PRIORITY_FROM = _C.trace_priority_sources
_MATPLOTLIB_MISSING = (
    "torch_ext: plotting a trace needs matplotlib; install it with `pip install torch_ext[bench]` "
    "or `pip install matplotlib`"
)


def _events_from_calls(calls: list[tuple]) -> list[dict[str, Any]]:
    """The recorder's per-call tuples (csrc/bindings/python_bindings.cpp, traced_event_tuple) as sorted dicts."""
    events = []
    for backward_id, thread, call_events in calls:
        for local_index, fields in enumerate(call_events):
            (
                kind,
                name,
                seq,
                priority,
                source,
                origin_source,
                origin_name,
                origin_seq,
                start,
                end,
                collective,
                wait_for,
            ) = fields
            priority_from = _PRIORITY_FROM[source]
            events.append(
                {
                    "kind": _KINDS[kind],
                    "name": name,
                    "sequence_nr": seq,
                    "priority": priority,
                    "priority_from": priority_from,
                    "priority_origin": (
                        {"name": origin_name, "sequence_nr": origin_seq, "priority_from": _PRIORITY_FROM[origin_source]}
                        if priority_from == "propagated"
                        else None
                    ),
                    "start_ns": start,
                    "end_ns": end,
                    "thread": thread,
                    "backward_id": backward_id,
                    "collective": collective,
                    # Resolved to the launch's id below.
                    "wait_for": (backward_id, wait_for) if wait_for >= 0 else None,
                    "_local": (backward_id, local_index),
                }
            )
    # Enclosing spans first among equal starts: longer first, then in recording order.
    events.sort(key=lambda event: (event["start_ns"], -event["end_ns"], event["_local"]))
    id_of = {}
    for index, event in enumerate(events):
        event["id"] = index
        id_of[event.pop("_local")] = index
    for event in events:
        if event["wait_for"] is not None:
            event["wait_for"] = id_of[event["wait_for"]]
    return events


class Trace:
    """What :func:`trace` recorded: ``events`` (see the module docstring), filled when the block exits."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def save_chrome_trace(self, path: str | os.PathLike) -> None:
        """Writes the events as Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

        Every event is a complete ("X") event on its thread, times in microseconds of the
        perf_counter clock; each collective's launch is linked to its wait by a flow arrow ("s"/"f").
        """
        with open(path, "w") as f:
            json.dump(chrome_trace(self.events), f)

    def plot(self, path: str | os.PathLike, title: str | None = None) -> None:
        """Writes a PNG timeline of the events (:func:`plot_timelines`); needs matplotlib."""
        plot_timelines([("torch_ext", self.events)], path, title=title)

    def __repr__(self) -> str:
        return f"Trace({len(self.events)} events)"


class trace:  # lower case: used like a function, `with torch_ext.trace() as t`
    """Records every backward torch_ext runs inside the ``with`` block, on every thread.

    ``with torch_ext.trace() as t:`` gives a :class:`Trace`, whose ``events`` are filled on exit,
    also when the block raises. Raises ``RuntimeError`` if a trace is already active.
    """

    def __init__(self) -> None:
        self._trace = Trace()

    def __enter__(self) -> Trace:
        _C.trace_start()
        return self._trace

    def __exit__(self, *exc_info) -> None:
        _C.trace_stop()
        self._trace.events = _events_from_calls(_C.trace_take())


def trace_clock_ns() -> int:
    """The trace's clock now, in ns: CLOCK_MONOTONIC, the clock of ``time.perf_counter_ns()``."""
    return _C.trace_clock_ns()


def chrome_trace(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON (a dict) for ``events``: "X" spans, "s"/"f" flows, names as metadata."""
    pid = os.getpid()
    trace_events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "torch_ext backward"}}
    ]
    threads = sorted({event.get("thread", 0) for event in events})
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    for tid in threads:
        name = names.get(tid, "thread")
        trace_events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"{name} ({tid})"}}
        )
    for event in events:
        kind = event.get("kind", "node")
        name = event["name"] if kind != "collective_wait" else f"wait: {event['name']}"
        args = {
            key: event.get(key)
            for key in ("id", "sequence_nr", "priority", "priority_from", "priority_origin", "backward_id", "wait_for")
            if event.get(key) is not None
        }
        if event.get("collective"):
            args["collective"] = True
        trace_events.append(
            {
                "ph": "X",
                "name": name,
                "cat": "collective" if event.get("collective") else kind,
                "ts": event["start_ns"] / 1e3,
                "dur": (event["end_ns"] - event["start_ns"]) / 1e3,
                "pid": pid,
                "tid": event.get("thread", 0),
                "args": args,
            }
        )
    for flow_id, (launch, wait) in enumerate(_launch_wait_pairs(events)):
        common = {"name": "collective in flight", "cat": "collective", "id": flow_id, "pid": pid}
        # A flow binds to the slice enclosing its timestamp on its thread: the launch's and the wait's.
        trace_events.append({**common, "ph": "s", "ts": launch["start_ns"] / 1e3, "tid": launch.get("thread", 0)})
        trace_events.append(
            {**common, "ph": "f", "bp": "e", "ts": wait["start_ns"] / 1e3, "tid": wait.get("thread", 0)}
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ns"}


def _launch_wait_pairs(events: Sequence[dict[str, Any]]) -> list[tuple[dict, dict]]:
    # wait_for names the launch's "id"; a list without ids (built by other code) is indexed by position.
    by_id = {event["id"]: event for event in events if isinstance(event.get("id"), int)}
    if not by_id:
        by_id = dict(enumerate(events))
    pairs = []
    for event in events:
        launch = by_id.get(event.get("wait_for")) if event.get("kind") == "collective_wait" else None
        if launch is not None:
            pairs.append((launch, event))
    return pairs


# Colours of plot_timelines (matplotlib's tab10): plain, boosted and collective nodes, waits, calls.
_NODE_COLOUR = "#1f77b4"
_BOOSTED_COLOUR = "#ff7f0e"
_COLLECTIVE_COLOUR = "#d62728"
_WAIT_COLOUR = "#7f7f7f"
_BACKWARD_COLOUR = "#c7c7c7"


def plot_timelines(
    rows: Sequence[tuple[str, Sequence[dict[str, Any]]]],
    path: str | os.PathLike,
    title: str | None = None,
) -> None:
    """Writes a PNG with one timeline per ``(label, events)`` row, one above the other.

    Each row's time axis starts at its first event, so backward passes recorded at different times
    (or by different engines) line up. In a row, each thread gets a lane; "backward" spans are thin
    grey bars under it, nodes are bars (orange when their priority was raised, red for a collective's
    launch), "collective_wait" spans are grey and a hatched band runs from each collective's launch to
    its wait (the time its result was in flight). ``events`` are dicts as in :attr:`Trace.events`;
    only ``start_ns`` and ``end_ns`` are required (``kind`` defaults to "node", ``priority`` to 0,
    ``priority_from`` to None, ``collective`` to False, ``thread`` to 0, ``wait_for`` to None).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(_MATPLOTLIB_MISSING) from error

    lanes = []  # (row label, thread, events of that thread, row start)
    for label, events in rows:
        row_start = min((event["start_ns"] for event in events), default=0)
        threads = sorted({event.get("thread", 0) for event in events}) or [0]
        for thread in threads:
            lanes.append((label if len(threads) == 1 else f"{label} (thread {thread})", thread, events, row_start))

    figure = Figure(figsize=(12, 1.0 + 0.9 * len(lanes)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    span_end_ms = 0.0
    for lane_index, (_, thread, events, row_start) in enumerate(lanes):
        y = len(lanes) - 1 - lane_index

        def ms(ns: int, row_start: int = row_start) -> float:
            return (ns - row_start) / 1e6

        mine = [event for event in events if event.get("thread", 0) == thread]
        for event in mine:
            start, end = ms(event["start_ns"]), ms(event["end_ns"])
            span_end_ms = max(span_end_ms, end)
            kind = event.get("kind", "node")
            if kind == "backward":
                axes.broken_barh([(start, end - start)], (y - 0.4, 0.1), color=_BACKWARD_COLOUR)
            elif kind == "collective_wait":
                axes.broken_barh([(start, end - start)], (y - 0.25, 0.5), color=_WAIT_COLOUR)
            else:
                if event.get("collective"):
                    colour = _COLLECTIVE_COLOUR
                elif event.get("priority", 0) > 0 or event.get("priority_from") is not None:
                    colour = _BOOSTED_COLOUR
                else:
                    colour = _NODE_COLOUR
                axes.broken_barh(
                    [(start, end - start)], (y - 0.25, 0.5), color=colour, edgecolor="white", linewidth=0.3
                )
        for launch, wait in _launch_wait_pairs(events):
            if wait.get("thread", 0) != thread:
                continue
            start, end = ms(launch["start_ns"]), ms(wait["end_ns"])
            axes.broken_barh(
                [(start, end - start)], (y + 0.27, 0.1), facecolor="none", edgecolor=_COLLECTIVE_COLOUR, hatch="////"
            )

    axes.set_yticks(range(len(lanes)), [lane[0] for lane in reversed(lanes)])
    axes.set_ylim(-0.6, len(lanes) - 0.4)
    axes.set_xlim(0, span_end_ms * 1.01 if span_end_ms > 0 else 1)
    axes.set_xlabel("ms since the row's first event")
    axes.legend(
        handles=[
            Patch(color=_NODE_COLOUR, label="node"),
            Patch(color=_BOOSTED_COLOUR, label="node, priority raised"),
            Patch(color=_COLLECTIVE_COLOUR, label="collective launch"),
            Patch(color=_WAIT_COLOUR, label="wait on collective"),
            Patch(facecolor="none", edgecolor=_COLLECTIVE_COLOUR, hatch="////", label="collective in flight"),
            Patch(color=_BACKWARD_COLOUR, label="backward call"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(lanes) < 3 else -0.12),
        ncol=6,
        fontsize="small",
    )
    if title is not None:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, format="png")
