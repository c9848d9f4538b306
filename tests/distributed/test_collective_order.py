"""The collective order check on 2 gloo ranks: ranks that diverge raise, naming the collective, instead of hanging.

Each case makes the ranks issue their backward collectives (lane nodes running a real all_to_all, and
torch_ext's own all_reduce) in the same order or not: a graph that differs by rank, a priority set on one
rank only. With ``torch_ext.check_collective_order()`` on, agreeing ranks train with stock's bits and
diverging ranks all raise the same clear error before any of them issues the collective that differs; a
backward that agrees then runs.

The swap cases are the dangerous divergence: two all_to_alls of one shape (an MoE layer's dispatch and
combine) that the ranks start in opposite orders. Unchecked, nothing hangs and the gradients are wrong (the
test shows it); a fingerprint of the collective's kind (name, place, group, shapes) sees nothing, so the
check names each collective by which one forward made it. One rank's extra autograd work outside the
collectives (logging, metrics) must not trip it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from _harness import assert_identical, run_ranks

import torch_ext
import torch_ext.ops
from torch_ext.testing import SyncAllToAll

pytestmark = pytest.mark.distributed

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _model_loss(rank: int, extra_on_rank: int | None, priority_on_rank: int | None) -> tuple[torch.Tensor, list]:
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(8, 6, requires_grad=True)
    small = SyncAllToAll.apply(x.tanh())
    large = SyncAllToAll.apply(y.sin())
    loss = small.sum() + torch_ext.ops.all_reduce(large).sum()
    if rank == extra_on_rank:
        loss = loss + SyncAllToAll.apply(x.cos()).sum()
    if rank == priority_on_rank:
        # Below the automatic collective priority: on this rank only, the small all_to_all runs after the large
        # one (which otherwise waits behind it: it reads the all_reduce's result in flight).
        torch_ext.set_priority(small, 1)
    return loss, [x, y]


def _testing_all_to_all():
    return SyncAllToAll.apply, SyncAllToAll


def _deepspeed_all_to_all():
    """DeepSpeed's real ``_AllToAll`` (deepspeed.moe.sharded_moe) on the default group."""
    import deepspeed.comm
    import torch.distributed as dist
    from deepspeed.moe.sharded_moe import _AllToAll

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return (lambda t: _AllToAll.apply(dist.group.WORLD, t)), _AllToAll


def _torch_ext_all_to_all(t: torch.Tensor) -> torch.Tensor:
    return torch_ext.ops.all_to_all_single(t, [2, 2], [2, 2])


