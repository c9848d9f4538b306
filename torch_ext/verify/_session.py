"""Both runs of the step: the wrapper of ``Variable._execution_engine`` that every backward call of the step goes
through, what stock's run records and what torch_ext's run is compared against.

The session is the one object that sees the run as it happens (which engine, which step, which backward call), so
it holds the records, the differences found and the notes; the snapshot, the graph walk and the comparison it
calls are each in their own module and know nothing of the run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_ext import engine as _engine
from torch_ext.tracing import trace
from torch_ext.verify._compare import _compare_values, _values
from torch_ext.verify._graph import _AccumulateGrad, _from_trace, _Graph, _ms, _walk
from torch_ext.verify._report import ENGINES, BackwardRun, Collective, Difference
from torch_ext.verify._snapshot import _clone, _Snapshot


@dataclasses.dataclass
class _CallRecord:
    """What stock's run left after one backward call, for the torch_ext run to compare with."""

    grads: dict[int, torch.Tensor | None] | None  # id(param) -> .grad; None for a grad() call
    results: list[torch.Tensor | None] | None  # a grad() call's results
    producers: dict[int, list[str]]
    accumulation_order: list[int]  # id(param), in the order stock accumulated them


@dataclasses.dataclass
class _StepRecord:
    calls: list[_CallRecord] = dataclasses.field(default_factory=list)
    state: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    returned: list[Any] = dataclasses.field(default_factory=list)


