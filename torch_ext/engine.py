"""torch_ext's engine behind torch.autograd, and the backward() and grad() routes to it.

``torch_ext.backward`` and ``torch_ext.grad`` are ``torch.autograd.backward`` and ``torch.autograd.grad``
themselves: stock's Python parses and checks the arguments, handles ``__torch_function__``, batches
``is_grads_batched`` with vmap, materializes gradients and logs for ``TORCH_LOGS=autograd``, and ends in
``Variable._execution_engine.run_backward``. Once torch_ext is used, that engine is a router that sends the
call to torch_ext's engine when the calling thread is inside one of these routes or :func:`enable` is on,
and to the engine it replaced otherwise, so other threads and other calls keep stock behaviour.

One exception, for speed: the plain call (``backward(loss)``, ``grad(loss, inputs)`` with a scalar loss
and nothing else given) skips stock's Python where that Python would only make the loss's implicit
gradient and call the engine, and does those two things itself. Any call where stock's Python would do
more (given gradients, ``inputs=``, subclasses and ``__torch_function__`` modes, functorch transforms,
autograd debug logging, compiled autograd, a patched ``torch.autograd.backward``/``grad``, anything it
would raise on) goes through stock's Python as above; so does every call while a backward-entry hook is
registered (an open ``overlap_microbatches`` registers one), so that the hook sees it at the router.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd import graph as autograd_graph
from torch.autograd.variable import Variable
from torch.utils.hooks import RemovableHandle

from torch_ext._api import Undo
from torch_ext._loader import _C
from torch_ext.priority import priority_overrides

# torch.autograd's stock C++ engine. Final callbacks and checkpoint validity are properties of the
# current graph task, which torch_ext's host task makes the stock engine's own, so those calls go to it
# unchanged; so does backward under compiled autograd.
_STOCK_ENGINE = torch._C._ImperativeEngine()
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_is_functional_tensor = torch._is_functional_tensor


def _compiled_autograd_enabled() -> bool:
    # Compiled autograd intercepts Engine::execute and cannot trace the host
    # task's driver node; such backward passes run on the stock engine.
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(compiled_autograd is not None and compiled_autograd.compiled_autograd_enabled)


# What tells a traced call: the dispatch modes on the calling thread (its tracing ones, AOTAutograd's and make_fx's,
# are "infra" modes with keys of their own), and tensor subclasses that exist only while something traces.
_dispatch_mode_stack_length = torch._C._len_torch_dispatch_stack
_current_infra_mode = torch._C._get_dispatch_mode
_TRACING_MODE_KEYS = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)
_TRACING_TENSOR_TYPES = (FakeTensor, FunctionalTensor)


def _is_tracing(tensors) -> bool:
    """Whether a graph over ``tensors`` is being recorded: a fake, proxy or functional dispatch mode (the modes
    AOTAutograd, ``make_fx`` and ``torch.export`` trace with) or a functorch transform is active on the calling
    thread, or one of ``tensors`` is fake or functional. A user's own ``__torch_dispatch__`` mode is not tracing."""
    if _functorch_transforms_active() or any(_current_infra_mode(key) is not None for key in _TRACING_MODE_KEYS):
        return True
    return any(
        isinstance(value, _TRACING_TENSOR_TYPES) or (type(value) is torch.Tensor and _is_functional_tensor(value))
        for value in tensors
    )


def _is_traced(tensors) -> bool:
    """Whether a backward over ``tensors`` (its roots and inputs) is traced, for the engine's routing: it is being
    recorded (:func:`_is_tracing`), or any ``__torch_dispatch__`` mode is active on the calling thread, a user's
    (``FlopCounterMode``) included, which must see every op of the backward on that thread.

    Such a call goes to the stock engine (docs/design.md, "Under tracing, stock's engine"): the modes are state
    of the calling thread and not thread-safe, so a node run on a lane or the overlap's thread escapes them or
    races them, and a traced graph must be the one stock's engine traces.
    """
    return bool(_dispatch_mode_stack_length()) or _is_tracing(tensors)


