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
``_report`` (the classes returned and their text), ``_run`` (:func:`verify`, which runs them in order) and ``cli``
(``python -m torch_ext verify``). This module re-exports them and makes itself callable.
"""

from __future__ import annotations

import sys
import types

from torch_ext.verify._report import ENGINES, BackwardRun, Collective, Difference, VerifyReport
from torch_ext.verify._run import _verify as _verify  # tests run it with restore_rng=False
from torch_ext.verify._run import verify
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

# The report's classes and verify keep the name they are documented and pickled by (docs/api.rst: torch_ext.verify.<name>).
for _public in (BackwardRun, Collective, Difference, VerifyReport, verify):
    _public.__module__ = __name__
del _public


class _CallableModule(types.ModuleType):
    """``torch_ext.verify`` is this module, and calling it calls :func:`verify`: both ``torch_ext.verify(step)`` and
    ``torch_ext.verify.VerifyReport`` work (a function bound to that name would hide the module's classes)."""

    def __call__(self, *args, **kwargs) -> VerifyReport:
        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
