"""What :func:`torch_ext.verify.verify` returns and how it reads: the report's classes and their text.

Kept apart from the code that fills them in, so that what each field means is in one place for a reader of a
report (docs/api.rst documents these classes as ``torch_ext.verify.<name>``), and because the snapshot, the graph
walk, the comparison and the session all name values and record runs in these terms: they import from here, and
this module imports none of them.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

ENGINES = ("stock", "torch_ext")
# How many differences summary() lists, and how many nodes of an order it prints.
_LISTED_DIFFERENCES = 10
_LISTED_NODES = 12


@dataclasses.dataclass(frozen=True)
class Difference:
    """One value that is not the same bits on the two engines.

    ``what`` is "gradient" (``.grad`` after a backward call), "grad() result", "backward calls"
    (the engines ran a different number), "state" (a parameter, buffer or shard after the step),
    "optimizer state" or "return value". ``backward_call`` is the call's index within the step, None
    for what is compared after the step. ``produced_by``, for a gradient: the nodes whose outputs fed
    the parameter's ``AccumulateGrad`` in that call, as ``"Name (sequence_nr N)"``.
    """

    step: int
    backward_call: int | None
    what: str
    name: str
    detail: str
    produced_by: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"step {self.step}" + (
            f", backward call {self.backward_call}" if self.backward_call is not None else ""
        )
        text = f"{where}: {self.what} of {self.name}: {self.detail}"
        if self.produced_by:
            text += f"; produced by {', '.join(self.produced_by)}"
        return text


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective one backward call ran: the node that launched it and where its result was waited on.

    Times are ms since the call began. ``waits`` are ``(where, start_ms, end_ms)``: a deferred wait
    (torch_ext's trace, named after the node that read the result first), or the node of a Req/Wait
    pair's wait. A collective with no wait waited inside its own node (synchronous: all of it exposed).
    """

    node: str
    role: str
    launch_start_ms: float
    launch_end_ms: float
    waits: tuple[tuple[str, float, float], ...]
    # Its node ran on another thread than the engine's (a collective lane).
    beside_engine: bool = False

    @property
    def in_flight_ms(self) -> float:
        """From the launch node's end to the last wait's end; a synchronous one (or one on a lane, whose
        outputs the trace shows no wait for): its node's span."""
        if not self.waits:
            return self.launch_end_ms - self.launch_start_ms
        return max(end for _, _, end in self.waits) - self.launch_end_ms

    @property
    def exposed_ms(self) -> float:
        """Time the engine spent blocked on it: its waits; a synchronous one: its whole node; one that ran
        on a lane beside the engine: only its recorded waits."""
        if not self.waits:
            return 0.0 if self.beside_engine else self.launch_end_ms - self.launch_start_ms
        return sum(end - start for _, start, end in self.waits)

    def __str__(self) -> str:
        text = f"{self.node} launched at {self.launch_start_ms:.3f} ms"
        if not self.waits:
            if self.beside_engine:
                return text + f", ran beside the engine until {self.launch_end_ms:.3f} ms"
            return text + f", synchronous (done at {self.launch_end_ms:.3f} ms)"
        waits = ", ".join(f"{where} {start:.3f}-{end:.3f} ms" for where, start, end in self.waits)
        return text + f", waited on in {waits}"


