"""``torch_ext.verify``: a training step run on stock PyTorch and on torch_ext from one snapshot, compared bit for bit.

    report = torch_ext.verify(train_step, models=[model], optimizers=[optimizer])
    print(report)                   # identical, or the first difference; order, collectives, overlap
    assert report.identical

How it runs. The state the step reads and writes is snapshotted, the step runs ``steps`` times on
stock's engine, the snapshot is restored, the step runs ``steps`` times inside
``with torch_ext.enable()``, and the snapshot is restored again. The snapshot holds every parameter and
buffer of ``models`` (with the local shards of a TorchRec ``ShardedTensor`` in their state dicts),
each parameter's ``.grad``, a deep copy of each optimizer's and each ``stateful`` object's
``state_dict()``, and the random number generators: torch's CPU generator, CUDA's (when CUDA is
initialized), Python's ``random`` and NumPy's global one (when NumPy is imported).

What else the step touches is found as it runs, before it changes: a leaf that receives a gradient
(seen in the graph when backward starts) and an optimizer that steps (a global optimizer pre-step
hook) are added to the snapshot then. ``models`` and ``optimizers`` left out are looked for among the
objects the step refers to (its globals, closure, ``functools.partial`` arguments, a bound method's
object); buffers that forward changes (BatchNorm's running statistics) and tensors updated inside
backward (TorchRec's fused tables) are found only through ``models``.

Where gradients are read. ``Variable._execution_engine`` (the object ``torch.autograd`` calls; once
torch_ext is imported, its router) is wrapped for the duration: every backward the step starts on
any route (``loss.backward()``, ``torch.autograd.backward``/``grad``, DDP, checkpointing) goes
through the wrapper, which walks the graph from the call's roots before the engine runs (for each
leaf, the nodes that feed its ``AccumulateGrad``), times the call (stock: a pre-hook and a post hook
on each node of the graph, removed afterwards; torch_ext: :func:`torch_ext.trace`), and when the call
returns copies every snapshotted parameter's ``.grad``: after DDP's reduction, before the optimizer
reads it or ``zero_grad`` clears it. A ``torch.autograd.grad`` call's results are compared instead.
The stock run calls the engine torch_ext's router replaced, so it is stock even when
:func:`torch_ext.enable` is on.

Compared bit for bit (floating-point tensors as integers of the same width, so NaNs compare equal
where they have the same bits and -0.0 differs from 0.0): the gradients after each backward call,
every snapshotted tensor and every optimizer's state after each step, and the step's return value
(tensors and numbers in it, such as the loss). The first difference is the earliest in the run: by
step, then by backward call, then, among gradients, the one stock accumulated first (nearest the
loss: the others are downstream of it); then tensors after the step, then the return value.

Requirements on the step: it takes no arguments, and what it computes depends only on the snapshot
(a fixed batch, or a batch drawn from the global generators; an iterator that advances gives the two
runs different data). Keep torch_ext calls (``torch_ext.backward``, priorities) out of it: the stock
run sends them to stock's engine. Generators you created yourself (``torch.Generator()``) are not
snapshotted. The engine is wrapped process-wide: do not train on other threads meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import random
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from torch.autograd.variable import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from torch_ext import engine as _engine
from torch_ext.collectives import collective_role
from torch_ext.tracing import trace

ENGINES = ("stock", "torch_ext")
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# Node._sequence_nr() of a node without one (AccumulateGrad) is UINT64_MAX; the trace's is -1.
_NO_SEQUENCE_NR = 2**63
# How many differences summary() lists, and how many nodes of an order it prints.
_LISTED_DIFFERENCES = 10
_LISTED_NODES = 12
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def verify(
    step: Callable[[], Any],
    *,
    steps: int = 1,
    models: Iterable[torch.nn.Module] | dict[str, torch.nn.Module] | None = None,
    optimizers: Iterable[torch.optim.Optimizer] | dict[str, torch.optim.Optimizer] | None = None,
    stateful: Iterable[Any] = (),
    group: Any = None,
) -> VerifyReport:
    """Runs ``step`` ``steps`` times on stock PyTorch and on torch_ext from the same state and compares
    every gradient and every parameter bit for bit (how: the module docstring and the guide "Verifying a step").

    ``models``, ``optimizers``: what to snapshot and compare (parameters, buffers, gradients; optimizer
    state), a list or a dict whose keys prefix the names in the report (a single model's names are its
    own); when None, the modules (optimizers) the step refers to. ``stateful``: more objects with
    ``state_dict()``/``load_state_dict()`` (an LR scheduler, a ``GradScaler``) to snapshot and restore.
    Under ``torch.distributed`` every rank of ``group`` (default: the world) must call it, each with its
    own step; the ranks then agree on :attr:`VerifyReport.ranks_identical`.

    On return, the models, optimizers, ``stateful`` objects and random generators are as they were
    before the call: the snapshot is restored, also when the step raises.
    """
    return _verify(step, steps, models, optimizers, stateful, group, restore_rng=True)


def _verify(step, steps, models, optimizers, stateful, group, restore_rng: bool) -> VerifyReport:
    """:func:`verify`; ``restore_rng=False`` runs torch_ext from wherever stock left the generators (to show
    that the snapshot of the generators is needed)."""
    _check_step(step)
    if steps < 1:
        raise ValueError(f"torch_ext.verify: steps must be at least 1, got {steps}")
    notes: list[str] = []
    if models is None or optimizers is None:
        found_models, found_optimizers = _referenced_state(step)
        if models is None:
            models = found_models
            if found_models:
                notes.append(f"models found in the step's references: {', '.join(found_models)}")
        if optimizers is None:
            optimizers = found_optimizers
            if found_optimizers:
                notes.append(f"optimizers found in the step's references: {', '.join(found_optimizers)}")
    snapshot = _Snapshot(_named(models, "models"), _named(optimizers, "optimizers"), list(stateful))
    session = _Session(snapshot)
    try:
        with session.installed():
            session.run("stock", step, steps)
            snapshot.restore(rng=restore_rng)
            session.run("torch_ext", step, steps)
    finally:
        snapshot.restore(rng=True)
    notes += snapshot.discovery_notes() + session.notes
    report = VerifyReport(
        steps=steps,
        identical=not session.differences,
        differences=session.differences,
        backward=session.backward_runs,
        compared=session.compared,
        notes=notes,
    )
    _agree_across_ranks(report, group)
    return report


def _check_step(step: Any) -> None:
    """A TypeError, naming what verify expects, unless ``step`` can be called with no arguments."""
    if not callable(step):
        got = "None" if step is None else f"a {type(step).__name__}"
        raise TypeError(
            f"torch_ext.verify: step must be the training step, a callable that takes no arguments; got {got}"
        )
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself will tell
        return
    try:
        signature.bind()
    except TypeError as error:
        raise TypeError(
            f"torch_ext.verify: step must take no arguments, but {getattr(step, '__qualname__', step)!r} has the "
            f"signature {signature} ({error}); wrap it, for instance functools.partial(step, batch)"
        ) from None


# --- what to snapshot ----------------------------------------------------------------------------


def _named(objects, label: str) -> dict[str, Any]:
    """``{name: object}``: the names a dict already has, else ``label[i]`` (the bare name for a single one)."""
    if isinstance(objects, dict):
        return dict(objects)
    # One model or optimizer given without a list (a Sequential is iterable: over its children).
    objects = [objects] if isinstance(objects, (torch.nn.Module, torch.optim.Optimizer)) else list(objects)
    if len(objects) == 1:
        return {"": objects[0]}
    return {f"{label}[{index}]": value for index, value in enumerate(objects)}


def _referenced_state(step) -> tuple[dict[str, torch.nn.Module], dict[str, torch.optim.Optimizer]]:
    """The modules and optimizers ``step`` refers to by name, outermost modules only."""
    referenced: dict[str, Any] = {}
    function = step
    while isinstance(function, functools.partial):
        referenced |= {f"partial argument {i}": value for i, value in enumerate(function.args)}
        referenced |= function.keywords
        function = function.func
    if inspect.ismethod(function):
        referenced |= {f"self.{name}": value for name, value in vars(function.__self__).items()}
        referenced["self"] = function.__self__
        function = function.__func__
    elif not inspect.isfunction(function) and hasattr(function, "__dict__"):
        referenced |= {f"self.{name}": value for name, value in vars(function).items()}
        function = type(function).__call__
    if inspect.isfunction(function):
        closure = inspect.getclosurevars(function)
        referenced |= closure.nonlocals | closure.globals
    modules = {name: value for name, value in referenced.items() if isinstance(value, torch.nn.Module)}
    inner = {id(sub) for module in modules.values() for sub in module.modules() if sub is not module}
    modules = {name: module for name, module in modules.items() if id(module) not in inner}
    unique_modules = {}
    for name, module in modules.items():
        if all(module is not seen for seen in unique_modules.values()):
            unique_modules[name] = module
    optimizers = {}
    for name, value in referenced.items():
        if isinstance(value, torch.optim.Optimizer) and all(value is not seen for seen in optimizers.values()):
            optimizers[name] = value
    return unique_modules, optimizers


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else _local(tensor).detach().clone()


@dataclasses.dataclass
class _Tracked:
    name: str
    live: torch.Tensor
    saved: torch.Tensor
    # Only for parameters (tensors whose .grad is compared): the .grad at snapshot time.
    is_parameter: bool
    saved_grad: torch.Tensor | None = None


class _Snapshot:
    """The state verify restores between and after the runs; things found while the step runs are added."""

    def __init__(self, models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer], stateful):
        self.tracked: dict[int, _Tracked] = {}
        self.found_leaves = 0
        self.optimizers: dict[int, tuple[str, torch.optim.Optimizer, dict]] = {}
        self.found_optimizers: list[str] = []
        self.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in stateful]
        self.rng = _RngState.capture()
        for prefix, model in models.items():
            self._add_model(model, f"{prefix}." if prefix else "")
        for name, optimizer in optimizers.items():
            self.add_optimizer(optimizer, name or "optimizer")

    def _add_model(self, model: torch.nn.Module, prefix: str) -> None:
        for name, param in model.named_parameters():
            self.add_tensor(param, prefix + name, is_parameter=True)
        for name, buffer in model.named_buffers():
            self.add_tensor(buffer, prefix + name, is_parameter=False)
        # TorchRec's sharded tables: their local shards, which the fused optimizer updates in backward.
        for name, value in model.state_dict(keep_vars=True).items():
            for index, shard in enumerate(getattr(value, "local_shards", list)()):
                self.add_tensor(shard.tensor, f"{prefix}{name} (local shard {index})", is_parameter=False)

    def add_tensor(self, tensor: torch.Tensor, name: str, is_parameter: bool) -> None:
        if id(tensor) in self.tracked:
            return
        self.tracked[id(tensor)] = _Tracked(
            name, tensor, _clone(tensor), is_parameter, _clone(tensor.grad) if is_parameter else None
        )

    def add_leaf(self, leaf: torch.Tensor) -> None:
        """A leaf the step's backward accumulates into that no model holds: snapshotted before accumulation."""
        if id(leaf) not in self.tracked:
            self.found_leaves += 1
            name = f"<leaf {self.found_leaves}: {_kind(leaf)}"
            # Such as the flat weights of TorchRec's fused tables, whose per-table views a model names.
            storage = _local(leaf).untyped_storage().data_ptr()
            owner = next(
                (
                    t.name
                    for t in self.tracked.values()
                    if storage and _local(t.live).untyped_storage().data_ptr() == storage
                ),
                None,
            )
            self.add_tensor(leaf, name + (f", the storage of {owner}>" if owner else ">"), is_parameter=True)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, name: str | None = None) -> None:
        if id(optimizer) in self.optimizers:
            return
        if name is None:
            name = f"<optimizer {len(self.found_optimizers) + 1}: {type(optimizer).__name__}>"
            self.found_optimizers.append(name)
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.add_leaf(param)
        self.optimizers[id(optimizer)] = (name, optimizer, copy.deepcopy(optimizer.state_dict()))

    def parameters(self) -> list[_Tracked]:
        return [tracked for tracked in self.tracked.values() if tracked.is_parameter]

    def name_of(self, tensor: torch.Tensor) -> str:
        tracked = self.tracked.get(id(tensor))
        return tracked.name if tracked is not None else f"<untracked {list(tensor.shape)}>"

    def restore(self, rng: bool) -> None:
        with torch.no_grad():
            for tracked in self.tracked.values():
                _local(tracked.live).copy_(tracked.saved)
                if tracked.is_parameter:
                    _restore_grad(tracked.live, tracked.saved_grad)
        for _, optimizer, state in self.optimizers.values():
            optimizer.load_state_dict(copy.deepcopy(state))
        for obj, state in self.stateful:
            obj.load_state_dict(copy.deepcopy(state))
        if rng:
            self.rng.restore()

    def discovery_notes(self) -> list[str]:
        notes = []
        if self.found_leaves:
            notes.append(
                f"{self.found_leaves} leaf tensor(s) received gradients without being in models=: "
                "snapshotted on first use, named <leaf k>"
            )
        if self.found_optimizers:
            notes.append(f"optimizer(s) not in optimizers= snapshotted on their first step: {self.found_optimizers}")
        return notes