def _is_traced_call(args: tuple, kwargs: dict) -> bool:
    """:func:`_is_traced` for ``_EngineBase.run_backward``'s arguments."""
    roots = args[0] if args else kwargs.get("tensors", ())
    inputs = args[4] if len(args) > 4 else kwargs.get("inputs")
    return _is_traced((*roots, *(inputs or ())))


_warned_of_compiled_autograd = False


def _warn_once_compiled_autograd_takes_backward() -> None:
    # Once a process: a training loop under compiled autograd would otherwise warn every step.
    global _warned_of_compiled_autograd
    if not _warned_of_compiled_autograd:
        _warned_of_compiled_autograd = True
        warnings.warn(
            "torch_ext: compiled autograd is on, so backward runs on the stock engine, traced by compiled autograd: "
            "torch_ext's priorities, lanes, deferred waits and overlap do not apply to it. Leave compiled autograd off "
            "and compile the model with torch_ext.compile_backend() to keep them (docs/guides/switching-on.md).",
            stacklevel=4,
        )


class _CallContext:
    """What one call of torch_ext's engine is asked for beside ``torch.autograd``'s arguments, passed to the engine
    whole, which holds it as the call's ``CallContext`` (csrc/engine/call_context.h): the call's own priorities
    (``[(node, priority, propagate)]``, :func:`torch_ext.priority.priority_overrides`'s) and, for the backward
    :func:`torch_ext.overlap_microbatches` handed to its backward thread, the window's record of it (a
    ``torch_ext._C.HandedBackward``: its microbatch and the rule for the next forward's collectives), else None."""

    __slots__ = ("handed", "priorities")

    def __init__(self, priorities: list, handed=None) -> None:
        self.priorities = priorities
        self.handed = handed


def _run_on_torch_ext(args: tuple, kwargs: dict, context: _CallContext | None) -> tuple | None:
    """``_EngineBase.run_backward(*args, **kwargs)`` on torch_ext's engine, with the call's context (None: none of
    its own). The caller has sent a traced call (:func:`_is_traced_call`) to the stock engine already: the router
    before its entry hooks (so a call a hook took is not traced either), ``Engine.run_backward`` itself."""
    if _compiled_autograd_enabled():
        if context is not None and context.priorities:
            raise RuntimeError(
                "torch_ext: priorities= cannot apply under compiled autograd, whose backward runs on the stock engine"
            )
        _warn_once_compiled_autograd_takes_backward()
        return _STOCK_ENGINE.run_backward(*args, **kwargs)
    if context is None:
        return _C.run_backward(*args, **kwargs)
    if context.handed is None:  # one keyword fewer to parse on every call but the overlap's
        return _C.run_backward(*args, **kwargs, priorities=context.priorities)
    return _C.run_backward(*args, **kwargs, priorities=context.priorities, handed=context.handed)


class Engine:
    """torch_ext's autograd engine behind the interface of ``torch._C._ImperativeEngine``.

    Backward passes under compiled autograd go to the stock engine: compiled autograd intercepts the
    engine's entry and cannot trace torch_ext's driver node.
    """

    def run_backward(self, *args, priorities=None, **kwargs):
        """``torch._C._EngineBase.run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs=None,
        allow_unreachable=False, accumulate_grad=False)`` on torch_ext's engine.

        ``priorities`` (``{tensor, Node or GradientEdge: int}``) apply to this call only, as for
        :func:`torch_ext.backward`.
        """
        context = _CallContext(priority_overrides(priorities, "Engine.run_backward"))
        if _is_traced_call(args, kwargs):
            return _STOCK_ENGINE.run_backward(*args, **kwargs)  # priorities do not apply to a traced call
        return _run_on_torch_ext(args, kwargs, context)

    def queue_callback(self, callback) -> None:
        """Runs ``callback`` when the current backward pass finishes (as DDP and FSDP do)."""
        return _STOCK_ENGINE.queue_callback(callback)

    def is_checkpoint_valid(self) -> bool:
        return _STOCK_ENGINE.is_checkpoint_valid()