def _functional_all_to_all(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return funcol.all_to_all_single_autograd(t, [2, 2], [2, 2], dist.group.WORLD)


def _swap_loss(rank: int, all_to_all, swap: bool) -> tuple[torch.Tensor, list]:
    """Dispatch and combine, two all_to_alls of one shape with different gradients; with ``swap``, priorities
    (below the automatic collective priority) make rank 0 start dispatch's first and rank 1 combine's."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 6, requires_grad=True)
    dispatch = all_to_all(x.tanh())
    combine = all_to_all(y.sin())
    loss = (dispatch * 3).sum() + (combine * combine).sum()
    if swap:
        _start_in_opposite_orders(rank, dispatch, combine)
    return loss, [x, y]


def _start_in_opposite_orders(rank: int, dispatch: torch.Tensor, combine: torch.Tensor) -> None:
    """Priorities (below the automatic collective priority) that make rank 0 start dispatch's all_to_all first and
    rank 1 combine's."""
    first, second = (dispatch, combine) if rank == 0 else (combine, dispatch)
    torch_ext.set_priority(_collective_node(first), 2)
    torch_ext.set_priority(_collective_node(second), 1)


def _collective_node(t: torch.Tensor):
    """The node that issues ``t``'s backward collective: its grad_fn, or, for a functional collective, the node
    under the wrapper that waits in forward."""
    node = t.grad_fn
    return node.next_functions[0][0] if "_wrap_tensor_autograd" in node.name() else node


def _backward_on_torch_ext(loss: torch.Tensor, leaves: list) -> dict:
    try:
        with torch_ext.enable():
            loss.backward()
        return {"error": None, "grads": [leaf.grad for leaf in leaves]}
    except RuntimeError as error:
        return {"error": str(error)}


def _swap_cases(rank: int, library: str, all_to_all) -> dict:
    results = {}
    loss, leaves = _swap_loss(rank, all_to_all, swap=False)
    loss.backward()
    results[f"{library}_swap_stock"] = [leaf.grad for leaf in leaves]
    results[f"{library}_swap"] = _backward_on_torch_ext(*_swap_loss(rank, all_to_all, swap=True))
    torch_ext.check_collective_order(False)
    results[f"{library}_swap_unchecked"] = _backward_on_torch_ext(*_swap_loss(rank, all_to_all, swap=True))
    torch_ext.check_collective_order()
    results[f"{library}_swap_after"] = _backward_on_torch_ext(*_swap_loss(rank, all_to_all, swap=False))
    return results


# The all_to_alls RecordedAllToAll's backward started in this rank's current split backward.
started_all_to_alls: list[str] = []


class RecordedAllToAll(SyncAllToAll):
    """SyncAllToAll that records each backward it starts, in ``started_all_to_alls``."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        started_all_to_alls.append("all_to_all")
        return SyncAllToAll.backward(ctx, grad)


def _split_stage(all_to_all) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """A pipeline stage with dispatch and combine, two same-shaped all_to_alls on its input's path: (loss, dispatch,
    combine, the stage input, the weights)."""
    torch.manual_seed(0)
    stage_input = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 6, requires_grad=True)
    w2 = torch.randn(6, 6, requires_grad=True)
    dispatch = all_to_all(stage_input @ w1)
    combine = all_to_all(stage_input.sin() @ w2)
    loss = (dispatch * 3).sum() + (combine * combine).sum()
    return loss, dispatch, combine, stage_input, [w1, w2]


def _split_passes(rank: int, swap: bool) -> dict:
    """Split backward's passes (torch_ext.backward_input, then backward_weight) over the stage; with ``swap``, its
    all_to_alls started in opposite orders on the two ranks."""
    loss, dispatch, combine, stage_input, weights = _split_stage(RecordedAllToAll.apply)
    if swap:
        _start_in_opposite_orders(rank, dispatch, combine)
    started_all_to_alls.clear()
    try:
        (input_grad,), state = torch_ext.backward_input(loss, None, [stage_input], weights)
        weight_grads = torch_ext.backward_weight(state)
    except RuntimeError as error:
        return {"error": str(error), "started": list(started_all_to_alls)}
    return {"error": None, "grads": [input_grad, *weight_grads], "started": list(started_all_to_alls)}


def _split_stock() -> list:
    loss, _, _, stage_input, weights = _split_stage(SyncAllToAll.apply)
    loss.backward()
    return [stage_input.grad, *(w.grad for w in weights)]


def _run(rank: int) -> dict:
    torch_ext.run_in_lane(SyncAllToAll, RecordedAllToAll)
    torch_ext.check_collective_order()
    results = {}
    for case, (extra, priority) in {"agree": (None, None), "extra": (1, None), "priority": (None, 1)}.items():
        results[case] = _backward_on_torch_ext(*_model_loss(rank, extra, priority))
    # One rank's autograd work outside the collectives before the step, as logging or metrics do: more nodes
    # made (sequence numbers moved on) and a backward of its own, with no collective in it.
    if rank == 1:
        metric = torch.ones(3, requires_grad=True)
        (metric * 2).exp().sum().backward()
    results["extra_ops"] = _backward_on_torch_ext(*_model_loss(rank, None, None))
    results.update(_swap_cases(rank, "testing", SyncAllToAll.apply))
    # torch_ext's own op (launched on the engine thread, its wait deferred) and PyTorch's functional collective
    # (waited on inside its node): both started by the engine thread, which awaits the check first.
    results.update(_swap_cases(rank, "torch_ext_op", _torch_ext_all_to_all))
    results.update(_swap_cases(rank, "funcol", _functional_all_to_all))
    results["split_stock"] = _split_stock()
    results["split_swap"] = _split_passes(rank, swap=True)
    results["split_agree"] = _split_passes(rank, swap=False)
    if HAS_DEEPSPEED:
        all_to_all, function = _deepspeed_all_to_all()
        torch_ext.run_in_lane(function)
        results.update(_swap_cases(rank, "deepspeed", all_to_all))
    # Stock's bits for the agreeing case, and the engine usable after the errors.
    loss, leaves = _model_loss(rank, None, None)
    loss.backward()
    results["stock"] = [leaf.grad for leaf in leaves]
    loss, leaves = _model_loss(rank, None, None)
    with torch_ext.enable():
        loss.backward()
    results["after_errors"] = [leaf.grad for leaf in leaves]
    results["checks"] = torch_ext.debug.collective_check_count()
    # A group made after the check was switched on: its mirror is made at its first checked backward.
    late = dist.new_group([0, 1])
    results["late_group"] = _backward_on_torch_ext(*_on_group_loss(late))
    results["late_group_checks"] = torch_ext.debug.collective_check_count() - results["checks"]
    torch_ext.check_collective_order(False)
    loss, leaves = _on_group_loss(late)
    loss.backward()
    results["late_group_stock"] = [leaf.grad for leaf in leaves]
    return results


class OnGroupAllToAll(torch.autograd.Function):
    """SyncAllToAll on a group of the caller's (``ctx.group``)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return None, received


