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

import operator
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import _backward as _stock_backward
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
from torch.utils.hooks import RemovableHandle

from torch_ext.microbatch_overlap import overlap_microbatches
from torch_ext.split import SplitState, backward_input, backward_weight

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+


def stage_backward_input(
    stage_outputs_or_loss: list[torch.Tensor],
    output_grads: list[torch.Tensor] | None,
    input_values: list[Any],
    weights: Iterator[Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """``torch.distributed.pipelining._backward.stage_backward_input`` on torch_ext's engine.

    Returns the gradient of each of ``input_values`` (``None`` for non-tensors and tensors that do
    not require grad), also accumulated into their ``.grad``, and stock's parameter groups: one dict
    per group of weights, ``"params"`` (the set of their AccumulateGrad nodes), ``"intermediates"``
    (the list of nodes on the input side of the graph with an edge towards them) and ``"grads"`` (the
    gradients each intermediate received in this pass, one tuple per intermediate), found by stock's
    own graph walk. Each dict also holds, under one more key, what torch_ext's weight pass resumes
    from. Only the intermediates' saved tensors and the weights' side of the graph stay alive for
    :func:`stage_backward_weight`; every other saved tensor is freed. Detaches
    ``stage_outputs_or_loss``, as stock does.
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
    weights = list(weights)
    handles: list[RemovableHandle] = []
    try:
        param_groups = _stock_param_groups(valid_outputs, input_values, weights)
        for group in param_groups:
            handles += _record_grads_at_intermediates(group)
        dinputs: list[torch.Tensor | None] = [None] * len(input_values)
        # With no input that needs a gradient stock's walk finds no group, and its pass computes nothing.
        if valid_outputs and grad_indices:
            grads, state = backward_input(
                valid_outputs,
                valid_output_grads,
                [input_values[i] for i in grad_indices],
                # Every weight, not only the groups': stock's groups miss what reaches a weight from an
                # output other than through an intermediate (an output computed from weights alone).
                [weight for weight in weights if weight.requires_grad],
                allow_unused=True,
            )
            for index, grad in zip(grad_indices, grads, strict=True):
                dinputs[index] = grad
            # With no group, nothing carries the state to the weight pass: as with stock's, no weight gets a
            # gradient.
            if param_groups:
                pending = _PendingWeightPass(state, param_groups)
                for index, group in enumerate(param_groups):
                    group[_WEIGHT_PASS_KEY] = (pending, index)
        for value, dinput in zip(input_values, dinputs, strict=True):
            if dinput is not None:
                if value.grad is None:
                    value.grad = dinput
                else:
                    value.grad += dinput
        for output in stage_outputs_or_loss:
            output.detach_()
        return tuple(dinputs), param_groups
    except Exception as e:
        raise RuntimeError(
            f"""
        Failed to run stage backward input:
        Stage output: {map_debug_info(stage_outputs_or_loss)}
        Output gradient: {map_debug_info(output_grads)}
        Input: {map_debug_info(input_values)}
        """
        ) from e
    finally:
        for handle in handles:
            handle.remove()


def stage_backward_weight(
    weights: Iterator[Parameter], param_groups: list[dict[str, Any]], retain_graph: bool = False
) -> tuple[torch.Tensor | None, ...]:
    """``torch.distributed.pipelining._backward.stage_backward_weight`` on torch_ext's engine.

    ``param_groups`` is what :func:`stage_backward_input` returned. When it holds every group of one
    such call, each with the values that call left in it, torch_ext's weight pass runs once for all
    of them: it accumulates each of their params' gradients through its AccumulateGrad node, so
    post-accumulate-grad and DDP/FSDP hooks fire (stock assigns ``.grad`` directly and they do not).
    Otherwise (a group's ``"grads"``, ``"intermediates"`` or ``"params"`` replaced, a gradient in
    ``"grads"`` modified in place, only some of a call's groups passed, or groups from stock's own
    ``stage_backward_input``), those groups are computed by stock's ``stage_backward_weight``, from
    their values. Like stock, removes ``"intermediates"`` and ``"grads"`` from each group. Returns what
    stock returns: each weight's ``.grad`` as it was before this call (``None`` where it was unset; a
    tensor since accumulated into in place otherwise).
    """
    weights = list(weights)
    weight_grads = tuple(weight.grad for weight in weights)
    pending_of_group = [_pending_weight_pass_of(group) for group in param_groups]
    resumable = _resumable_weight_passes(param_groups)
    as_stock: list[dict[str, Any]] = []
    for group, pending in zip(param_groups, pending_of_group, strict=True):
        if pending not in resumable:
            as_stock.append(group)
            continue
        # In the list's order: a weight in groups of two calls sums their gradients as stock would.
        _compute_as_stock(weights, as_stock, retain_graph)
        as_stock = []
        if pending.state is None:
            continue  # resumed at an earlier group of its call
        state = pending.take_state()
        # Before the pass, not after as stock does: the state drops each gradient it keeps once used,
        # and the groups would hold them all until the pass ended.
        for its_group in resumable[pending]:
            _clear_as_stock_does(its_group)
        backward_weight(state, retain_graph=retain_graph)
    _compute_as_stock(weights, as_stock, retain_graph)
    return weight_grads


# Each param group that stage_backward_input returns holds, under this key, its call's
# _PendingWeightPass and its own index in that call. A key rather than a dict subclass: the groups stay
# plain dicts, so pytree (which treats a dict subclass as a leaf) and anything that tests type(group)
# see stock's type, and dict(group) or group.copy() keep the state. A table beside the groups could not
# follow their lifetime: dicts, lists and autograd Nodes take no weak references, and a Node's metadata
# would make a cycle through the state's C++ references to the graph that nothing collects.
_WEIGHT_PASS_KEY = "_torch_ext_weight_pass"


class _PendingWeightPass:
    """What one :func:`stage_backward_input` call leaves for :func:`stage_backward_weight`: torch_ext's
    state for the weight pass of all the groups it returned, and each group's values as returned.

    The state runs only for all of the call's groups at once, and only while each holds the objects it
    was returned with, its gradients unmodified: the state keeps its own references to the gradients
    that reached the intermediates (and where a custom Function computed its weights' gradients in the
    input pass, those results instead), so it would not see a change.
    """

    __slots__ = ("_returned", "state")

    def __init__(self, state: SplitState, param_groups: list[dict[str, Any]]) -> None:
        self.state: SplitState | None = state
        # The same tensors as the groups hold: this costs no memory.
        self._returned = [
            (frozenset(group["params"]), tuple(group["intermediates"]), _grads_as_returned(group.get("grads")))
            for group in param_groups
        ]

    @property
    def num_groups(self) -> int:
        return len(self._returned)

    def take_state(self) -> SplitState | None:
        """The state, for its one weight pass (or to drop it); it no longer resumes."""
        state, self.state, self._returned = self.state, None, []
        return state

    def holds_what_was_returned(self, index: int, group: dict[str, Any]) -> bool:
        params, intermediates, grads = self._returned[index]
        return (
            group.get("params") == params
            and _same_objects(group.get("intermediates"), intermediates)
            and _same_grads(group.get("grads"), grads)
        )


# Each intermediate's gradient tuple, and the version counter of every gradient in them.
_ReturnedGrads = tuple[tuple[tuple[torch.Tensor | None, ...], ...], tuple[int, ...]]


def _grads_as_returned(grads: list[tuple[torch.Tensor | None, ...]] | None) -> _ReturnedGrads | None:
    if grads is None:
        return None
    tuples = tuple(tuple(grad_tuple) for grad_tuple in grads)
    return tuples, _versions(tuples)


def _same_grads(grads: Any, returned: _ReturnedGrads | None) -> bool:
    """Whether ``grads`` holds the returned gradients, none of them modified in place since."""
    if returned is None:
        return grads is None
    tuples, versions = returned
    if not _same_objects(grads, tuples, compare=_same_objects):
        return False
    return _versions(tuples) == versions


def _versions(grad_tuples: tuple[tuple[torch.Tensor | None, ...], ...]) -> tuple[int, ...]:
    return tuple(grad._version for grad_tuple in grad_tuples for grad in grad_tuple if grad is not None)


def _same_objects(values: Any, returned: tuple[Any, ...], compare: Callable[[Any, Any], bool] = operator.is_) -> bool:
    return isinstance(values, (list, tuple)) and len(values) == len(returned) and all(map(compare, values, returned))


def _stock_param_groups(
    outputs: list[torch.Tensor], input_values: list[Any], weights: list[Parameter]
) -> list[dict[str, Any]]:
    """Stock's parameter groups, from stock's own walk of the graph."""
    output_nodes = [node for node in map(_stock_backward._get_grad_fn_or_grad_acc, outputs) if node is not None]
    input_nodes = [
        node
        for node in (
            _stock_backward._get_grad_fn_or_grad_acc(value) for value in input_values if isinstance(value, torch.Tensor)
        )
        if node is not None
    ]
    weight_nodes = [node for node in map(_stock_backward._get_grad_fn_or_grad_acc, weights) if node is not None]
    return _stock_backward.get_param_groups(
        input_nodes, weight_nodes, _stock_backward.construct_reverse_graph(output_nodes)
    )


def _record_grads_at_intermediates(group: dict[str, Any]) -> list[RemovableHandle]:
    """Fills ``group["grads"]`` as stock's input pass does: a pre-hook on each intermediate stores the
    gradients it receives, in the order of ``group["intermediates"]`` (made a list here, as stock does)."""
    intermediates = list(group["intermediates"])
    group["intermediates"] = intermediates

    def record(index: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if group.get("grads") is None:
                group["grads"] = [None] * len(intermediates)
            group["grads"][index] = grad_outputs

        return hook

    return [node.register_prehook(record(index)) for index, node in enumerate(intermediates)]


def _pending_weight_pass_of(group: dict[str, Any]) -> _PendingWeightPass | None:
    return group.get(_WEIGHT_PASS_KEY, (None, 0))[0]


def _resumable_weight_passes(param_groups: list[dict[str, Any]]) -> dict[_PendingWeightPass, list[dict[str, Any]]]:
    """The calls whose torch_ext weight pass can run for ``param_groups`` (every group of the call is
    there, once, holding what the call left in it), with their groups."""
    groups_of: dict[_PendingWeightPass, list[dict[str, Any]]] = {}
    indices_of: dict[_PendingWeightPass, set[int]] = {}
    changed: set[_PendingWeightPass] = set()
    for group in param_groups:
        pending, index = group.get(_WEIGHT_PASS_KEY, (None, 0))
        if pending is None or pending.state is None:
            continue
        indices = indices_of.setdefault(pending, set())
        if index in indices or not pending.holds_what_was_returned(index, group):
            changed.add(pending)
        indices.add(index)
        groups_of.setdefault(pending, []).append(group)
    return {
        pending: groups
        for pending, groups in groups_of.items()
        if pending not in changed and len(indices_of[pending]) == pending.num_groups
    }


def _compute_as_stock(weights: list[Parameter], param_groups: list[dict[str, Any]], retain_graph: bool) -> None:
    """Stock's weight pass for these groups, from their values."""
    if not param_groups:
        return
    from_torch_ext = False
    for group in param_groups:
        pending = group.pop(_WEIGHT_PASS_KEY, (None, 0))[0]
        if pending is not None:
            # Part of its call is computed here: running its state later would count this part twice.
            pending.take_state()
            from_torch_ext = True
    try:
        _stock_backward.stage_backward_weight(iter(weights), param_groups, retain_graph=retain_graph)
    except Exception as error:
        if from_torch_ext:
            error.add_note(
                "torch_ext.pipelining.stage_backward_weight computed these param groups as "
                "torch.distributed.pipelining does, from their values, since they were changed after "
                "stage_backward_input (or only some of one call's groups were passed). That runs every node "
                "from a group's intermediates to its params; torch_ext's input pass kept the saved tensors of "
                "the intermediates and the weights' side only, so this fails where other nodes join a group's "
                "intermediates (a weight used at two places with an op between them) or where an intermediate "
                "is a custom Function that computed its weights' gradients in the input pass (which freed its "
                "saved tensors)."
            )
        raise


def _clear_as_stock_does(group: dict[str, Any]) -> None:
    """Leaves ``group`` as stock's weight pass leaves it."""
    del group[_WEIGHT_PASS_KEY]
    del group["intermediates"]
    if any(grad is not None for grad_tuple in group.get("grads", ()) for grad in grad_tuple):
        del group["grads"]


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