class _EngineCall:
    """One call of ``run_backward`` that reached the router, as ``torch.autograd.backward`` or ``grad`` made it
    (the roots, their gradients, keep_graph, create_graph, inputs, ...), with the context of the route it came by
    (None off any route)."""

    __slots__ = ("args", "context", "kwargs")

    def __init__(self, args: tuple, kwargs: dict, context: _CallContext | None) -> None:
        self.args = args
        self.kwargs = kwargs
        self.context = context

    @property
    def roots(self) -> tuple:
        return tuple(self.args[0] if self.args else self.kwargs["tensors"])

    @property
    def accumulates_grad(self) -> bool:
        """A backward() call, which accumulates into ``.grad`` and returns nothing; grad() returns its gradients."""
        if "accumulate_grad" in self.kwargs:
            return bool(self.kwargs["accumulate_grad"])
        return len(self.args) > 6 and bool(self.args[6])

    def run_on_torch_ext(self, handed=None) -> tuple | None:
        """The call, on torch_ext's engine (stock's under compiled autograd) whichever route it came by, on this
        thread; ``handed``, when an overlap hands the call to its backward thread: the window's record of it (a
        ``torch_ext._C.HandedBackward``), which joins the call's context."""
        context = self.context
        if handed is not None:
            context = _CallContext([] if context is None else context.priorities, handed)
        return _run_on_torch_ext(self.args, self.kwargs, context)


# hook(call) for each registered backward-entry hook, in registration order (see _register_backward_entry_hook);
# an OrderedDict, as torch's hook tables are, because RemovableHandle refers to it weakly and a dict cannot be.
_backward_entry_hooks: OrderedDict[int, Callable[[_EngineCall], bool]] = OrderedDict()


def _register_backward_entry_hook(hook: Callable[[_EngineCall], bool]) -> RemovableHandle:
    """Calls ``hook(call)`` before every backward this process starts through torch_ext (on any thread) until the
    handle is removed; an open torch_ext.overlap_microbatches registers one.

    ``hook`` returns True when it has taken the call over (it runs it, now or later, and the caller gets
    nothing back), False to let it go on. Only a call that ``accumulates_grad`` may be taken: a grad() call's
    caller needs its result now. The hooks see every call at the router: while any is registered,
    :func:`backward` and :func:`grad` take the router's path rather than their direct one.
    """
    _installed_router()
    handle = RemovableHandle(_backward_entry_hooks)
    _backward_entry_hooks[handle.id] = hook
    return handle


def _taken_by_an_entry_hook(call: _EngineCall) -> bool:
    return any(hook(call) for hook in tuple(_backward_entry_hooks.values()))


# next_call: the context of the next engine call on this thread (a _CallContext), set by a route (torch_ext.backward
# and grad, an overlap's backward thread) and taken by the engine's entry (the router, split backward's passes),
# which passes it to the engine whole; None outside a route. The one place Python keeps a call's own state on its
# way to the engine: every route reaches the engine through torch.autograd's engine call, which takes no more
# arguments. tests/test_layering.py keeps it the only one.
_thread = threading.local()


def _take_next_call_context() -> _CallContext | None:
    """This thread's next call's context (see ``_thread``), taken for the engine call starting now: a backward
    nested inside that call's nodes does not see it."""
    context = getattr(_thread, "next_call", None)
    _thread.next_call = None
    return context


