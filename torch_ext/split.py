"""Split backward: input gradients now (dI), weight gradients later (dW), natively in the engine.

Zero-bubble pipeline schedules run a stage's dI pass first, to unblock the previous stage, and
its dW pass later, in what would otherwise be a bubble::

    dinputs, state = torch_ext.backward_input(outputs, grad_outputs, inputs, weights)
    send(dinputs)  # the previous stage can go on
    ...
    torch_ext.backward_weight(state)  # weights' .grad, through their AccumulateGrad

The dI pass runs only the nodes on a path from ``outputs`` to ``inputs``, and those nodes compute no
weight gradient. The gradients arriving at the frontier of the weight subgraph stay in ``state``,
with the frontier nodes' saved tensors; every other saved tensor of the dI pass is freed when it
returns. The dW pass resumes from there and accumulates each weight's gradient through its
AccumulateGrad, so ``.grad``, post-accumulate-grad hooks and DDP/FSDP hooks see what a full backward
gives them; the two passes together compute the same bits as one full backward. See docs/design.md,
"Split backward", and csrc/engine/split/split_backward.h.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import is_tensor_like

from torch_ext._api import Undo
from torch_ext._loader import _C
from torch_ext.engine import _compiled_autograd_enabled, _is_tracing, _take_next_call_context

SplitState = _C.SplitState


def backward_input(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None,
    inputs: torch.Tensor | Iterable[torch.Tensor],
    weights: Iterable[torch.Tensor],
    *,
    retain_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[tuple[torch.Tensor | None, ...], SplitState]:
    """The input-gradient pass: returns ``(gradient of each input, state)``.

    Args:
        outputs: the tensors to differentiate (a stage's outputs, or its loss).
        grad_outputs: the gradient of each output; ``None`` for scalars (ones), as in ``torch.autograd.grad``.
        inputs: tensors whose gradients are returned (not accumulated into ``.grad``), as by
            ``torch.autograd.grad``; may be empty, and then everything waits for the weight pass.
        weights: leaf tensors whose gradients the weight pass accumulates into ``.grad``.
        retain_graph: keep every saved tensor (for another backward over the same graph). By default
            only what the weight pass needs is kept.
        allow_unused: allow inputs and weights that ``outputs`` do not depend on (their gradient is
            ``None``); by default they raise.

    Nodes on a path to ``inputs`` run; generated nodes skip weight gradients, and custom
    ``autograd.Function``\\ s see ``ctx.needs_input_grad`` narrowed to what this pass computes. A
    Function that computes weight gradients anyway has them kept and is not run again by the weight
    pass. Pass ``state`` to :func:`backward_weight` once.
    """
    if _compiled_autograd_enabled():
        raise RuntimeError("torch_ext.backward_input does not run under compiled autograd")
    # torch.autograd's own helpers, so default gradients and their errors are torch.autograd.grad's.
    outputs_tuple = (outputs,) if is_tensor_like(outputs) or isinstance(outputs, GradientEdge) else tuple(outputs)
    inputs_tuple = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    weights_tuple = (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)
    if _is_tracing(
        value for value in (*outputs_tuple, *inputs_tuple, *weights_tuple) if isinstance(value, torch.Tensor)
    ):
        # The state it returns holds engine-side gradients and saved tensors that no traced graph can record.
        raise RuntimeError(
            "torch_ext.backward_input cannot be traced (a fake, proxy or functional dispatch mode or a functorch "
            "transform is active, or a tensor is fake or functional, as under torch.compile, make_fx or torch.func): "
            "compile the stage's forward only and call backward_input outside the compiled region"
        )
    grads = torch.autograd._make_grads(
        outputs_tuple,
        torch.autograd._tensor_or_tensors_to_tuple(grad_outputs, len(outputs_tuple)),
        is_grads_batched=False,
    )
    dinputs, state = _C.backward_input(
        outputs_tuple, grads, inputs_tuple, weights_tuple, retain_graph, allow_unused, _handed_backward()
    )
    return dinputs, state


def backward_weight(state: SplitState, *, retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """The weight-gradient pass of ``state`` (from :func:`backward_input`).

    Accumulates each weight's gradient into its ``.grad`` through its AccumulateGrad node, so hooks
    registered with ``register_post_accumulate_grad_hook`` and DDP's and FSDP's gradient hooks fire as
    in a full backward. Returns each weight's ``.grad`` afterwards (this pass's gradient, when
    ``.grad`` was ``None`` before). Raises if ``state`` was already used. With ``retain_graph``, the
    weight subgraph's saved tensors are kept.
    """
    mode = _C.weight_accumulation_batching()
    # torch.accelerator is the engine's own test (at::accelerator): CUDA, XPU, MPS and the rest alike.
    if mode == "always" or (mode == "accelerator" and torch.accelerator.is_available()):
        # Registers torch_ext::multi_tensor_accumulate_, which the batch calls (imported once, ~2 s).
        import torch_ext.kernels  # noqa: F401
    return _C.backward_weight(state, retain_graph, _handed_backward())


def _handed_backward() -> _C.HandedBackward | None:
    """The backward an overlap handed to this thread, when this pass is its engine call (``backward_by`` of a stage's
    split backward): taken from the context of this thread's next call, which the pass is. A pass runs on its own
    plan's priorities."""
    context = _take_next_call_context()
    return None if context is None else context.handed


def set_weight_accumulation_batching(mode: str) -> Undo:
    """How the weight pass accumulates into ``.grad`` that already holds a gradient; ``with`` limits it to a block.

    When nothing observes the accumulation (no hook of any kind on the weight, grad mode off), each
    weight's AccumulateGrad would do ``.grad += gradient`` in place, one kernel launch per weight on
    a GPU. Batching takes those over and runs them as one ``torch_ext.kernels.multi_tensor_accumulate_``
    (one Triton launch per dtype on CUDA) when the pass ends, with the same bits.

    Args:
        mode: ``"accelerator"`` (default: weights on CUDA and other accelerators), ``"always"`` (CPU
            too; there the op is ``torch._foreach_add_``) or ``"off"`` (every weight through its own
            AccumulateGrad). ``torch_ext.kernels.set_triton_enabled(False)`` keeps the batch but swaps the
            Triton kernel for the torch reference.
    """
    if not isinstance(mode, str):
        raise TypeError(f"torch_ext.set_weight_accumulation_batching: mode must be a str, got {type(mode).__name__}")
    previous = _C.weight_accumulation_batching()
    _C.set_weight_accumulation_batching(mode)
    return Undo(f"set_weight_accumulation_batching({mode!r})", lambda: _C.set_weight_accumulation_batching(previous))


def get_weight_accumulation_batching() -> str:
    """The mode :func:`set_weight_accumulation_batching` set."""
    return _C.weight_accumulation_batching()
