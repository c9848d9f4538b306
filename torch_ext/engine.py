"""torch_ext's engine as torch.autograd's execution engine, and the backward() and grad() entry points."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import _vmap_internals
from torch.autograd import graph as autograd_graph
from torch.autograd.variable import Variable
from torch.overrides import handle_torch_function, has_torch_function, is_tensor_like

from torch_ext._loader import load_extension
from torch_ext.priority import priority_overrides

_C = load_extension()

# The engine torch.autograd used before torch_ext was first enabled: the stock
# C++ engine. Final callbacks and checkpoint validity are properties of the
# current graph task, which torch_ext's host task makes the stock engine's own,
# so those calls go to it unchanged.
_STOCK_ENGINE = torch._C._ImperativeEngine()


def _compiled_autograd_enabled() -> bool:
    # Compiled autograd intercepts Engine::execute and cannot trace the host
    # task's driver node; such backward passes run on the stock engine.
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(compiled_autograd is not None and compiled_autograd.compiled_autograd_enabled)


class Engine:
    """torch_ext's autograd engine behind the interface of ``torch._C._ImperativeEngine``.

    An instance can be installed as ``torch.autograd.variable.Variable._execution_engine`` (what
    :func:`enable` does), so that ``loss.backward()``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` anywhere in the process run through it.

    Backward passes under compiled autograd go to the stock engine: compiled autograd intercepts the
    engine's entry and cannot trace torch_ext's driver node.
    """

    def run_backward(
        self,
        tensors,
        grad_tensors,
        keep_graph,
        create_graph,
        inputs=None,
        allow_unreachable=False,
        accumulate_grad=False,
        *,
        priorities=None,
    ):
        """``torch._C._EngineBase.run_backward`` on torch_ext's engine.

        ``priorities`` (``{tensor, Node or GradientEdge: int}``) apply to this call only, as for
        :func:`torch_ext.backward`.
        """
        overrides = priority_overrides(priorities, "Engine.run_backward")
        if _compiled_autograd_enabled():
            if overrides:
                raise RuntimeError(
                    "torch_ext.Engine.run_backward: priorities= cannot apply under compiled autograd, "
                    "whose backward runs on the stock engine"
                )
            return _STOCK_ENGINE.run_backward(
                tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
            )
        return _C.run_backward(
            tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad, overrides
        )

    def queue_callback(self, callback) -> None:
        """Runs ``callback`` when the current backward pass finishes (as DDP and FSDP do)."""
        return _STOCK_ENGINE.queue_callback(callback)

    def is_checkpoint_valid(self) -> bool:
        return _STOCK_ENGINE.is_checkpoint_valid()


_ENGINE = Engine()
_install_lock = threading.Lock()
# Engines replaced by enable(), innermost last; disable() restores the last one.
_replaced_engines: list[object] = []


def enable() -> None:
    """Makes torch_ext's engine the one torch.autograd calls, for every thread of the process.

    Calls nest: each enable() is undone by one disable().
    """
    with _install_lock:
        _replaced_engines.append(Variable._execution_engine)
        Variable._execution_engine = _ENGINE


def disable() -> None:
    """Restores the engine that the matching :func:`enable` replaced."""
    with _install_lock:
        if not _replaced_engines:
            raise RuntimeError("torch_ext.disable() called without a matching torch_ext.enable()")
        Variable._execution_engine = _replaced_engines.pop()


def is_enabled() -> bool:
    """Whether torch.autograd currently runs on torch_ext's engine."""
    return Variable._execution_engine is _ENGINE


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with torch_ext.enabled():`` runs every backward pass in the block on torch_ext's engine."""
    enable()
    try:
        yield
    finally:
        disable()


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
    """``torch.autograd.backward`` on torch_ext's engine: same arguments, semantics and errors.

    Args:
        tensors: tensors (or ``torch.autograd.graph.GradientEdge``) to differentiate.
        grad_tensors: the gradient of each of ``tensors``; ``None`` for scalars (ones).
        retain_graph: keep the graph's saved tensors for another backward; defaults to ``create_graph``.
        create_graph: record the backward pass itself, for higher-order gradients.
        grad_variables: deprecated alias of ``grad_tensors``.
        inputs: accumulate into the ``.grad`` of these only (tensors, GradientEdges or a dict of tensors).
        priorities: ``{tensor, Node or GradientEdge: int}`` for this call only, over
            :func:`torch_ext.set_priority`'s (propagated; see torch_ext.priority).
    """
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "backward() called inside a functorch transform. This is not "
            "supported, please use functorch.grad or functorch.vjp instead "
            "or call backward() outside of functorch transforms."
        )
    if grad_variables is not None:
        warnings.warn("`grad_variables` is deprecated. Use `grad_tensors` instead.", FutureWarning, stacklevel=2)
        if grad_tensors is None:
            grad_tensors = grad_variables
        else:
            raise RuntimeError(
                "`grad_tensors` and `grad_variables` (deprecated) "
                "arguments both passed to `backward()`. Please only "
                "use `grad_tensors`."
            )
    inputs_tuple = _inputs_to_tuple(inputs, "backward")
    if inputs is not None and len(inputs_tuple) == 0:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    tensors = _roots_to_tuple(tensors)
    overridable_args = tuple(t for t in tensors + inputs_tuple if is_tensor_like(t))
    if has_torch_function(overridable_args):
        return handle_torch_function(
            backward,
            overridable_args,
            tensors,
            grad_tensors=grad_tensors,
            retain_graph=retain_graph,
            create_graph=create_graph,
            inputs=inputs_tuple if inputs is not None else None,
        )
    overrides = priority_overrides(priorities, "backward")
    grads = _make_root_grads(tensors, grad_tensors, is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    _run_backward_logged(tensors, grads, retain_graph, create_graph, inputs_tuple, True, True, overrides)


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
    """``torch.autograd.grad`` on torch_ext's engine: same arguments, semantics and errors.

    Only the nodes on a path from ``outputs`` to ``inputs`` run, and nodes skip the gradients nobody
    asked for (``grad(x)`` of an MLP computes no weight gradients). Returns a tuple with the gradient
    of each input (``None`` where unused and ``allow_unused``), or a dict when ``inputs`` is a dict.
    ``priorities`` is as for :func:`backward`.
    """
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, but got: allow_unused=False."
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    outputs = _roots_to_tuple(outputs)
    inputs_tuple = _inputs_to_tuple(inputs, "grad")
    if len(inputs_tuple) == 0:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    overridable_args = tuple(t for t in outputs + inputs_tuple if is_tensor_like(t))
    if has_torch_function(overridable_args):
        result = handle_torch_function(
            grad,
            overridable_args,
            outputs,
            inputs_tuple,
            grad_outputs=grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            only_inputs=only_inputs,
            allow_unused=allow_unused,
            is_grads_batched=is_grads_batched,
            materialize_grads=materialize_grads,
        )
        return dict(zip(inputs.keys(), result, strict=True)) if type(inputs) is dict else result
    if not only_inputs:
        warnings.warn(
            "only_inputs argument is deprecated and is ignored now "
            "(defaults to True). To accumulate gradient for other "
            "parts of the graph, please use torch.autograd.backward.",
            FutureWarning,
            stacklevel=2,
        )
    overrides = priority_overrides(priorities, "grad")
    grads = _make_root_grads(outputs, grad_outputs, is_grads_batched=is_grads_batched)
    if retain_graph is None:
        retain_graph = create_graph

    def vjp(grad_batch):
        return _run_backward_logged(
            outputs, grad_batch, retain_graph, create_graph, inputs_tuple, allow_unused, False, overrides
        )

    if is_grads_batched:
        result = _vmap_internals._vmap(vjp, 0, 0, allow_none_pass_through=True)(grads)
    else:
        result = vjp(grads)
    if materialize_grads:
        if any(r is None and not is_tensor_like(inp) for r, inp in zip(result, inputs_tuple, strict=True)):
            raise RuntimeError("materialize_grads cannot be used when the given input is a GradientEdge")
        result = tuple(
            r if r is not None else torch.zeros_like(inp, requires_grad=create_graph)
            for r, inp in zip(result, inputs_tuple, strict=True)
        )
    return dict(zip(inputs.keys(), result, strict=True)) if type(inputs) is dict else result


def _run_backward_logged(roots, *args):
    """``_C.run_backward`` with TORCH_LOGS=autograd's per-node records, as torch.autograd's
    ``_engine_run_backward`` attaches them around the stock engine."""
    if autograd_graph.log.getEffectiveLevel() > logging.DEBUG:
        return _C.run_backward(roots, *args)
    unregister_hooks = autograd_graph._register_logging_hooks_on_whole_graph(roots)
    try:
        return _C.run_backward(roots, *args)
    finally:
        unregister_hooks()


def _roots_to_tuple(tensors) -> tuple:
    if is_tensor_like(tensors) or isinstance(tensors, autograd_graph.GradientEdge):
        return (tensors,)
    return tuple(tensors)


def _inputs_to_tuple(inputs, api: str) -> tuple:
    if inputs is None:
        return ()
    if isinstance(inputs, (torch.Tensor, autograd_graph.GradientEdge)):
        return (inputs,)
    if type(inputs) is dict:
        return tuple(inputs.values())
    if isinstance(inputs, Mapping):
        raise TypeError(
            f"`inputs` argument to `{api}()` must be a dict, not {type(inputs).__name__}. "
            "Other Mapping types are not supported."
        )
    return tuple(inputs)


def _make_root_grads(tensors: tuple, grad_tensors, *, is_grads_batched: bool) -> tuple:
    # torch.autograd's own helpers, so default gradients and their error
    # messages are stock's exactly.
    grad_tensors_ = torch.autograd._tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
    return torch.autograd._make_grads(tensors, grad_tensors_, is_grads_batched=is_grads_batched)