class _Router:
    """``Variable._execution_engine`` once torch_ext has been used: torch_ext's engine or the replaced one.

    A call goes to torch_ext's engine when its thread is inside torch_ext.backward/grad or :func:`enable`
    is on; any other call, on any thread, to the engine this router replaced. The route's context (its
    priorities, the overlap's handed backward) is taken at entry, so a backward nested inside a node (a
    reentrant checkpoint) does not see it. The backward-entry hooks see every call first, and may take it over
    (:func:`_register_backward_entry_hook`).
    """

    def __init__(self, replaced) -> None:
        self.replaced = replaced
        self.enabled_depth = 0

    def run_backward(self, *args, **kwargs):
        # _take_next_call_context, inline: every call through the router pays it.
        context = getattr(_thread, "next_call", None)
        _thread.next_call = None
        routed = context is not None or self.enabled_depth
        # A traced call goes to the replaced engine before the entry hooks: none may take it to another thread.
        if (not routed and not _backward_entry_hooks) or _is_traced_call(args, kwargs):
            return self.replaced.run_backward(*args, **kwargs)
        if _backward_entry_hooks and _taken_by_an_entry_hook(_EngineCall(args, kwargs, context)):
            return None
        if not routed:
            return self.replaced.run_backward(*args, **kwargs)
        return _run_on_torch_ext(args, kwargs, context)

    def queue_callback(self, callback) -> None:
        return self.replaced.queue_callback(callback)

    def is_checkpoint_valid(self) -> bool:
        return self.replaced.is_checkpoint_valid()


_install_lock = threading.Lock()
_router: _Router | None = None


def _installed_router() -> _Router:
    """The router, made torch.autograd's engine on first use (it keeps the engine it replaced)."""
    global _router
    if _router is None:
        with _install_lock:
            if _router is None:
                _router = _Router(Variable._execution_engine)
                Variable._execution_engine = _router
    return _router


class _routed:  # lower case: used like a function, `with _routed(priorities, api):`
    """Sends this thread's next torch.autograd engine call to torch_ext's engine, with its context: ``priorities``
    and, for a backward an overlap handed to its backward thread, ``handed`` (a ``torch_ext._C.HandedBackward``).

    A class rather than a @contextlib.contextmanager generator: entering and leaving it is part of every
    call's fixed cost (engine_overhead.py's fixed_cost case), and the generator cost 1.3 us more per call
    here (torch_ext.backward on a 3-op graph: 22.7 -> 21.4 us, stock 22.1 us).
    """

    __slots__ = ("_context", "_outer")

    def __init__(self, priorities, api: str, handed=None) -> None:
        self._context = _CallContext(priority_overrides(priorities, api) or [], handed)
        if _router is None:
            _installed_router()

    def __enter__(self) -> None:
        self._outer = getattr(_thread, "next_call", None)
        _thread.next_call = self._context

    def __exit__(self, *exc_info) -> None:
        _thread.next_call = self._outer


def enable() -> Undo:
    """Makes torch_ext's engine the one torch.autograd calls, for every thread of the process.

    Calls nest: each ``enable()`` is undone by one :func:`disable`, or by the end of its ``with`` block::

        torch_ext.enable()  # from now on
        with torch_ext.enable():  # every backward pass in the block
            loss.backward()
    """
    router = _installed_router()
    with _install_lock:
        router.enabled_depth += 1
    return Undo("enable()", disable)


def disable() -> None:
    """Undoes the matching :func:`enable`."""
    with _install_lock:
        if _router is None or not _router.enabled_depth:
            raise RuntimeError("torch_ext.disable() called without a matching torch_ext.enable()")
        _router.enabled_depth -= 1


def is_enabled() -> bool:
    """Whether torch.autograd currently runs every backward on torch_ext's engine."""
    return _router is not None and _router.enabled_depth > 0


# What a plain call's stock Python does besides argument handling, mirrored by the direct calls below
# (torch.autograd.graph._engine_run_backward): with TORCH_LOGS=autograd it hooks every node (those calls keep
# stock's Python), and it stashes the caller's context variables for the engine's device threads.
_STOCK_BACKWARD = torch.autograd.backward
_STOCK_GRAD = torch.autograd.grad
_AUTOGRAD_LOG = autograd_graph.log
_has_torch_function = torch._C._has_torch_function


def _is_plain_tensor(value) -> bool:
    return type(value) is torch.Tensor


