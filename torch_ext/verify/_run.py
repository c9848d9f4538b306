"""The run of :func:`torch_ext.verify`: both engines' runs of the step in order (``_session``), from one snapshot
(``_snapshot``), and the ranks' agreement. Its own module so that the package's ``__init__`` and ``cli`` both import
it, and neither imports the other."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_ext.verify._report import VerifyReport
from torch_ext.verify._session import _Session
from torch_ext.verify._snapshot import _named, _referenced_state, _Snapshot


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