def _on_group_loss(group) -> tuple[torch.Tensor, list]:
    torch_ext.run_in_lane(OnGroupAllToAll)
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    return OnGroupAllToAll.apply(group, x.tanh()).sum(), [x]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("collective_order"))


@pytest.mark.parametrize("case", ["agree", "extra_ops"])
def test_agreeing_ranks_run_with_stock_bits(results, case):
    for rank, result in enumerate(results):
        assert result[case]["error"] is None, (rank, result[case]["error"])
        for ours, stock in zip(result[case]["grads"], result["stock"], strict=True):
            assert torch.equal(ours, stock), rank
        assert result["checks"] > 0


@pytest.mark.parametrize("case", ["extra", "priority"])
def test_diverging_ranks_all_raise_naming_the_first_difference(results, case):
    messages = [result[case]["error"] for result in results]
    assert all(message is not None for message in messages), messages
    # Every rank saw every rank's fingerprint: the same message everywhere.
    assert messages[0] == messages[1]
    message = messages[0]
    assert "the ranks disagree on collective #" in message
    assert "rank 0:" in message and "rank 1:" in message
    if case == "extra":
        # Rank 1's extra all_to_all comes first in its order (created last in forward).
        assert "#0 SyncAllToAllBackward" in message
    else:
        assert "float32[8, 6]" in message and "float32[4, 6]" in message


def test_the_engine_runs_again_after_a_mismatch(results):
    for rank, result in enumerate(results):
        for ours, stock in zip(result["after_errors"], result["stock"], strict=True):
            assert torch.equal(ours, stock), rank


SWAP_LIBRARIES = [
    "testing",
    "torch_ext_op",
    "funcol",
    pytest.param(
        "deepspeed",
        marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (the [test] extra has it)"),
    ),
]


@pytest.mark.parametrize("library", SWAP_LIBRARIES)
def test_a_swap_of_same_shaped_collectives_corrupts_gradients_unchecked(results, library):
    """Why the check must see identities: unchecked, the swap neither hangs nor errs, and the data is mixed."""
    wrong = []
    for result in results:
        unchecked = result[f"{library}_swap_unchecked"]
        assert unchecked["error"] is None, unchecked["error"]
        stock = result[f"{library}_swap_stock"]
        wrong.append(not all(torch.equal(ours, theirs) for ours, theirs in zip(unchecked["grads"], stock, strict=True)))
    assert any(wrong)


@pytest.mark.parametrize("library", SWAP_LIBRARIES)
def test_a_swap_of_same_shaped_collectives_raises_on_every_rank(results, library):
    messages = [result[f"{library}_swap"]["error"] for result in results]
    assert all(message is not None for message in messages), messages
    assert messages[0] == messages[1]
    message = messages[0]
    assert "the ranks disagree on collective #0" in message
    # Same kind on both ranks; forward's first on one, its second on the other.
    assert "(forward's collective #0 on its group)" in message and "(forward's collective #1 on its group)" in message
    assert message.count("float32[4, 6]") >= 2
    for rank, result in enumerate(results):
        after = result[f"{library}_swap_after"]
        assert after["error"] is None, (rank, after["error"])
        for ours, stock in zip(after["grads"], result[f"{library}_swap_stock"], strict=True):
            assert torch.equal(ours, stock), rank


def test_split_backward_passes_are_checked(results):
    """backward_input's pass starts the swapped all_to_alls (no lane there, but the same check): every rank raises
    before either starts; agreeing passes give stock's bits."""
    messages = [result["split_swap"]["error"] for result in results]
    assert all(message is not None for message in messages), messages
    assert messages[0] == messages[1]
    # Raised before either all_to_all started, on every rank (a mismatch of other shapes would hang there).
    assert [result["split_swap"]["started"] for result in results] == [[], []]
    assert (
        "(forward's collective #0 on its group)" in messages[0]
        and "(forward's collective #1 on its group)" in messages[0]
    )
    for rank, result in enumerate(results):
        agree = result["split_agree"]
        assert agree["error"] is None, (rank, agree["error"])
        for ours, stock in zip(agree["grads"], result["split_stock"], strict=True):
            assert torch.equal(ours, stock), rank


def test_a_group_made_after_the_check_was_switched_on_is_checked_too(results):
    for rank, result in enumerate(results):
        assert result["late_group"]["error"] is None, (rank, result["late_group"])
        assert result["late_group_checks"] == 1, (rank, result["late_group_checks"])
        assert_identical(result["late_group"]["grads"], result["late_group_stock"], f"rank {rank}")
