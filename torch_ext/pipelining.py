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

:func:`overlap_f_b` is a function for ``register_custom_function(OVERLAP_F_B, ...)``: it runs the
forward and the backward of each overlapped step (``ScheduleDualPipeV``'s "F0B1"/"F1B0") at the
same time, the backward on torch_ext's engine in a backward thread, with the bits of the default's
forward-then-backward::

    torch_ext.pipelining.use_overlapped_f_b(schedule)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining._debug import map_debug_info
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.nn import Parameter

from torch_ext.microbatch_overlap import overlap_microbatches
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


# -- OVERLAP_F_B ---------------------------------------------------------------------------------------------------

_FORWARD = _ComputationType.FORWARD
_BACKWARDS = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT)


def overlap_f_b(action: _Action, ctx: _PipelineContext) -> None:
    """Runs an ``OVERLAP_F_B`` action's forward and backward at the same time: a function for
    ``_PipelineScheduleRuntime.register_custom_function(OVERLAP_F_B, overlap_f_b)`` (see
    :func:`use_overlapped_f_b`).

    The backward sub-action (``FULL_BACKWARD``, ``BACKWARD_INPUT`` or ``BACKWARD_WEIGHT``) runs on a
    backward thread, on torch_ext's engine, under this thread's thread-local state (grad mode,
    autocast, saved-tensor hooks), while this thread runs the forward sub-action; both have finished
    when this returns. Gradients, losses and outputs are the default's (forward, then backward), bit
    for bit, as the two sub-actions touch different stages and the forward alone draws random
    numbers (a checkpoint's recompute in the backward sets the RNG state only while the forward is
    parked, as in :func:`torch_ext.overlap_microbatches`, which this runs in; a backward that draws
    numbers of its own would take them from beside the forward's). On this thread, in program order:
    the waits for both sub-actions' received tensors, FSDP's unshard waits and the handing of
    outputs and input gradients to a neighbouring stage on this rank. Collectives: every collective
    the forward starts waits until the backward has finished (``forward_collectives="after_backward"``),
    so DDP's and FSDP's backward hooks may issue theirs and every rank issues the backward's before
    the forward's. Two sub-actions on the same stage run one after the other, as the default runs
    them (a stage's bookkeeping is not thread-safe).

    An error in either sub-action is raised here, naming the sub-action; if both fail, the
    forward's is raised with the backward's as a note. No thread outlives the call.
    """
    schedule = ctx.schedule_ref
    forward_action, backward_action = _forward_and_backward(action)
    stages: dict[int, _PipelineStageBase] = {stage.stage_index: stage for stage in schedule._stages}
    return_outputs, loss_kwargs = _step_arguments(ctx)

    def forward() -> Any:
        stage, microbatch = stages[forward_action.stage_index], forward_action.microbatch_index
        output = stage.forward_one_chunk(
            microbatch, ctx.arg_mbs[microbatch], ctx.kwarg_mbs[microbatch], save_forward_output=return_outputs
        )
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, microbatch, loss_kwargs)
        return output

    if forward_action.stage_index == backward_action.stage_index:
        for sub_action in action.sub_actions:
            if sub_action is forward_action:
                _receive_forward_input(schedule, stages, forward_action)
                _pass_forward_output(stages, forward_action, forward())
            else:
                _prepare_backward(schedule, stages, backward_action)()
                _pass_backward_output(stages, backward_action)
        return

    _receive_forward_input(schedule, stages, forward_action)
    backward = _prepare_backward(schedule, stages, backward_action)

    def backward_on_torch_ext() -> None:
        # backward_by sends the stage's backward call to torch_ext's engine.
        try:
            backward()
        except BaseException as error:
            error.add_note(f"in the backward {backward_action} of {action} (torch_ext.pipelining.overlap_f_b)")
            raise

    with overlap_microbatches(forward_collectives="after_backward") as overlap:
        overlap.backward_by(backward_on_torch_ext)
        try:
            output = forward()
        except BaseException as error:
            error.add_note(
                f"in the forward {forward_action} of {action}, beside its backward (torch_ext.pipelining.overlap_f_b)"
            )
            raise
    _pass_forward_output(stages, forward_action, output)
    _pass_backward_output(stages, backward_action)


