"""Megatron-core, one switch: inside Megatron's own ``forward_backward_no_pipelining``, each microbatch's backward
runs on torch_ext's backward thread while Megatron runs the next microbatch's forward (the overlap of
:func:`torch_ext.overlap_microbatches`), without editing Megatron::

    forward_backward_func = torch_ext.integrations.megatron.overlap_microbatches(get_forward_backward_func())
    losses = forward_backward_func(forward_step_func=..., data_iterator=..., model=model, num_microbatches=8, ...)

Megatron's schedule is not changed. The wrapper enters it through what Megatron hands its user:

- the function ``get_forward_backward_func()`` returns, wrapped: each training call opens an overlap window;
- ``config.no_sync_func``, the model config's context that Megatron runs every microbatch but the last inside
  (Megatron-LM's trainer sets it to DDP's ``no_sync``): for the call, it is Megatron's own ``no_sync`` with the
  window's :meth:`~torch_ext.MicrobatchOverlap.deferring` inside, so that ``backward_step``'s backward is handed
  to the backward thread and returns at once, and Megatron goes on with the next forward;
- the caller's ``forward_step_func``, wrapped to find the last microbatch, the one whose forward Megatron runs after
  leaving ``no_sync``, while the backward before it may still be running.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch_ext.microbatch_overlap import ForwardCollectives, MicrobatchOverlap, _checked_rule
from torch_ext.microbatch_overlap import overlap_microbatches as _open_window

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+

_API = "torch_ext.integrations.megatron.overlap_microbatches"
# The arguments the wrapper reads; a call without them goes to Megatron as it is, for Megatron's own error.
_READ_ARGUMENTS = ("forward_step_func", "model", "num_microbatches")


def overlap_microbatches(
    forward_backward_func: Callable[..., Any],
    *,
    forward_collectives: ForwardCollectives = "after_backward_collectives",
) -> Callable[..., Any]:
    """``forward_backward_func``, Megatron-core's ``forward_backward_no_pipelining`` as
    ``megatron.core.pipeline_parallel.get_forward_backward_func()`` returns it, with each training call's
    microbatches overlapped: microbatch i's backward runs on torch_ext's backward thread, on torch_ext's engine,
    while Megatron runs microbatch i+1's forward. Takes and returns what Megatron's function does; every loss,
    gradient and parameter is the same, bit for bit.

    ``forward_collectives`` is :func:`torch_ext.overlap_microbatches`'s rule for the next forward's collectives
    (``"beside_backward_collectives"`` on gloo for a model whose forward communicates first, as the MoE guide
    measured). For each call with ``forward_only=False`` and two or more microbatches:

    - the model's config must not ask for Megatron's own overlap of microbatches
      (``overlap_moe_expert_parallel_comm``, its combined 1F1B schedule) or for ``hybrid_context_parallel``, whose
      schedules are not the loop this wraps: a ValueError;
    - every microbatch but the last runs inside the config's ``no_sync_func`` (DDP's ``no_sync``; none: nothing),
      its backward handed over. Megatron leaves ``no_sync`` before the last microbatch's forward; the wrapper
      leaves it only once that forward has run and the backward before it has finished, so that no backward hook
      of DDP's sees the last microbatch's state early (with ``overlap_grad_reduce``, it would start the reduction
      of gradients still accumulating, from the backward thread);
    - the last microbatch's backward runs on the caller's thread, as Megatron runs it, with DDP's gradient
      reduction, and ``config.finalize_model_grads_func`` after it: both see finished gradients. The window is
      closed before that backward; a backward's error is raised there, naming its microbatch.

    A call with ``forward_only=True`` or one microbatch goes to Megatron unchanged. Raises ValueError for any
    other schedule: a pipelined one sends each backward's input gradient to the previous stage as soon as it
    returns, which a backward handed to another thread has not computed yet.
    """
    from megatron.core.pipeline_parallel import schedules

    rule = _checked_rule(forward_collectives, _API)
    if forward_backward_func is not schedules.forward_backward_no_pipelining:
        name = getattr(forward_backward_func, "__name__", repr(forward_backward_func))
        raise ValueError(
            f"{_API}: overlaps Megatron-core's forward_backward_no_pipelining only, not {name}: a pipelined "
            "schedule sends each backward's input gradient to the previous stage as soon as backward_step returns, "
            "which a backward handed to another thread has not computed yet"
        )

    @functools.wraps(forward_backward_func)
    def overlapped(*args: Any, **kwargs: Any) -> Any:
        if (
            args
            or any(name not in kwargs for name in _READ_ARGUMENTS)
            or kwargs.get("forward_only", False)
            or kwargs["num_microbatches"] < 2
        ):
            # Nothing to overlap, or a call Megatron refuses with its own error.
            return forward_backward_func(*args, **kwargs)
        call = _OverlappedCall(_checked_config(kwargs["model"]), rule)
        with call:
            kwargs["forward_step_func"] = call.forward_step(kwargs["forward_step_func"])
            return forward_backward_func(**kwargs)

    return overlapped


def _checked_config(model: Any) -> Any:
    """The model's Megatron config, as Megatron's schedule reads it; a ValueError for a schedule this cannot wrap."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0] if isinstance(model, list) else model)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            f"{_API}: config.overlap_moe_expert_parallel_comm is Megatron's own overlap of microbatches (its combined "
            "1F1B schedule, which does not run the loop this wraps): use one or the other"
        )
    if getattr(config, "hybrid_context_parallel", False):
        raise ValueError(f"{_API}: config.hybrid_context_parallel runs a schedule of its own, which this does not wrap")
    return config


