"""torch_ext's engine as torch.autograd's execution engine, and the backward() entry point."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch
from torch.autograd import graph as autograd_graph
from torch.autograd.variable import Variable
from torch.overrides import handle_torch_function, has_torch_function, is_tensor_like

from torch_ext._loader import load_extension

_C = load_extension()

# The engine torch.autograd used before torch_ext was first enabled: the stock
# C++ engine. Final callbacks and checkpoint validity are properties of the
# current graph task, which torch_ext's host task makes the stock engine's own,
# so those calls go to it unchanged.
_STOCK_ENGINE = torch._C._ImperativeEngine()

# Features that land with the full-parity issue: until then they run on the
# stock engine under enable(), and raise from torch_ext.backward().
_PARITY_FEATURES = "create_graph=True and inputs= (full stock parity)"


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

    ``run_backward`` runs plain backward passes (no ``inputs=``, no ``create_graph``) on torch_ext's
    engine. grad(), ``backward(inputs=...)``, ``create_graph=True`` and backward passes under
    compiled autograd still go to the stock engine: they are completed by the full-parity issue.
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
    ):
        if create_graph or inputs or not accumulate_grad or _compiled_autograd_enabled():
            return _STOCK_ENGINE.run_backward(
                tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
            )
        return _C.run_backward(
            tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
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
    inputs=None,
) -> None:
    """``torch.autograd.backward`` on torch_ext's engine, with the same arguments and semantics.

    Args:
        tensors: tensors (or ``torch.autograd.graph.GradientEdge``) to differentiate.
        grad_tensors: the gradient of each of ``tensors``; ``None`` for scalars (ones).
        retain_graph: keep the graph's saved tensors for another backward; defaults to
            ``create_graph``.
        create_graph: not yet supported (raises NotImplementedError).
        inputs: not yet supported (raises NotImplementedError).
    """
    if create_graph:
        raise NotImplementedError(f"torch_ext.backward: create_graph=True is not implemented yet ({_PARITY_FEATURES})")
    if inputs is not None:
        raise NotImplementedError(f"torch_ext.backward: inputs= is not implemented yet ({_PARITY_FEATURES})")
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "backward() called inside a functorch transform. This is not "
            "supported, please use functorch.grad or functorch.vjp instead "
            "or call backward() outside of functorch transforms."
        )
    if is_tensor_like(tensors) or isinstance(tensors, autograd_graph.GradientEdge):
        tensors = (tensors,)
    else:
        tensors = tuple(tensors)
    tensor_args = tuple(t for t in tensors if is_tensor_like(t))
    if has_torch_function(tensor_args):
        return handle_torch_function(
            backward, tensor_args, tensors, grad_tensors=grad_tensors, retain_graph=retain_graph
        )
    grads = _make_root_grads(tensors, grad_tensors)
    if retain_graph is None:
        retain_graph = create_graph
    _C.run_backward(tensors, grads, retain_graph, create_graph, (), True, True)


def _make_root_grads(tensors: tuple, grad_tensors) -> tuple:
    # torch.autograd's own helpers, so default gradients and their error
    # messages are stock's exactly.
    grad_tensors_ = torch.autograd._tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
    return torch.autograd._make_grads(tensors, grad_tensors_, is_grads_batched=False)