def use_overlapped_f_b(schedule: _PipelineScheduleRuntime) -> None:
    """Makes ``schedule`` (``ScheduleDualPipeV``, or any ``_PipelineScheduleRuntime`` whose actions
    include ``OVERLAP_F_B``) run each such action with :func:`overlap_f_b`."""
    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, overlap_f_b)


def _forward_and_backward(action: _Action) -> tuple[_Action, _Action]:
    sub_actions = action.sub_actions or ()
    forwards = [sub for sub in sub_actions if sub.computation_type == _FORWARD]
    backwards = [sub for sub in sub_actions if sub.computation_type in _BACKWARDS]
    if len(sub_actions) != 2 or len(forwards) != 1 or len(backwards) != 1:
        raise ValueError(
            f"torch_ext.pipelining.overlap_f_b: {action} must hold one forward and one backward sub-action "
            f"(F and B, I or W), not {sub_actions}"
        )
    return forwards[0], backwards[0]


def _step_arguments(ctx: _PipelineContext) -> tuple[bool, dict[str, Any] | None]:
    """The running step's ``return_outputs`` and ``loss_kwargs``: the default's forward passes them
    on, and torch 2.13's ``_PipelineContext`` does not carry them, so they are read from the
    schedule's ``_step_microbatches`` call that called the custom function."""
    if hasattr(ctx, "return_outputs") and hasattr(ctx, "loss_kwargs"):
        return ctx.return_outputs, ctx.loss_kwargs
    step_code = _PipelineScheduleRuntime._step_microbatches.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is step_code and frame.f_locals.get("self") is ctx.schedule_ref:
            return frame.f_locals["return_outputs"], frame.f_locals["loss_kwargs"]
        frame = frame.f_back
    # Called outside a step: step()'s defaults.
    return True, None


def _receive_forward_input(
    schedule: _PipelineScheduleRuntime, stages: dict[int, _PipelineStageBase], action: _Action
) -> None:
    stage = stages[action.stage_index]
    schedule._assert_unsharded(stage)
    # A stage whose previous stage is on this rank gets its input from it, not from a receive.
    if not stage.is_first and action.stage_index - 1 not in stages:
        key = (action.stage_index, action.microbatch_index)
        if key not in schedule.fwd_recv_ops:
            raise AssertionError(f"Computing {action=} before receiving input")
        _wait_batch_p2p(schedule.fwd_recv_ops.pop(key))


def _pass_forward_output(stages: dict[int, _PipelineStageBase], action: _Action, output: Any) -> None:
    if action.stage_index + 1 in stages:
        stages[action.stage_index + 1].set_local_fwd_input(output, action.microbatch_index)


def _prepare_backward(
    schedule: _PipelineScheduleRuntime, stages: dict[int, _PipelineStageBase], action: _Action
) -> Callable[[], None]:
    """Does the backward sub-action's schedule bookkeeping, on this thread, and returns its stage's
    computation."""
    stage, microbatch = stages[action.stage_index], action.microbatch_index
    schedule._assert_unsharded(stage)
    if action.computation_type == _ComputationType.BACKWARD_WEIGHT:
        schedule.backward_counter[action.stage_index] += 1
        last_backward = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
        return lambda: stage.backward_weight_one_chunk(microbatch, last_backward=last_backward)
    # A stage whose next stage is on this rank gets its output gradients from it, not from a receive.
    if not stage.is_last and action.stage_index + 1 not in stages:
        key = (action.stage_index, microbatch)
        if key not in schedule.bwd_recv_ops:
            raise AssertionError(f"Attempted to run compute {action=} before receiving input")
        _wait_batch_p2p(schedule.bwd_recv_ops.pop(key))
    loss = schedule._maybe_get_loss(stage, microbatch)
    full_backward = action.computation_type == _ComputationType.FULL_BACKWARD
    last_backward = False
    if full_backward:
        # The default counts full backwards and weight passes, to find the one after which DDP and FSDP reduce.
        schedule.backward_counter[action.stage_index] += 1
        last_backward = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
    return lambda: stage.backward_one_chunk(
        microbatch, loss=loss, full_backward=full_backward, last_backward=last_backward
    )


def _pass_backward_output(stages: dict[int, _PipelineStageBase], action: _Action) -> None:
    if action.computation_type != _ComputationType.BACKWARD_WEIGHT and action.stage_index - 1 in stages:
        stage = stages[action.stage_index]
        stages[action.stage_index - 1].set_local_bwd_input(
            stage.get_local_bwd_output(action.microbatch_index), action.microbatch_index
        )