class _OverlappedCall:
    """One training call of ``forward_backward_no_pipelining`` with its microbatches overlapped: its window, the
    config's ``no_sync_func`` for the call, and Megatron's own ``no_sync``, held until the last microbatch."""

    def __init__(self, config: Any, rule: ForwardCollectives) -> None:
        self._config = config
        self._rule = rule
        self._megatron_no_sync = config.no_sync_func
        self._window: MicrobatchOverlap | None = None
        # Megatron's no_sync, entered, until the backwards it covers have finished (_leave_megatron_no_sync).
        self._held_no_sync: contextlib.AbstractContextManager | None = None
        self._inside_no_sync = False

    def __enter__(self) -> Self:
        self._window = _open_window(self._rule)
        self._config.no_sync_func = self._no_sync
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if self._window is not None:
                # Megatron raised before the last microbatch: wait for the backward in flight all the same.
                window, self._window = self._window, None
                window.__exit__(exc_type, exc, traceback)
        finally:
            self._config.no_sync_func = self._megatron_no_sync
            self._leave_megatron_no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """The config's ``no_sync_func`` for the call: Megatron's own, entered and held (left by
        :meth:`_close_window`), with the window's ``deferring()`` inside."""
        held = (self._megatron_no_sync or contextlib.nullcontext)()
        held.__enter__()
        self._held_no_sync = held
        self._inside_no_sync = True
        try:
            with self._window.deferring():
                yield
        finally:
            self._inside_no_sync = False

    def forward_step(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func``, closing the window after the last microbatch's forward: the first forward
        Megatron runs after leaving ``no_sync``."""

        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            result = forward_step_func(*args, **kwargs)
            if self._held_no_sync is not None and not self._inside_no_sync:
                self._close_window()
            return result

        return forward_step

    def _close_window(self) -> None:
        """Waits for the last handed-over backward and ends the window (raising that backward's error, if any),
        then leaves Megatron's ``no_sync``: the last microbatch's backward, next, reduces the gradients."""
        window, self._window = self._window, None
        try:
            window.close()
        finally:
            self._leave_megatron_no_sync()

    def _leave_megatron_no_sync(self) -> None:
        held, self._held_no_sync = self._held_no_sync, None
        if held is not None:
            held.__exit__(None, None, None)