@dataclasses.dataclass(frozen=True)
class BackwardRun:
    """One backward call as one engine ran it.

    ``order``: the nodes in the order they ran, each ``"Name"`` or, for a node with a sequence
    number, ``"Name #k"`` with k its position in a walk of the call's graph from the roots (the same
    node on both engines has the same k; raw sequence numbers differ between the runs' graphs).
    ``None`` where it could not be recorded (a :func:`torch_ext.trace` already active in the step).
    ``duration_ms``: the call's wall time, recording included (stock: a hook on every node; torch_ext: its
    trace).
    """

    engine: str
    step: int
    index: int
    duration_ms: float
    order: tuple[str, ...] | None
    collectives: tuple[Collective, ...]

    @property
    def cold(self) -> bool:
        """Whether this is the engine's first run of the call (step 0): its time includes one-off setup, and on
        torch_ext planning a graph structure new to the process (later calls replay the plan). Later steps' times
        are warm."""
        return self.step == 0

    @property
    def overlap(self) -> float | None:
        """The share of the collectives' time in flight during which the engine ran other nodes instead of
        waiting (1: all hidden, 0: all exposed); None without collectives. Read from the timeline, so an
        upper bound: a collective may have finished before its wait began.
        """
        return _overlap([self])


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found. ``str(report)`` is :meth:`summary`.

    ``identical``: every compared value had the same bits on both engines (this rank's).
    ``differences``: each value that did not, earliest first (see the module docstring for the
    order); ``first_difference`` is the first or None. ``backward``: ``{"stock": [...], "torch_ext":
    [...]}``, a :class:`BackwardRun` per backward call. ``ranks_identical``: under
    ``torch.distributed``, each rank's ``identical``, gathered from every rank of the group; None
    otherwise. ``notes``: what was discovered rather than given, and what could not be recorded.
    """

    steps: int
    identical: bool
    differences: list[Difference]
    backward: dict[str, list[BackwardRun]]
    compared: int
    notes: list[str]
    rank: int | None = None
    ranks_identical: list[bool] | None = None

    @property
    def first_difference(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    @property
    def all_ranks_identical(self) -> bool:
        """``identical`` on every rank (this one's alone outside ``torch.distributed``)."""
        return all(self.ranks_identical) if self.ranks_identical is not None else self.identical

    def overlap(self, engine: str) -> float | None:
        """:attr:`BackwardRun.overlap` over all of the engine's backward calls."""
        return _overlap(self.backward[engine])

    def summary(self, verbose: bool = False) -> str:
        """A readable account; ``verbose`` lists every difference and each call's whole node order."""
        steps = f"{self.steps} step{'s' if self.steps != 1 else ''}"
        lines = []
        if self.identical:
            lines.append(f"torch_ext.verify: IDENTICAL: {self.compared} values bit for bit, {steps}")
        else:
            lines.append(
                f"torch_ext.verify: DIFFERENT: {len(self.differences)} of {self.compared} values differ, {steps}"
            )
            lines.append(f"  first: {self.differences[0]}")
            rest = self.differences[1:] if verbose else self.differences[1:_LISTED_DIFFERENCES]
            lines += [f"  also:  {difference}" for difference in rest]
            if not verbose and len(self.differences) > _LISTED_DIFFERENCES:
                lines.append(f"  ... and {len(self.differences) - _LISTED_DIFFERENCES} more")
            if any(d.what == "return value" for d in self.differences):
                lines.append(
                    "  the step's return value differs: if it is the loss, forward differed (data that "
                    "advances between runs, a generator not snapshotted, or nondeterministic kernels)"
                )
        if self.ranks_identical is not None:
            different = [rank for rank, same in enumerate(self.ranks_identical) if not same]
            lines.append(
                f"  ranks: {len(self.ranks_identical)}, "
                + ("all identical" if not different else f"different on rank(s) {different}")
            )
        stock_runs = {(run.step, run.index): run for run in self.backward["stock"]}
        our_runs = {(run.step, run.index): run for run in self.backward["torch_ext"]}
        for call in sorted(stock_runs.keys() | our_runs.keys()):
            lines += _describe_calls(stock_runs.get(call), our_runs.get(call), verbose)
        if stock_runs or our_runs:
            lines.append(_describe_times(self))
        if any(run.collectives for runs in self.backward.values() for run in runs):
            overlaps = {engine: self.overlap(engine) for engine in ENGINES}
            lines.append(
                "  overlap (share of collectives' time in flight spent running other nodes): "
                + ", ".join(f"{engine} {_format_share(value)}" for engine, value in overlaps.items())
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _overlap(runs: Sequence[BackwardRun]) -> float | None:
    in_flight = sum(collective.in_flight_ms for run in runs for collective in run.collectives)
    exposed = sum(collective.exposed_ms for run in runs for collective in run.collectives)
    if in_flight <= 0:
        return None
    return min(max(1.0 - exposed / in_flight, 0.0), 1.0)


def _format_share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _describe_times(report: VerifyReport) -> str:
    """The line that says which times are cold and, past step 0, each engine's warm time per step."""
    cold = "step 0's times are cold (first calls: one-off setup; torch_ext plans a graph structure new to the process)"
    if report.steps == 1:
        return f"  times: {cold}; steps=2 or more (--steps 2) reports warm ones too"
    per_step = {
        engine: [
            sum(run.duration_ms for run in runs if run.step == step)
            for step in range(1, report.steps)
            if any(run.step == step for run in runs)
        ]
        for engine, runs in report.backward.items()
    }
    if not all(per_step.values()):
        return f"  times: {cold}"
    warm = ", ".join(f"{engine} {statistics.median(times):.2f} ms" for engine, times in per_step.items())
    steps = "step 1" if report.steps == 2 else f"steps 1-{report.steps - 1}"
    return f"  warm backward time per step (median of {steps}): {warm}; {cold}"


def _describe_calls(stock: BackwardRun | None, ours: BackwardRun | None, verbose: bool) -> list[str]:
    """A backward call as the two engines ran it: sizes and times, the orders (where they part), the collectives."""
    runs = (("stock", stock), ("torch_ext", ours))
    first = stock if stock is not None else ours
    lines = [
        f"  step {first.step}, backward call {first.index}{' (cold)' if first.cold else ''}: "
        + "; ".join(f"{engine} {_describe_run(run)}" for engine, run in runs)
    ]
    orders = {engine: run.order for engine, run in runs if run is not None and run.order is not None}
    shown = {engine: (0, len(order)) for engine, order in orders.items()}
    if len(orders) == 2:
        stock_order, our_order = orders["stock"], orders["torch_ext"]
        if stock_order == our_order:
            lines.append("    order: the same on both engines")
        else:
            parting = next(
                (i for i, (a, b) in enumerate(zip(stock_order, our_order)) if a != b),
                min(len(stock_order), len(our_order)),
            )
            lines.append(f"    order: first differs at node {parting}:")
            if not verbose:
                shown = {engine: (max(parting - 2, 0), parting + 3) for engine in orders}
    for engine, order in orders.items():
        start, end = (0, len(order)) if verbose else shown[engine]
        if not verbose and (start, end) == (0, len(order)):
            end = _LISTED_NODES
        nodes = order[start:end]
        where = "" if len(nodes) == len(order) else f" (nodes {start}-{start + len(nodes) - 1} of {len(order)})"
        lines.append(f"    {engine + ':':<11}{', '.join(nodes)}{where}")
    for engine, run in runs:
        lines += [f"    collective, {engine}: {collective}" for collective in (run.collectives if run else ())]
    return lines


def _describe_run(run: BackwardRun | None) -> str:
    if run is None:
        return "(no such call)"
    nodes = "? nodes" if run.order is None else f"{len(run.order)} nodes"
    return f"{nodes} in {run.duration_ms:.2f} ms"


def _kind(value: Any) -> str:
    """A value as the report names it: ``float32[3, 4]`` for a tensor, else its type's name (``None`` for None)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return "None" if value is None else type(value).__name__