def _restore_grad(param: torch.Tensor, saved: torch.Tensor | None) -> None:
    # In place where the shapes allow: DDP's gradient_as_bucket_view makes .grad a view of its bucket.
    if saved is None:
        param.grad = None
    elif param.grad is not None and _local(param.grad).shape == saved.shape and not param.grad.is_sparse:
        _local(param.grad).copy_(saved)
    else:
        param.grad = saved.clone()


@dataclasses.dataclass
class _RngState:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: tuple
    numpy: tuple | None

    @classmethod
    def capture(cls) -> _RngState:
        numpy = sys.modules.get("numpy")
        return cls(
            cpu=torch.get_rng_state(),
            # Only once initialized: reading CUDA's generators would initialize it.
            cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            python=random.getstate(),
            numpy=numpy.random.get_state() if numpy is not None else None,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


# --- the graph of one backward call ----------------------------------------------------------------


@dataclasses.dataclass
class _Graph:
    """A backward call's graph, walked from its roots before the engine runs."""

    nodes: list[Any]
    position: dict[Any, int]
    # id(leaf) -> the nodes whose outputs feed its AccumulateGrad.
    producers: dict[int, list[Any]]
    leaves: list[torch.Tensor]
    # Collective nodes (torch_ext.collective_role) -> role; a launch -> its paired wait node.
    roles: dict[Any, str]
    wait_of: dict[Any, Any]

    def label(self, node) -> str:
        return _label(node.name(), self.position.get(node), _has_sequence_nr(node._sequence_nr()))

    def describe(self, node) -> str:
        sequence_nr = node._sequence_nr()
        return node.name() + (f" (sequence_nr {sequence_nr})" if _has_sequence_nr(sequence_nr) else "")


def _has_sequence_nr(sequence_nr: int) -> bool:
    return 0 <= sequence_nr < _NO_SEQUENCE_NR


def _label(name: str, position: int | None, numbered: bool) -> str:
    return f"{name} #{position}" if numbered and position is not None else name


def _walk(roots: Sequence[Any]) -> _Graph:
    starts = []
    for root in roots:
        node = root.node if isinstance(root, torch.autograd.graph.GradientEdge) else root.grad_fn
        if node is not None:
            starts.append(node)
    nodes, position, stack = [], {}, list(reversed(starts))
    producers: dict[int, list[Any]] = {}
    leaves: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if node in position:
            continue
        position[node] = len(nodes)
        nodes.append(node)
        if node.name() == _ACCUMULATE_GRAD:
            leaves.append(node.variable)
            continue
        for next_node, _ in reversed(node.next_functions):
            if next_node is None:
                continue
            if next_node.name() == _ACCUMULATE_GRAD:
                edges = producers.setdefault(id(next_node.variable), [])
                if node not in edges:
                    edges.append(node)
            if next_node not in position:
                stack.append(next_node)
    # Only Python Function nodes can be collectives (collective_role says None for C++ nodes, and raises for
    # a C++ node type that torch.autograd.graph.Node does not register, such as CppFunction).
    python_nodes = (node for node in nodes if isinstance(node, torch._C._FunctionBase))
    roles = {node: role for node in python_nodes if (role := collective_role(node)) is not None}
    waits = {node for node, role in roles.items() if role == "wait"}
    wait_of = {}
    for node, role in roles.items():
        if role in ("launch", "lane") and waits and (wait := _nearest(node, waits)) is not None:
            wait_of[node] = wait
    return _Graph(nodes, position, producers, leaves, roles, wait_of)


def _nearest(start, targets: set) -> Any | None:
    """The first of ``targets`` a breadth-first walk down from ``start`` meets (a Req/Wait pair's wait)."""
    frontier, seen = [start], {start}
    while frontier:
        following = []
        for node in frontier:
            for next_node, _ in node.next_functions:
                if next_node is None or next_node in seen:
                    continue
                if next_node in targets:
                    return next_node
                seen.add(next_node)
                following.append(next_node)
        frontier = following
    return None


# --- running the step on each engine -------------------------------------------------------------


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
        accumulation_order = [id(node.variable) for node, _ in ran if node.name() == _ACCUMULATE_GRAD]
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


def _from_trace(graph: _Graph, events: list[dict]) -> tuple[tuple[str, ...] | None, tuple[Collective, ...]]:
    """The order and collectives of the outermost call in a torch_ext trace (None if it has no call)."""
    calls = [event for event in events if event["kind"] == "backward"]
    if not calls:
        return None, ()
    call = calls[0]
    start = call["start_ns"]
    mine = [event for event in events if event["backward_id"] == call["backward_id"]]
    node_of = {(node.name(), node._sequence_nr()): node for node in graph.nodes}
    labels, collectives = [], []
    event_of_node = {}
    for event in mine:
        if event["kind"] != "node":
            continue
        node = node_of.get((event["name"], event["sequence_nr"])) if event["sequence_nr"] >= 0 else None
        labels.append(graph.label(node) if node is not None else event["name"])
        if node is not None:
            event_of_node[node] = event
    for event in mine:
        if event["kind"] != "node":
            continue
        node = node_of.get((event["name"], event["sequence_nr"])) if event["sequence_nr"] >= 0 else None
        role = graph.roles.get(node) if node is not None else None
        if not event["collective"] and role not in ("launch", "lane"):
            continue
        waits = [
            (wait["name"], _ms(wait["start_ns"] - start), _ms(wait["end_ns"] - start))
            for wait in mine
            if wait["kind"] == "collective_wait" and wait["wait_for"] == event["id"]
        ]
        paired = graph.wait_of.get(node)
        if paired in event_of_node:
            wait = event_of_node[paired]
            waits.append((graph.label(paired), _ms(wait["start_ns"] - start), _ms(wait["end_ns"] - start)))
        collectives.append(
            Collective(
                graph.label(node) if node is not None else event["name"],
                role or "launch",
                _ms(event["start_ns"] - start),
                _ms(event["end_ns"] - start),
                tuple(waits),
                beside_engine=event["thread"] != call["thread"],
            )
        )
    return tuple(labels), tuple(collectives)


def _ms(ns: int) -> float:
    return ns / 1e6


# --- comparing -----------------------------------------------------------------------------------


def _values(returned: Any) -> list[Any]:
    """The tensors and numbers in what the step returned."""
    return [value for value in tree_leaves(returned) if isinstance(value, (torch.Tensor, int, float, complex, bool))]


def _compare_values(stock: Any, ours: Any, missing_on_stock: bool = False) -> str | None:
    """None when ``stock`` and ``ours`` have the same bits; else what differs, in words."""
    if missing_on_stock:
        return "not seen on stock's run"
    if not isinstance(stock, torch.Tensor) or not isinstance(ours, torch.Tensor):
        if isinstance(stock, torch.Tensor) or isinstance(ours, torch.Tensor):
            return f"stock {_kind(stock)}, torch_ext {_kind(ours)}"
        both_nan = isinstance(stock, float) and isinstance(ours, float) and math.isnan(stock) and math.isnan(ours)
        same = both_nan or stock == ours
        return None if same else f"stock {stock!r}, torch_ext {ours!r}"
    if (stock.dtype, stock.shape, stock.layout) != (ours.dtype, ours.shape, ours.layout):
        return f"stock {_kind(stock)}, torch_ext {_kind(ours)}"
    if stock.is_sparse:
        stock, ours = stock.coalesce(), ours.coalesce()
        if not torch.equal(stock.indices(), ours.indices()):
            return "the sparse gradients' indices differ"
        stock, ours = stock.values(), ours.values()
    stock_bits, our_bits = _bits(stock), _bits(ours)
    if torch.equal(stock_bits, our_bits):
        return None
    differing = int((stock_bits != our_bits).sum())
    detail = f"{differing} of {stock_bits.numel()} elements differ"
    if stock.is_floating_point() or stock.is_complex():
        gap = (stock.to(torch.complex128 if stock.is_complex() else torch.float64) - ours).abs()
        gap = gap[~gap.isnan()]
        if gap.numel():
            detail += f", max abs diff {gap.max().item():.3g}"
    return detail


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width: bitwise equality, NaN included."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return tensor.view(_INT_OF_WIDTH[tensor.element_size()])
    return tensor


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return "None" if value is None else type(value).__name__


# --- the report ----------------------------------------------------------------------------------


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


def _agree_across_ranks(report: VerifyReport, group: Any) -> None:
    """Under torch.distributed: every rank's ``identical``, on every rank of ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    identical: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identical, report.identical, group=group)
    report.rank = dist.get_rank(group)
    report.ranks_identical = [bool(value) for value in identical]


# --- python -m torch_ext verify ------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The options of ``python -m torch_ext verify``."""
    parser.add_argument(
        "target",
        metavar="module:function",
        help="the training step: a function of an importable module (or of a .py file given by path) that takes "
        "no arguments; with --factory, a function that builds the step",
    )
    parser.add_argument(
        "--factory",
        action="store_true",
        help="call the function once to build the step: it returns the step, (step, models), "
        "(step, models, optimizers) or a dict of verify()'s keywords",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps to run on each engine (default: the factory's, else 1)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="every difference and each backward call's whole node order"
    )


def run_command(args) -> int:
    """``python -m torch_ext verify``: 0 when every rank's step is identical on both engines, 1 when not."""
    import torch.distributed as dist

    # Under torchrun: the process group, before the module's import (which may build a sharded model).
    started_group = False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group()
        started_group = True
    try:
        kwargs = _target(args.target, args.factory)
        if args.steps is not None:
            kwargs["steps"] = args.steps
        report = verify(**kwargs)
        summary = report.summary(verbose=args.verbose)
        if dist.is_initialized():
            # Rank 0 prints its report and every different rank's; of another identical rank, its verdict.
            if report.identical and dist.get_rank() != 0:
                summary = summary.splitlines()[0]
            summaries: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(summaries, summary)
            if dist.get_rank() == 0:
                print("\n".join(f"rank {rank}: {text}" for rank, text in enumerate(summaries)))
        else:
            print(summary)
        return 0 if report.all_ranks_identical else 1
    finally:
        if started_group:
            dist.destroy_process_group()


def _usage_error(message: str) -> NoReturn:
    """Ends ``python -m torch_ext verify`` as argparse ends on a bad argument: one line on stderr, exit status 2
    (1 means "different")."""
    print(f"python -m torch_ext verify: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _target(target: str, factory: bool) -> dict[str, Any]:
    """verify()'s keywords from ``module:function``."""
    module_name, separator, function_name = target.rpartition(":")
    if not separator or not module_name or not function_name:
        _usage_error(f"expected module:function, got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            _usage_error(f"no such file: {module_name!r}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0], module_name)
        if spec is None or spec.loader is None:
            _usage_error(f"cannot load {module_name!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # The module itself, or a package above it, is missing. A module missing inside it keeps its traceback.
            if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
                raise
            _usage_error(
                f"no module named {error.name!r} (importable from {os.getcwd()!r} or sys.path; "
                "or give the path of a .py file, path/to/file.py:function)"
            )
    function = getattr(module, function_name, None)
    if not callable(function):
        _usage_error(f"{module_name} has no function {function_name!r}")
    if not factory:
        return {"step": function}
    built = function()
    if isinstance(built, dict):
        return dict(built)
    if callable(built):
        return {"step": built}
    if isinstance(built, tuple) and 1 <= len(built) <= 3 and callable(built[0]):
        return dict(zip(("step", "models", "optimizers"), built, strict=False))
    _usage_error(
        f"{target} returned {type(built).__name__}; a factory returns the step, "
        "(step, models), (step, models, optimizers) or a dict of verify()'s keywords"
    )


class _CallableModule(types.ModuleType):
    """``torch_ext.verify`` is this module, and calling it calls :func:`verify`: both ``torch_ext.verify(step)`` and
    ``torch_ext.verify.VerifyReport`` work (a function bound to that name would hide the module's classes)."""

    def __call__(self, *args, **kwargs) -> VerifyReport:
        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
