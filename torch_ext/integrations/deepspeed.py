"""DeepSpeed, one switch: with gradient accumulation, each micro-step's ``engine.backward`` runs on torch_ext's
backward thread while the caller's loop runs the next micro-step's forward (the overlap of
:func:`torch_ext.overlap_microbatches`), the loop itself unchanged::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine = torch_ext.integrations.deepspeed.overlap_microbatches(engine)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

DeepSpeed's engine offers no hook around its ``backward``, so the switch wraps what ``deepspeed.initialize`` hands
over, the engine, and nothing of DeepSpeed's is replaced. It runs the MoE guide's recipe for each accumulation
cycle: a window opens at the cycle's first forward; off the accumulation boundary, ``engine.backward(loss)`` and
the ``engine.step()`` after it (which there only counts the micro-step, and that count decides the boundary) are
handed over together with :meth:`~torch_ext.MicrobatchOverlap.backward_by`; at the boundary, the window waits and
closes, and ``engine.backward`` (with its gradient all-reduce) and ``engine.step()`` run on the caller's thread.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from torch_ext.microbatch_overlap import ForwardCollectives, MicrobatchOverlap, _checked_rule
from torch_ext.microbatch_overlap import overlap_microbatches as _open_window

_API = "torch_ext.integrations.deepspeed.overlap_microbatches"


def overlap_microbatches(
    engine: Any, *, forward_collectives: ForwardCollectives = "after_backward_collectives"
) -> OverlappedEngine:
    """``engine``, a ``deepspeed.DeepSpeedEngine`` as ``deepspeed.initialize`` returns it, with each accumulation
    cycle's micro-steps overlapped: an :class:`OverlappedEngine`, used as the engine is (``engine(batch)``,
    ``engine.backward(loss)``, ``engine.step()``, any other attribute). Every loss, gradient and parameter is the
    same as the engine's own loop gives, bit for bit.

    ``forward_collectives`` is :func:`torch_ext.overlap_microbatches`'s rule for the next forward's collectives.
    Off the accumulation boundary ``engine.backward`` and ``engine.step()`` may start only the collectives the
    engine plans (DeepSpeed 0.19.8's ZeRO stage 0 starts none of its own there); any other is refused with a
    RuntimeError on every rank, unless the rule is ``"after_backward"``.

    Raises TypeError for a pipeline engine (``train_batch`` runs its own schedule), and ValueError for an engine
    whose micro-steps this does not know how to hand over: ZeRO stages 1-3 (untested: stages 2 and 3 reduce or
    partition gradients in every micro-step's backward hooks, and stage 3 gathers parameters in forward hooks), and
    ``managed_gradient_accumulation=False`` (``step()`` is then the boundary, called once per cycle).
    """
    rule = _checked_rule(forward_collectives, _API)
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise TypeError(f"{_API}: a PipelineEngine runs its own schedule in train_batch(), which this does not wrap")
    if engine.zero_optimization_stage() != 0:
        raise ValueError(
            f"{_API}: ZeRO stage {engine.zero_optimization_stage()} is not supported (only stage 0 is tested: stages "
            "2 and 3 reduce or partition gradients in every micro-step's backward hooks, stage 3 gathers parameters "
            "in forward hooks)"
        )
    if not getattr(engine, "managed_gradient_accumulation", lambda: True)():
        raise ValueError(
            f"{_API}: managed_gradient_accumulation=False makes step() the accumulation boundary, called once a "
            "cycle: not supported"
        )
    return OverlappedEngine(engine, rule)


class OverlappedEngine:
    """A DeepSpeed engine whose micro-steps' backwards run beside the next micro-step's forward; made by
    :func:`overlap_microbatches`.

    Its loop is DeepSpeed's: ``engine(batch)`` (or ``engine.forward``), then ``engine.backward(loss)``, then
    ``engine.step()``, for every micro-step, on one thread. Off the accumulation boundary ``backward`` returns
    None at once, the micro-step's ``step()`` handed over with it (the ``step()`` call that follows returns None);
    at the boundary both return what the engine's do. A micro-step without ``step()`` is refused with a
    RuntimeError at the next ``backward`` or forward (``set_gradient_accumulation_boundary``'s loop, one
    ``step()`` a cycle, is not supported).

    Every other method of the engine, called through this object (``is_gradient_accumulation_boundary``,
    ``save_checkpoint``, ...), first waits for the backward in flight; so does any ``optimizer.step()``. Other
    attributes (``engine.module``, ``engine.device``) are the engine's, read at once: read gradients only after
    the boundary's ``backward``.
    """

    def __init__(self, engine: Any, rule: ForwardCollectives) -> None:
        self._engine = engine
        self._rule = rule
        self._window: MicrobatchOverlap | None = None
        self._step_handed_over = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward("engine(...)")
        return self._engine(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward("engine.forward(...)")
        return self._engine.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``engine.backward(loss, ...)``: handed over with the micro-step's ``step()`` off the accumulation
        boundary (returns None at once), on this thread at the boundary, once the window has closed."""
        self._check_stepped("engine.backward(...)")
        if self._window is None:
            # A forward that did not come through this object (engine.module(...)): open the window now.
            self._window = _open_window(self._rule)
        # The backward in flight ran the previous micro-step's step(): the engine's micro-step count is current.
        self._wait()
        engine = self._engine
        if engine.is_gradient_accumulation_boundary():
            self._close_window()
            return engine.backward(loss, *args, **kwargs)
        self._window.backward_by(lambda: (engine.backward(loss, *args, **kwargs), engine.step()))
        self._step_handed_over = True
        return None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``engine.step(...)``; None at once after a handed-over ``backward``, which runs the micro-step's
        ``step()`` with it (off the boundary it only counts the micro-step: its arguments are unused)."""
        if self._step_handed_over:
            self._step_handed_over = False
            return None
        self._close_window()
        return self._engine.step(*args, **kwargs)

    def close(self) -> None:
        """Waits for the backward in flight, if any, and ends the cycle's window (raising that backward's error), as
        the boundary's ``backward`` does: for a loop that stops inside an accumulation cycle. Idempotent."""
        self._close_window()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if inspect.ismethod(value) and value.__self__ is self._engine:

            @functools.wraps(value)
            def after_backward(*args: Any, **kwargs: Any) -> Any:
                if self._window is not None:
                    self._wait()
                return value(*args, **kwargs)

            return after_backward
        return value

    def _before_forward(self, api: str) -> None:
        self._check_stepped(api)
        if self._window is None and torch.is_grad_enabled() and self._engine.training:
            # The cycle's first forward: the window watches it too (a forward that saves the RNG state, as an
            # activation checkpoint does, makes the next forward's collectives wait for its whole backward).
            self._window = _open_window(self._rule)

    def _check_stepped(self, api: str) -> None:
        if self._step_handed_over:
            raise RuntimeError(
                f"{_API}: {api} after a micro-step's engine.backward() without engine.step(): the overlapped "
                "engine runs each micro-step's step() with its backward, so the loop must call engine.step() after "
                "every engine.backward(), as DeepSpeed's own loop does"
            )

    def _wait(self) -> None:
        """Waits for the backward in flight; on its error, ends the window, so the next cycle opens a new one."""
        try:
            self._window.wait()
        except BaseException:
            self._close_window()
            raise

    def _close_window(self) -> None:
        window, self._window = self._window, None
        if window is not None:
            window.close()