class _Session:
    """Both runs: the engine wrapper's target, the stock records and the differences found."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self.engine = "stock"
        self.step_index = 0
        self.records: list[_StepRecord] = []
        self.differences: list[Difference] = []
        self.compared = 0
        self.backward_runs: dict[str, list[BackwardRun]] = {engine: [] for engine in ENGINES}
        self.notes: list[str] = []
        # Per thread: inside a recorded backward call (a nested one, a reentrant checkpoint's, passes through).
        self._inside = threading.local()
        self._stock_engine: Any = None
        self._wrapped_engine: Any = None
        self._call_index = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The engine wrapper and the optimizer pre-step hook, for the duration."""
        router = _engine._installed_router()
        self._stock_engine = router.replaced
        self._wrapped_engine = Variable._execution_engine
        recording = _RecordingEngine(self, self._wrapped_engine)
        Variable._execution_engine = recording
        optimizer_hook = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: self.snapshot.add_optimizer(optimizer)
        )
        try:
            yield
        finally:
            optimizer_hook.remove()
            if Variable._execution_engine is recording:
                Variable._execution_engine = self._wrapped_engine

    def run(self, engine: str, step: Callable[[], Any], steps: int) -> None:
        self.engine = engine
        with _engine.enable() if engine == "torch_ext" else contextlib.nullcontext():
            for index in range(steps):
                self.step_index, self._call_index = index, 0
                if engine == "stock":
                    self.records.append(_StepRecord())
                try:
                    returned = step()
                except BaseException as error:
                    error.add_note(f"torch_ext.verify: raised in step {index} of the {engine} run")
                    raise
                self._after_step(returned)

    # The wrapper's run_backward.
    def backward(self, tensors, args: tuple, kwargs: dict):
        engine = self._stock_engine if self.engine == "stock" else self._wrapped_engine
        if getattr(self._inside, "call", False):
            return engine.run_backward(tensors, *args, **kwargs)
        accumulate_grad = kwargs.get("accumulate_grad", args[5] if len(args) > 5 else False)
        graph = _walk(tensors)
        if accumulate_grad:
            for leaf in graph.leaves:
                self.snapshot.add_leaf(leaf)
        self._inside.call = True
        try:
            if self.engine == "stock":
                result, run, accumulation_order = self._run_stock(graph, engine, tensors, args, kwargs)
            else:
                result, run = self._run_torch_ext(graph, engine, tensors, args, kwargs)
                accumulation_order = []
        finally:
            self._inside.call = False
        self.backward_runs[self.engine].append(run)
        if accumulate_grad:
            grads = {id(tracked.live): _clone(tracked.live.grad) for tracked in self.snapshot.parameters()}
            results = None
        else:
            grads, results = None, [_clone(value) for value in result]
        producers = {leaf: [graph.describe(node) for node in nodes] for leaf, nodes in graph.producers.items()}
        call = _CallRecord(grads, results, producers, accumulation_order)
        if self.engine == "stock":
            self.records[self.step_index].calls.append(call)
        else:
            self._compare_call(call)
        self._call_index += 1
        return result

    def _run_stock(self, graph: _Graph, engine, tensors, args, kwargs):
        spans: dict[Any, list[int]] = {}

        def started(node, grad_outputs):
            spans[node] = [time.perf_counter_ns(), 0, threading.get_native_id()]

        def finished(node, grad_inputs, grad_outputs):
            spans[node][1] = time.perf_counter_ns()

        handles = []
        for node in graph.nodes:
            handles.append(node.register_prehook(functools.partial(started, node)))
            handles.append(node.register_hook(functools.partial(finished, node)))
        start = time.perf_counter_ns()
        try:
            result = engine.run_backward(tensors, *args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            for handle in handles:
                handle.remove()
        ran = sorted(spans.items(), key=lambda item: item[1][0])
        span_of = dict(ran)
        collectives = []
        for node, (node_start, node_end, _) in ran:
            role = graph.roles.get(node)
            if role not in ("launch", "lane"):
                continue
            wait = graph.wait_of.get(node)
            waits = ()
            if wait is not None and wait in span_of:
                wait_start, wait_end, _ = span_of[wait]
                waits = ((graph.label(wait), _ms(wait_start - start), _ms(wait_end - start)),)
            collectives.append(
                Collective(graph.label(node), role, _ms(node_start - start), _ms(node_end - start), waits)
            )
        run = BackwardRun(
            "stock",
            self.step_index,
            self._call_index,
            _ms(end - start),
            tuple(graph.label(node) for node, _ in ran),
            tuple(collectives),
        )
        accumulation_order = [id(node.variable) for node, _ in ran if isinstance(node, _AccumulateGrad)]
        return result, run, accumulation_order

    def _run_torch_ext(self, graph: _Graph, engine, tensors, args, kwargs):
        tracer = trace()
        try:
            recorded = tracer.__enter__()
        except RuntimeError:  # a trace of the step's own is active: traces do not nest
            recorded = None
            self._note("a torch_ext.trace() of the step's own was active: torch_ext's order was not recorded")
        start = time.perf_counter_ns()
        try:
            result = engine.run_backward(tensors, *args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            if recorded is not None:
                tracer.__exit__(None, None, None)
        order, collectives = None, ()
        if recorded is not None:
            order, collectives = _from_trace(graph, recorded.events)
            if order is None:
                self._note("a backward call left no torch_ext trace: it ran on stock's engine (compiled autograd?)")
        run = BackwardRun("torch_ext", self.step_index, self._call_index, _ms(end - start), order, collectives)
        return result, run

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def _difference(self, backward_call: int | None, what: str, name: str, detail: str | None, produced_by=()):
        self.compared += 1
        if detail is not None:
            self.differences.append(Difference(self.step_index, backward_call, what, name, detail, tuple(produced_by)))

    def _compare_call(self, ours: _CallRecord) -> None:
        calls = self.records[self.step_index].calls
        index = self._call_index
        if index >= len(calls):
            return  # counted in _after_step
        stock = calls[index]
        if (stock.grads is None) != (ours.grads is None):
            kinds = ["backward() (accumulating)" if call.grads is not None else "grad()" for call in (stock, ours)]
            self._difference(index, "backward calls", "the call", f"stock made a {kinds[0]} call, torch_ext {kinds[1]}")
            return
        if ours.grads is None:
            for position, (theirs, mine) in enumerate(itertools.zip_longest(stock.results, ours.results)):
                self._difference(index, "grad() result", f"output {position}", _compare_values(theirs, mine))
            return
        rank = {param: position for position, param in enumerate(stock.accumulation_order)}
        params = sorted(stock.grads.keys() | ours.grads.keys(), key=lambda param: rank.get(param, len(rank)))
        for param in params:
            name = self.snapshot.tracked[param].name
            detail = _compare_values(
                stock.grads.get(param), ours.grads.get(param), missing_on_stock=param not in stock.grads
            )
            self._difference(
                index, "gradient", name, detail, ours.producers.get(param) or stock.producers.get(param, ())
            )

    def _after_step(self, returned: Any) -> None:
        state = self._state_after_step()
        returned_values = [_clone(value) if isinstance(value, torch.Tensor) else value for value in _values(returned)]
        if self.engine == "stock":
            record = self.records[self.step_index]
            record.state, record.returned = state, returned_values
            if not record.calls:
                self._note(f"step {self.step_index} ran no backward: there was nothing for the engines to differ on")
            return
        record = self.records[self.step_index]
        if self._call_index != len(record.calls):
            self._difference(
                None, "backward calls", "the step", f"stock made {len(record.calls)}, torch_ext {self._call_index}"
            )
        for key in [*record.state, *(key for key in state if key not in record.state)]:
            what, name = key
            self._difference(None, what, name, _compare_values(record.state.get(key), state.get(key)))
        for position, (theirs, mine) in enumerate(itertools.zip_longest(record.returned, returned_values)):
            self._difference(None, "return value", f"value {position}", _compare_values(theirs, mine))

    def _state_after_step(self) -> dict[tuple[str, str], Any]:
        """``{(what, name): value}`` of every snapshotted tensor and every optimizer's state."""
        state = {("state", tracked.name): _clone(tracked.live) for tracked in self.snapshot.tracked.values()}
        for name, optimizer, _ in self.snapshot.optimizers.values():
            params = [param for group in optimizer.param_groups for param in group["params"]]
            for key, per_param in optimizer.state_dict()["state"].items():
                if isinstance(key, int) and 0 <= key < len(params):
                    key = self.snapshot.name_of(params[key])
                for field, value in per_param.items():
                    state["optimizer state", f"{name}[{key}].{field}"] = (
                        _clone(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                    )
        return state


class _RecordingEngine:
    """``Variable._execution_engine`` while verify runs: every backward call goes through its session."""

    def __init__(self, session: _Session, wrapped) -> None:
        self._session = session
        self._wrapped = wrapped

    def run_backward(self, tensors, *args, **kwargs):
        return self._session.backward(tensors, args, kwargs)

    def queue_callback(self, callback) -> None:
        return self._wrapped.queue_callback(callback)

    def is_checkpoint_valid(self) -> bool:
        return self._wrapped.is_checkpoint_valid()

    def __getattr__(self, name: str):
        return getattr(self._wrapped, name)
