"""Overlap across microbatches: microbatch i's backward runs on a backward thread while the caller's thread runs
microbatch i+1's forward, so the backward's communication hides behind the next forward as well as behind its
own dense path.

A gradient-accumulation loop changes one line::

    with torch_ext.overlap_microbatches() as overlap:
        for batch in batches:
            loss = model(batch) / len(batches)
            overlap.backward(loss)  # was loss.backward(); returns at once
    optimizer.step()  # the block's end waited for the last backward

A library whose backward is more than ``loss.backward()`` (a DeepSpeed engine's ``backward``, with its loss
scaling and micro-step state) hands its whole backward over with :meth:`MicrobatchOverlap.backward_by`, the
step's last microbatch staying on the caller's thread after :meth:`MicrobatchOverlap.wait`, so that the library's
gradient reduction sees finished gradients::

    with torch_ext.overlap_microbatches() as overlap:
        for i, batch in enumerate(batches):
            loss = engine(batch)
            if i + 1 < len(batches):
                overlap.backward_by(lambda loss=loss: (engine.backward(loss), engine.step()))
            else:
                overlap.wait()
                engine.backward(loss)
                engine.step()

Code that only calls ``loss.backward()`` can run inside :meth:`MicrobatchOverlap.deferring` instead.

What is guaranteed, against the same loop run sequentially on stock PyTorch, bit for bit:

- Gradients accumulate in stock's order: at most one backward is in flight, and backward i+1 starts only when
  backward i has finished. Every other backward call made on the caller's thread waits for it too.
- Each backward runs under the thread-local state its caller had when handing it over (grad mode, autocast,
  saved-tensor hooks, modes), as stock's engine carries it to its device threads; hooks run on the backward
  thread, in the order the engine runs them without the overlap (stock's, unless a lane or a priority moves a
  node).
- The collective order, on every process group: backward i's planned collectives, then forward i+1's, then
  backward i+1's, whatever the timing. The forward's collectives (any c10d collective the caller's thread
  starts) wait until backward i has started every collective the engine planned for it. A collective the engine
  did not plan (a hook's, a nested backward's) started while backward i runs is refused with an error on every
  rank, before it starts: DDP's gradient all_reduce belongs in the step's last microbatch, outside the overlap
  or with ``no_sync()`` around the others. With ``forward_collectives="in_turns_with_backward_collectives"`` the
  two threads' collectives take turns instead, the backward's first (its first, the forward's first, its second,
  ...), until one has none left; the backward's collectives then also wait for the forward's, which is why the
  forward signals, at every wait point above, that it issues no more before the backward ends. With
  ``forward_collectives="beside_backward_collectives"`` neither waits: the backward's collectives go to a *twin*
  of their group (a gloo group of the same ranks, ``torch_ext.collectives.twin_groups``), the forward's stay on
  the group, and each group keeps its own thread's order on every rank. gloo groups only.
- RNG: a microbatch whose forward saved the RNG state (every activation checkpoint does, to replay dropout in its
  recompute) makes the next forward's collectives wait for the whole backward (the recompute may issue
  collectives no plan holds), and the backward thread reads or sets the RNG state only while the caller's thread
  is parked in one of the overlap's waits, so the next forward's draws are stock's.
- The points where everything has finished: the block's end, :meth:`MicrobatchOverlap.wait`, any
  ``optimizer.step()`` (a global step pre-hook waits) and any other backward started on the caller's thread.
  Read ``.grad`` (``clip_grad_norm_``, logging) only after one of them.
- An error in the backward is raised in the caller at the next of those points (or by the forward's next
  collective, which is then not started), naming the microbatch; the overlap stays usable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_ext import engine as _engine
from torch_ext._loader import _C

# The rules for the next forward's collectives (a ``forward_collectives`` argument), for typing; their names are
# csrc/engine/collective_progress.h's ForwardCollectives, read from the engine (tests/test_microbatches.py checks
# that the two name the same rules), which parses each hand-over's into the rule it holds.
ForwardCollectives = Literal[
    "after_backward_collectives", "after_backward", "in_turns_with_backward_collectives", "beside_backward_collectives"
]
_FORWARD_COLLECTIVES: tuple[str, ...] = _C._overlap_forward_rules


def _checked_rule(forward_collectives: str, api: str) -> ForwardCollectives:
    """``forward_collectives``, the rule for the next forward's collectives; a ValueError naming ``api`` for an
    unknown one."""
    if forward_collectives not in _FORWARD_COLLECTIVES:
        raise ValueError(
            f"{api}: forward_collectives must be one of {_FORWARD_COLLECTIVES}, not {forward_collectives!r}"
        )
    return forward_collectives


class MicrobatchOverlap:
    """One overlap window; made by :func:`overlap_microbatches`, used as a context manager (or closed with
    :meth:`close`). One per process at a time, on the thread that opened it."""

    def __init__(self, forward_collectives: ForwardCollectives = "after_backward_collectives") -> None:
        self._forward_rule = _checked_rule(forward_collectives, "torch_ext.overlap_microbatches")
        self._forward_thread: threading.Thread | None = None
        self._backward_thread: threading.Thread | None = None
        self._jobs: list[Callable[[], None] | None] = []
        self._jobs_ready = threading.Condition()
        self._in_flight: int | None = None  # the microbatch whose backward runs now, until its wait
        self._error: BaseException | None = None
        self._microbatch = 0
        self._saved_rng_state = False
        self._deferring = 0
        # What _open registered or replaced, each undone by close().
        self._undo: list[Callable[[], None]] = []
        self._closed = False

    # -- the loop's side --------------------------------------------------------------------------------------

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor] | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        *,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
        priorities: dict | None = None,
    ) -> None:
        """``torch.autograd.backward`` (with :func:`torch_ext.backward`'s ``priorities``), handed to the backward
        thread: returns once the previous microbatch's backward has finished and this one has started.

        Raises the previous backward's error, if it failed. A call whose roots need no gradient raises stock's
        error here, at once.
        """
        self._check_open("backward")
        roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if not _all_require_grad(roots):
            # Stock's error, now and on this thread.
            torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)
            return

        def run(handed: _C.HandedBackward) -> None:
            with _engine._routed(priorities, "MicrobatchOverlap.backward", handed):
                _engine._STOCK_BACKWARD(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)

        self._hand_over(run, self._forward_rule)

    def backward_by(
        self, backward: Callable[[], object], *, forward_collectives: ForwardCollectives | None = None
    ) -> None:
        """Hands ``backward``, a callable that runs one backward (a library's ``engine.backward(loss)`` with its
        bookkeeping, a pipeline stage's ``backward_one_chunk``), to the backward thread, as :meth:`backward` does
        with one ``torch.autograd.backward`` call. Its first backward call runs on torch_ext's engine.

        ``forward_collectives``, when the next forward's collectives may start, defaults to the window's rule
        (:func:`overlap_microbatches`'s), as for :meth:`backward`. The engine plans only that first call's
        collectives, and the rest of ``backward`` may issue others: under ``"after_backward_collectives"`` (the
        window's default) or ``"in_turns_with_backward_collectives"``, any other collective ``backward`` starts
        before it returns is refused with a RuntimeError on every rank. That suits code that issues none until
        the step's last microbatch (DeepSpeed's ``engine.backward`` and ``engine.step`` off the accumulation
        boundary); for code that does, pass ``forward_collectives="after_backward"`` (or open the window with
        it), and the next forward's collectives wait for the whole of ``backward``. What ``backward`` returns is
        dropped; what it raises is raised at the next wait point.
        """
        self._check_open("backward_by")
        rule = (
            self._forward_rule
            if forward_collectives is None
            else _checked_rule(forward_collectives, "torch_ext: MicrobatchOverlap.backward_by")
        )

        def run(handed: _C.HandedBackward) -> None:
            with _engine._routed(None, "MicrobatchOverlap.backward_by", handed):
                backward()

        self._hand_over(run, rule)

    def _hand_over(self, run: Callable[[_C.HandedBackward], object], rule: ForwardCollectives) -> None:
        """Waits for the backward in flight, then starts ``run(handed)`` on the backward thread under this thread's
        thread-local state and numerics (its intra-op thread counts and floating-point controls, taken now, so a
        ``torch.set_num_threads`` between steps reaches the next backward), the next forward's collectives
        starting by ``rule``. ``handed`` is the window's record of this backward, for the context of the engine
        call ``run`` makes: that call reports its collectives to the window, and the order check compares its
        microbatch and rule."""
        self.wait()
        microbatch = self._microbatch
        self._microbatch += 1
        # A forward that saved the RNG state may recompute, with collectives no plan holds.
        if self._saved_rng_state:
            rule = "after_backward"
        self._saved_rng_state = False
        state = _C._capture_thread_state()
        stream = _current_accelerator_stream()
        handed = _C._overlap_hand_over(microbatch, rule)
        self._in_flight = microbatch

        def job() -> None:
            if stream is not None:
                # Streams are not part of the thread-local state: the caller's current stream becomes the
                # backward thread's, so that backward ends by making it wait for the leaf streams (stock's rule:
                # .grad is ready on the caller's current stream).
                torch.accelerator.set_stream(stream)
            _C._run_in_thread_state(state, lambda: run(handed))

        with self._jobs_ready:
            self._jobs.append(job)
            self._jobs_ready.notify()

    def wait(self) -> None:
        """Blocks until the backward in flight, if any, has finished; raises its error if it failed. Ctrl-C ends
        the wait (the backward itself finishes on its thread)."""
        self._check_open("wait")
        if self._in_flight is None:
            return
        _C._overlap_wait()
        self._in_flight = None
        self._raise_backward_error()

    def deferring(self, enabled: bool = True) -> _Deferring:
        """A block in which a backward this thread starts (``loss.backward()``, ``torch.autograd.backward``,
        ``torch_ext.backward``) is handed over as by :meth:`backward`, returning at once, once
        ``torch.autograd.backward`` has checked its arguments and made the implicit gradients. For libraries that
        call backward themselves; with ``enabled=False`` (the step's last microbatch) the block changes
        nothing."""
        self._check_open("deferring")
        return _Deferring(self, enabled)

    def close(self) -> None:
        """Waits for the last backward, stops the backward thread and ends the window; raises the last backward's
        error, if any. Idempotent."""
        if self._closed:
            return
        self._wait_and_shut_down()
        self._raise_backward_error()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is None:
            self.close()
            return
        # Already raising: wait for the backward all the same, so that no thread is left behind, and keep the
        # caller's exception, with the backward's error, if any, as a note.
        self._wait_and_shut_down()
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(exc, _C.ForwardStoppedByBackward):
            # The forward stopped at a collective because the backward had failed: the backward's error is the
            # one to see.
            raise error from exc
        exc.add_note(f"and the backward beside it failed: {type(error).__name__}: {error}")

    # -- internals --------------------------------------------------------------------------------------------

    def _open(self) -> None:
        _C._overlap_open()
        self._forward_thread = threading.current_thread()
        try:
            self._register_hooks()
            self._replace_rng_state_functions()
        except BaseException:
            self._undo_registrations()
            _C._overlap_close()
            raise
        self._backward_thread = threading.Thread(
            target=self._backward_thread_main, name="torch_ext-microbatch-backward", daemon=True
        )
        self._backward_thread.start()

    def _wait_and_shut_down(self) -> None:
        try:
            if self._in_flight is not None:
                _C._overlap_wait()
                self._in_flight = None
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        self._closed = True
        with self._jobs_ready:
            self._jobs.append(None)
            self._jobs_ready.notify()
        if self._backward_thread is not None:
            self._backward_thread.join()
        self._undo_registrations()
        _C._overlap_close()

    def _undo_registrations(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _check_open(self, api: str) -> None:
        if self._closed:
            raise RuntimeError(f"torch_ext: MicrobatchOverlap.{api}() called after the overlap was closed")
        if threading.current_thread() is not self._forward_thread:
            raise RuntimeError(
                f"torch_ext: MicrobatchOverlap.{api}() must be called on the thread that opened the overlap "
                f"({self._forward_thread.name if self._forward_thread else None})"
            )

    def _raise_backward_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _backward_thread_main(self) -> None:
        while True:
            with self._jobs_ready:
                while not self._jobs:
                    self._jobs_ready.wait()
                job = self._jobs.pop(0)
            if job is None:
                return
            error: BaseException | None = None
            try:
                job()
            except BaseException as raised:  # noqa: BLE001 - handed to the caller's thread
                error = raised
                raised.add_note(
                    f"raised by the backward of microbatch {self._in_flight}, on torch_ext's microbatch backward "
                    "thread (torch_ext.overlap_microbatches)"
                )
            finally:
                del job
                _rng_section.reset()
            self._error = error
            _C._overlap_finish(None if error is None else f"{type(error).__name__}: {error}")

    # -- what runs on other code's calls ----------------------------------------------------------------------

    def _register_hooks(self) -> None:
        # Every backward this thread starts waits for the one in flight (stock's accumulation order), or, inside
        # deferring(), is handed over.
        self._undo.append(_engine._register_backward_entry_hook(self._on_backward_entry).remove)
        # optimizer.step() reads .grad.
        self._undo.append(register_optimizer_step_pre_hook(lambda *_: self._wait_on_forward_thread()).remove)

    def _on_backward_entry(self, call: _engine._EngineCall) -> bool:
        """The backward-entry hook: on this window's thread, a backward() call inside deferring() is handed over
        as :meth:`backward` hands one (True: taken), and any other call waits for the backward in flight."""
        if threading.current_thread() is not self._forward_thread:
            return False
        # A call whose roots need no gradient goes on, to stock's error, here and now.
        if self._deferring and call.accumulates_grad and _all_require_grad(call.roots):
            self._hand_over(call.run_on_torch_ext, self._forward_rule)
            return True
        self._wait_on_forward_thread()
        return False

    def _wait_on_forward_thread(self) -> None:
        if threading.current_thread() is self._forward_thread and self._in_flight is not None:
            self.wait()

    def _replace_rng_state_functions(self) -> None:
        """What the window still replaces, for its whole life: torch's RNG state getters and setters
        (``get_rng_state`` and ``set_rng_state`` of ``torch``, ``torch.random`` and, with an accelerator, its device
        module: ``torch.cuda`` on CUDA),
        each acting only for this window's threads; docs/guides/moe.md lists them.

        Activation checkpointing (torch's, Megatron's, DeepSpeed's) reads and sets the generator's state through
        these functions, looked up by name at each call, and nothing narrower sees it: the generator's
        ``get_state`` and ``set_state`` are C++ methods, with no hook. Not only while a backward is in flight: a
        read on the forward thread marks its microbatch's backward (below), and forwards run whenever the window
        is open, the first microbatch's before any backward is in flight.
        """
        forward = self._forward_thread

        def replace(module: Any, name: str, replacement: Callable[..., Any]) -> None:
            original = getattr(module, name)
            setattr(module, name, replacement(original))
            self._undo.append(lambda: setattr(module, name, original))

        # A forward that saves the RNG state (activation checkpointing) may recompute, with collectives no plan
        # holds: the next forward waits for the whole backward. On a backward-side thread, reading or setting the
        # state is an RNG section (_RngSections).
        def sectioned_get_rng_state(original, generator):
            def get_rng_state(*args, **kwargs):
                if threading.current_thread() is forward:
                    self._saved_rng_state = True
                    return original(*args, **kwargs)
                return _rng_section.get(generator, original, args, kwargs)

            return get_rng_state

        def sectioned_set_rng_state(original, generator, getter):
            def set_rng_state(new_state, *args, **kwargs):
                if threading.current_thread() is forward:
                    return original(new_state, *args, **kwargs)
                return _rng_section.set(generator, original, getter, new_state, args, kwargs)

            return set_rng_state

        cpu_get = torch.random.get_rng_state
        for module in (torch, torch.random):
            replace(module, "get_rng_state", lambda original: sectioned_get_rng_state(original, "cpu"))
            replace(module, "set_rng_state", lambda original: sectioned_set_rng_state(original, "cpu", cpu_get))
        # The accelerator's generators through its device module (torch.cuda on CUDA), where checkpointing
        # reads them: torch.utils.checkpoint asks torch.get_device_module, Megatron and DeepSpeed torch.cuda.
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is not None:
            device_module = torch.get_device_module(accelerator)
            device_get = device_module.get_rng_state
            replace(
                device_module,
                "get_rng_state",
                lambda original: sectioned_get_rng_state(original, accelerator.type),
            )
            replace(
                device_module,
                "set_rng_state",
                lambda original: sectioned_set_rng_state(original, accelerator.type, device_get),
            )


def _all_require_grad(roots: tuple) -> bool:
    return not any(isinstance(root, torch.Tensor) and not root.requires_grad for root in roots)


class _Deferring:
    __slots__ = ("_enabled", "_overlap")

    def __init__(self, overlap: MicrobatchOverlap, enabled: bool) -> None:
        self._overlap = overlap
        self._enabled = bool(enabled)

    def __enter__(self) -> None:
        if self._enabled:
            self._overlap._deferring += 1

    def __exit__(self, *exc_info) -> None:
        if self._enabled:
            self._overlap._deferring -= 1


class _RngSections(threading.local):
    """A backward-side thread's RNG section: from its first read or set of the RNG state while an overlap runs
    until it has set every generator it touched back to the state it first found (a checkpoint's recompute under
    ``fork_rng``: read, set to forward's state, run, set back), while the forward thread is parked. Ends with the
    backward at the latest."""

    def __init__(self) -> None:
        self.found: dict[str, torch.Tensor] | None = None
        self.restored: set[str] = set()

    def _enter(self) -> bool:
        if self.found is None:
            if not _C._overlap_enter_rng_section():
                return False
            self.found = {}
            self.restored = set()
        return True

    def get(self, generator: str, original, args, kwargs) -> torch.Tensor:
        if not self._enter():
            return original(*args, **kwargs)
        state = original(*args, **kwargs)
        self.found.setdefault(generator, state)
        return state

    def set(self, generator: str, original, getter, new_state, args, kwargs) -> None:
        if not self._enter():
            return original(new_state, *args, **kwargs)
        if generator not in self.found:
            self.found[generator] = getter(*args, **kwargs)
        result = original(new_state, *args, **kwargs)
        if torch.equal(new_state, self.found[generator]):
            self.restored.add(generator)
        else:
            self.restored.discard(generator)
        if self.restored == set(self.found):
            self.reset()
        return result

    def reset(self) -> None:
        if self.found is not None:
            self.found = None
            _C._overlap_leave_rng_section()


_rng_section = _RngSections()


def _current_accelerator_stream() -> torch.Stream | None:
    """The caller's current stream on its current accelerator device, or None without one."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_stream(torch.accelerator.current_device_index())


def overlap_microbatches(forward_collectives: ForwardCollectives = "after_backward_collectives") -> MicrobatchOverlap:
    """Opens a :class:`MicrobatchOverlap` on this thread: each :meth:`~MicrobatchOverlap.backward` runs on a
    backward thread while this thread goes on with the next microbatch's forward (see the module's text for what
    is guaranteed).

    ``forward_collectives``, when the next forward's collectives may start:

    - ``"after_backward_collectives"`` (the default): once the backward has started every collective the engine
      planned for it.
    - ``"in_turns_with_backward_collectives"``: in turns with those, the backward's first: the forward's k-th once
      the backward has started k, the backward's (k+1)-th once the forward has issued k (or waits for the
      backward to end). The forward's first collective no longer waits for the backward's last, at the cost of
      making the backward's wait for the forward's. On CPU it measured lower exposure than the default, most
      where the compute beside an all_to_all is short (``benchmarks/microbatch_overlap``); on an accelerator
      the engine thread itself waits for the turn, which is unmeasured. Where the engine does not hold the
      backward's collectives to the plan's order (no lane node and no order check), the same as the default.
    - ``"beside_backward_collectives"``: at once. The backward's collectives go to a twin of their group, a gloo
      group of the same ranks made on first use without a hang (``torch_ext.collectives.twin_groups``), so the two
      threads share no communicator and neither waits for the other's collectives. The bytes are the same, and so
      are the bits. gloo groups only: on NCCL two communicators of the same ranks used from two streams can
      deadlock, and a collective on a group of another backend is refused with an error naming the other rules.
    - ``"after_backward"``: once the whole backward has finished, for code whose backward issues collectives the
      engine cannot see.

    The rule holds for every :meth:`~MicrobatchOverlap.backward` and every :meth:`~MicrobatchOverlap.backward_by`
    that passes none of its own.
    """
    overlap = MicrobatchOverlap(forward_collectives)
    overlap._open()
    return overlap
