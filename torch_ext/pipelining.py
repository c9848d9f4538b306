"""torch_ext's split backward as a drop-in for ``torch.distributed.pipelining``'s zero-bubble schedules.

``torch.distributed.pipelining`` splits a stage's backward in Python (``_backward.py``): a
reverse-graph walk, node pre-hooks on the "intermediate" nodes and two ``autograd.grad`` calls, the
first retaining the whole graph. :func:`stage_backward_input` and :func:`stage_backward_weight` here
have the signatures and return values of its functions of the same names and run on torch_ext's
engine (:func:`torch_ext.backward_input`, :func:`torch_ext.backward_weight`). One line makes the
schedules that split backward (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV`` and any ``_PipelineScheduleRuntime`` with "I"/"W" actions) use them::

    torch_ext.pipelining.patch_zero_bubble()  # for the rest of the program
    with torch_ext.pipelining.patch_zero_bubble():  # or for a block
        schedule.step(x, target=y)

The schedules still run the first stage's backward whole, in its "W" step (``PipelineStage`` does
so when its inputs need no gradient), and full-backward steps on the stock engine unless
``torch_ext.enable()`` is on as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining._debug import map_debug_info
from torch.nn import Parameter

from torch_ext.split import SplitState, backward_input, backward_weight

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+


def stage_backward_input(
    stage_outputs_or_loss: list[torch.Tensor],
    output_grads: list[torch.Tensor] | None,
    input_values: list[Any],
    weights: Iterator[Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[SplitState]]:
    """``torch.distributed.pipelining._backward.stage_backward_input`` on torch_ext's engine.

    Returns the gradient of each of ``input_values`` (``None`` for non-tensors and tensors that do
    not require grad), also accumulated into their ``.grad``, and what
    :func:`stage_backward_weight` resumes from (in place of stock's parameter groups). Detaches
    ``stage_outputs_or_loss``, as stock does, so only what the weight pass needs stays alive.
    """
    valid_outputs: list[torch.Tensor] = []
    valid_output_grads: list[torch.Tensor] = []
    for i, stage_output in enumerate(stage_outputs_or_loss):
        if not stage_output.requires_grad and stage_output.grad_fn is None:
            continue
        valid_outputs.append(stage_output)
        valid_output_grads.append(torch.ones_like(stage_output) if output_grads is None else output_grads[i])
    grad_indices = [
        i for i, value in enumerate(input_values) if isinstance(value, torch.Tensor) and value.requires_grad
    ]
    # Stock's parameter groups only hold weights that require grad.
    trainable_weights = [weight for weight in weights if weight.requires_grad]
    try:
        dinputs: list[torch.Tensor | None] = [None] * len(input_values)
        states: list[SplitState] = []
        if valid_outputs:
            grads, state = backward_input(
                valid_outputs,
                valid_output_grads,
                [input_values[i] for i in grad_indices],
                trainable_weights,
                allow_unused=True,
            )
            states.append(state)
            for index, grad in zip(grad_indices, grads, strict=True):
                dinputs[index] = grad
        for value, dinput in zip(input_values, dinputs, strict=True):
            if dinput is not None:
                if value.grad is None:
                    value.grad = dinput
                else:
                    value.grad += dinput
        for output in stage_outputs_or_loss:
            output.detach_()
        return tuple(dinputs), states
    except Exception as e:
        raise RuntimeError(
            f"""
        Failed to run stage backward input:
        Stage output: {map_debug_info(stage_outputs_or_loss)}
        Output gradient: {map_debug_info(output_grads)}
        Input: {map_debug_info(input_values)}
        """
        ) from e


def stage_backward_weight(
    weights: Iterator[Parameter], param_groups: list[SplitState], retain_graph: bool = False
) -> tuple[torch.Tensor | None, ...]:
    """``torch.distributed.pipelining._backward.stage_backward_weight`` on torch_ext's engine.

    ``param_groups`` is what :func:`stage_backward_input` returned. Accumulates the weights'
    gradients through their AccumulateGrad nodes, so post-accumulate-grad and DDP/FSDP hooks fire
    (stock assigns ``.grad`` directly and they do not). Returns what stock returns: each weight's
    ``.grad`` as it was before this call (``None`` where it was unset; a tensor since accumulated
    into in place otherwise).
    """
    weight_grads = [weight.grad for weight in weights]
    for state in param_groups:
        if not isinstance(state, SplitState):
            raise TypeError(
                "torch_ext.pipelining.stage_backward_weight expects what torch_ext.pipelining.stage_backward_input "
                f"returned, but got a {type(state).__name__} (from torch.distributed.pipelining's own "
                "stage_backward_input?)"
            )
        backward_weight(state, retain_graph=retain_graph)
    return tuple(weight_grads)


class ZeroBubblePatch:
    """Makes ``torch.distributed.pipelining``'s stages split backward with torch_ext; see :func:`patch_zero_bubble`."""

    def __init__(self) -> None:
        self._replaced = (_stage_module.stage_backward_input, _stage_module.stage_backward_weight)
        _stage_module.stage_backward_input = stage_backward_input
        _stage_module.stage_backward_weight = stage_backward_weight
        self._active = True

    def undo(self) -> None:
        """Restores the functions this patch replaced (once; later calls do nothing)."""
        if self._active:
            _stage_module.stage_backward_input, _stage_module.stage_backward_weight = self._replaced
            self._active = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def patch_zero_bubble() -> ZeroBubblePatch:
    """Makes ``torch.distributed.pipelining``'s split-backward schedules use torch_ext's split backward.

    ``PipelineStage`` calls ``stage_backward_input`` and ``stage_backward_weight`` through its
    module's globals (``torch.distributed.pipelining.stage``); this replaces those two with the ones
    above, process-wide, until the returned patch's ``undo()`` (or the end of its ``with`` block).
    Patches nest.
    """
    return ZeroBubblePatch()
