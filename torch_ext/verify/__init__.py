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

Compared bit for bit by the rule of :mod:`torch_ext.testing`, the one torch_ext's tests hold the engine
to (floating-point values by their bits, so -0.0 differs from 0.0, except that a NaN equals any NaN
whatever its payload and sign: why, at ``torch_ext.testing._elements_differ``): the gradients after each backward call,
every snapshotted tensor and every optimizer's state after each step, and the step's return value
(tensors and numbers in it, such as the loss). The first difference is the earliest in the run: by
step, then by backward call, then, among gradients, the one stock accumulated first (nearest the
loss: the others are downstream of it); then tensors after the step, then the return value.

Requirements on the step: it takes no arguments, and what it computes depends only on the snapshot
(a fixed batch, or a batch drawn from the global generators; an iterator that advances gives the two
runs different data). Keep torch_ext calls (``torch_ext.backward``, priorities) out of it: the stock
run sends them to stock's engine. Generators you created yourself (``torch.Generator()``) are not
snapshotted. The engine is wrapped process-wide: do not train on other threads meanwhile.

The package, one module per job: ``_snapshot`` (the state saved and restored; ``_rng`` its generators),
``_graph`` (a backward call's graph, and torch_ext's trace read against it), ``_session`` (both runs: the engine
wrapper, the records, the differences), ``_compare`` (a value on both engines, through torch_ext.testing),
``_report`` (the classes returned and their text) and ``cli`` (``python -m torch_ext verify``). This module holds
:func:`verify`, which runs them in order, and makes itself callable.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_ext.verify._report import ENGINES, BackwardRun, Collective, Difference, VerifyReport
from torch_ext.verify._session import _Session
from torch_ext.verify._snapshot import _named, _referenced_state, _Snapshot
from torch_ext.verify.cli import add_arguments, run_command

__all__ = [
    "ENGINES",
    "BackwardRun",
    "Collective",
    "Difference",
    "VerifyReport",
    "add_arguments",
    "run_command",
    "verify",
]

# The report's classes keep the name they are documented and pickled by (docs/api.rst: torch_ext.verify.<name>).
for _class in (BackwardRun, Collective, Difference, VerifyReport):
    _class.__module__ = __name__
del _class


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


def _agree_across_ranks(report: VerifyReport, group: Any) -> None:
    """Under torch.distributed: every rank's ``identical``, on every rank of ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    identical: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identical, report.identical, group=group)
    report.rank = dist.get_rank(group)
    report.ranks_identical = [bool(value) for value in identical]


class _CallableModule(types.ModuleType):
    """``torch_ext.verify`` is this module, and calling it calls :func:`verify`: both ``torch_ext.verify(step)`` and
    ``torch_ext.verify.VerifyReport`` work (a function bound to that name would hide the module's classes)."""

    def __call__(self, *args, **kwargs) -> VerifyReport:
        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