def _stock_python_only_forwards(tensors: tuple) -> bool:
    """Whether stock's Python for a call on ``tensors`` would only build the implicit gradients and call
    the engine (the caller checks that its function is stock's, not patched or wrapped).

    True when torch_ext's router is the engine and no functorch transform, ``__torch_function__`` (mode
    or subclass), compiled autograd or autograd debug logging is active: what would make stock's Python
    do something else. False while a backward-entry hook is registered, which sees calls at the router.
    """
    if _router is None:
        # As the routed path would on a process's first call.
        _installed_router()
    return (
        not _backward_entry_hooks
        and Variable._execution_engine is _router
        and not _functorch_transforms_active()
        and not _dispatch_mode_stack_length()
        and not _has_torch_function(tensors)
        and not _compiled_autograd_enabled()
        and _AUTOGRAD_LOG.getEffectiveLevel() > logging.DEBUG
    )


def _plain_tensors_or_none(inputs) -> tuple | None:
    """``inputs`` as a tuple when it is a list or tuple of plain tensors, else None."""
    if type(inputs) not in (list, tuple) or not all(type(value) is torch.Tensor for value in inputs):
        return None
    return tuple(inputs)


def backward(
    tensors,
    grad_tensors=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables=None,
    inputs=None,
    *,
    priorities=None,
) -> None:
    """``torch.autograd.backward`` on torch_ext's engine: the same function, arguments and errors.

    ``priorities``: ``{tensor, Node or GradientEdge: int}`` for this call only, over
    :func:`torch_ext.set_priority`'s (propagated; see torch_ext.priority).
    """
    # The common call (one scalar loss, nothing else given) skips stock's Python, half of a small
    # backward's fixed cost: (x * 2).sin().sum(), engine_overhead.py's fixed_cost case, 39.2 us on stock
    # of which 17.4 us before its engine call. The implicit gradient and the context stash are made in
    # C++ (run_backward_implicit): in Python they cost 3 us of torch_ext's 23 us (now 20 us; stock 35-37).
    # Any other call goes through stock's Python.
    if (
        grad_tensors is None
        and grad_variables is None
        and inputs is None
        and type(create_graph) is bool
        and (retain_graph is None or type(retain_graph) is bool)
        and _is_plain_tensor(tensors)
        and torch.autograd.backward is _STOCK_BACKWARD
        and _stock_python_only_forwards((tensors,))
    ):
        ran = _C.run_backward_implicit(
            tensors,
            create_graph if retain_graph is None else retain_graph,
            create_graph,
            (),
            True,
            True,
            priority_overrides(priorities, "backward"),
        )
        if ran is not NotImplemented:
            return
    with _routed(priorities, "backward"):
        torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
    *,
    priorities=None,
):
    """``torch.autograd.grad`` on torch_ext's engine: the same function, arguments and errors.

    Only the nodes on a path from ``outputs`` to ``inputs`` run, and nodes skip the gradients nobody
    asked for (``grad(x)`` of an MLP computes no weight gradients). ``priorities`` is as for :func:`backward`.
    """
    # As in backward(): the common call skips stock's Python.
    if (
        grad_outputs is None
        and only_inputs is True
        and is_grads_batched is False
        and materialize_grads is False
        and (allow_unused is None or type(allow_unused) is bool)
        and type(create_graph) is bool
        and (retain_graph is None or type(retain_graph) is bool)
        and _is_plain_tensor(outputs)
    ):
        inputs_tuple = (inputs,) if _is_plain_tensor(inputs) else _plain_tensors_or_none(inputs)
        if (
            inputs_tuple
            and torch.autograd.grad is _STOCK_GRAD
            and _stock_python_only_forwards((outputs, *inputs_tuple))
        ):
            gradients = _C.run_backward_implicit(
                outputs,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                inputs_tuple,
                bool(allow_unused),
                False,
                priority_overrides(priorities, "grad"),
            )
            if gradients is not NotImplemented:
                return gradients
    with _routed(priorities, "grad"):
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph,
            create_graph,
            only_inputs,
            allow_unused,
            is_grads_batched,
            materialize_grads,
        )
