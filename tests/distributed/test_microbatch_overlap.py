"""Overlap across microbatches on 2 gloo ranks: each microbatch's backward runs beside the next one's forward
(``torch_ext.overlap_microbatches``), and after several AdamW steps every loss, gradient and parameter is stock's
sequential loop's, bit for bit.

The model is a mixture of experts in miniature with the collectives real MoE layers issue: an all_gather of the
tokens-per-expert counts in forward (as Megatron-core's alltoall dispatcher does), and a dispatch and a combine
all_to_all through a synchronous autograd Function (Megatron-core's and DeepSpeed's ``_AllToAll``) whose backward
runs in a lane. Forward i+1 issues its collectives on the same group while backward i's lane issues its own: the
collective order rule keeps every rank's sequence the same, which the log of collectives checks on both ranks,
with one rank's backward made late (and, in one case, the other rank's forward).
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import assert_identical, run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.collectives import twin_groups

pytestmark = pytest.mark.distributed

STEPS = 3
MICROBATCHES = 4
DIM = 8
TOKENS = 6

# (phase, collective, on the forward thread) as each collective was issued, on this rank: phase "F" forward
# (logged once the collective is queued on its group: the gate let it through), "B" backward (logged before the
# lane issues it). The rule puts a forward's collectives behind the backward's, so the log is in issue order.
COLLECTIVE_LOG: list[tuple[str, str, bool]] = []
FORWARD_THREAD: list[threading.Thread] = []


def _log(phase: str, collective: str) -> None:
    COLLECTIVE_LOG.append((phase, collective, threading.current_thread() in FORWARD_THREAD))


class ExpertAllToAll(torch.autograd.Function):
    """A synchronous all_to_all in forward and in backward, over ``ctx.group``, as Megatron-core's ``_AllToAll``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.group = dist.group.WORLD
        out = torch.empty_like(x)
        issued = dist.all_to_all_single(out, x.contiguous(), group=ctx.group, async_op=True)
        _log("F", "all_to_all")
        issued.wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if LATE_RANK and dist.get_rank() == LATE_RANK[0]:
            time.sleep(0.05)
        out = torch.empty_like(grad)
        _log("B", "all_to_all")
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out


LATE_RANK: list[int] = []
# The rank whose forward sleeps before each layer's first collective (the late_forward case): its backward's next
# collective would otherwise go ahead of the forward's, while the other rank's goes behind it.
LATE_FORWARD: list[int] = []


class MoELayer(nn.Module):
    """The dense parts (with dropout) optionally checkpointed; the all_to_alls never are (a recompute would issue
    collectives the engine does not plan, on the engine thread, beside the lane's)."""

    def __init__(self, checkpointed: str | None) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.25), nn.Tanh())
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.25), nn.Tanh())
        self.checkpointed = checkpointed

    def _dense(self, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed is None:
            return part(x)
        return checkpoint(part, x, use_reentrant=self.checkpointed == "reentrant")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self._dense(self.pre, tokens)
        if LATE_FORWARD and dist.get_rank() == LATE_FORWARD[0]:
            time.sleep(0.03)
        counts = torch.tensor([h.shape[0]], dtype=torch.int64)
        gathered = torch.empty(dist.get_world_size(), dtype=torch.int64)
        issued = dist.all_gather_into_tensor(gathered, counts, async_op=True)
        _log("F", "all_gather")
        issued.wait()
        expert_out = ExpertAllToAll.apply(self.expert(ExpertAllToAll.apply(h)))
        return expert_out + self._dense(self.dense, h) * gathered.sum().item() / (2 * TOKENS)


class Model(nn.Module):
    def __init__(self, checkpointed: str | None) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[MoELayer(checkpointed) for _ in range(2)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(tokens))


def _train(rank: int, overlapped: bool, case: str) -> dict:
    torch.manual_seed(0)  # the same dense weights on both ranks; the data differs
    model = Model(checkpointed=case if case in ("reentrant", "non_reentrant") else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hook_log: list[str] = []
    if case == "hooks":
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_full_backward_hook(lambda m, gi, go, name=name: hook_log.append(f"module {name}"))
        for name, parameter in model.named_parameters():
            parameter.register_post_accumulate_grad_hook(lambda p, name=name: hook_log.append(f"accumulated {name}"))
    result: dict = {"losses": [], "grads": [], "hooks": []}
    COLLECTIVE_LOG.clear()
    # Collectives issued on the group and on its twin (the gloo backends count them): the twins case's backward
    # ones go to the twin.
    twin = twin_groups.TWINS.of(dist.group.WORLD)
    issued_before = (dist.group.WORLD._get_sequence_number_for_group(), twin._get_sequence_number_for_group())
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        batches = [torch.randn(2 * TOKENS, DIM, requires_grad=case == "reentrant") for _ in range(MICROBATCHES)]
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
        # Undeclared (the hooks case), the all_to_all's backward is a node the engine does not plan: the forward
        # waits for the whole backward.
        rule = {"hooks": "after_backward", "in_turns": IN_TURNS, "late_forward": IN_TURNS, "twins": TWINS}.get(
            case, "after_backward_collectives"
        )
        opened = torch_ext.overlap_microbatches(forward_collectives=rule) if overlapped else contextlib.nullcontext()
        with opened as overlap:
            for tokens in batches:
                with autocast:
                    loss = model(tokens).float().square().mean() / MICROBATCHES
                result["losses"].append(loss.detach())
                if overlapped:
                    overlap.backward(loss)
                else:
                    loss.backward()
        result["grads"].append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    result["hooks"] = hook_log
    result["collectives"] = list(COLLECTIVE_LOG)
    issued_after = (dist.group.WORLD._get_sequence_number_for_group(), twin._get_sequence_number_for_group())
    result["issued_on_group"], result["issued_on_twin"] = (b - a for a, b in zip(issued_before, issued_after))
    return result


IN_TURNS = "in_turns_with_backward_collectives"
TWINS = "beside_backward_collectives"
# in_turns and late_forward: the forward's collectives take turns with the backward's; twins: the backward's go to a
# twin of the group, beside the forward's.
CASES = ("plain", "in_turns", "late_forward", "twins", "hooks", "autocast", "reentrant", "non_reentrant")


def _run_bits(rank: int) -> dict:
    FORWARD_THREAD[:] = [threading.current_thread()]
    torch_ext.run_in_lane(ExpertAllToAll)
    LATE_RANK[:] = [1]  # rank 1's backward all_to_alls start 50 ms late
    results = {}
    for case in CASES:
        if case == "hooks":
            # Undeclared, the engine runs stock's order (a lane runs the dense path while it communicates, which
            # moves hooks): the overlap itself keeps whatever order the engine has, so hooks run in stock's.
            torch_ext.unregister_collective_backward(ExpertAllToAll)
        LATE_FORWARD[:] = [0] if case == "late_forward" else []
        results[case] = {"stock": _train(rank, False, case), "overlap": _train(rank, True, case)}
        if case == "hooks":
            torch_ext.run_in_lane(ExpertAllToAll)
    return results


@pytest.fixture(scope="module")
def bits(tmp_path_factory) -> list[dict]:
    return run_ranks(_run_bits, tmp_path_factory.mktemp("microbatch_overlap"), timeout_s=240)


@pytest.mark.parametrize("case", CASES)
def test_every_loss_gradient_and_parameter_is_stocks(bits, case):
    for rank, result in enumerate(bits):
        stock, overlap = result[case]["stock"], result[case]["overlap"]
        for what in ("losses", "grads", "params"):
            assert_identical(overlap[what], stock[what], f"rank {rank} {case} {what}")
        assert overlap["hooks"] == stock["hooks"], (rank, case)


def _sequential_order() -> list[tuple[str, str]]:
    """Per microbatch: its forward's collectives (all_gather, dispatch, combine per layer), then its backward's
    two all_to_alls per layer."""
    forward = [("F", "all_gather"), ("F", "all_to_all"), ("F", "all_to_all")] * 2
    backward = [("B", "all_to_all"), ("B", "all_to_all")] * 2
    return (forward + backward) * MICROBATCHES * STEPS


def _overlapped_order(case: str) -> list[tuple[str, str]]:
    """Stock's sequential order (forward i+1's collectives after backward i's), except where they take turns:
    backward i's and forward i+1's alternate, the backward's first (B F B F B F B F, then the forward's last
    two)."""
    if case not in ("in_turns", "late_forward"):
        return _sequential_order()
    forward = [("F", "all_gather"), ("F", "all_to_all"), ("F", "all_to_all")] * 2
    backward = [("B", "all_to_all")] * 4
    in_turns = [entry for pair in zip(backward, forward[:4]) for entry in pair] + forward[4:]
    # Each step: microbatch 0's forward alone, then the turns of backward i and forward i+1, then the last backward
    # alone (the block's end waits for it, so its collectives have no forward's to take turns with).
    return (forward + in_turns * (MICROBATCHES - 1) + backward) * STEPS


@pytest.mark.parametrize("case", [case for case in CASES if case != "twins"])
def test_collectives_run_in_one_order_on_every_rank(bits, case):
    for rank, result in enumerate(bits):
        stock, overlap = result[case]["stock"]["collectives"], result[case]["overlap"]["collectives"]
        assert [entry[:2] for entry in stock] == _sequential_order(), (rank, case)
        # Overlapped: the same collectives in one order on both ranks, however late rank 1's backward is, the
        # backward's off the forward thread.
        assert [entry[:2] for entry in overlap] == _overlapped_order(case), (rank, case)
        assert all(on_forward_thread == (phase == "F") for phase, _, on_forward_thread in overlap), (rank, case)


# -- the rule's other side, errors ---------------------------------------------------------------------------


def _small_step(model: nn.Module, rank: int, step: int, hook=None, forward_collectives="after_backward_collectives"):
    """One overlapped step of MICROBATCHES microbatches; ``hook(microbatch)`` runs on the head's output gradient."""
    torch.manual_seed(1000 * step + rank)
    batches = [torch.randn(2 * TOKENS, DIM) for _ in range(MICROBATCHES)]
    with torch_ext.overlap_microbatches(forward_collectives=forward_collectives) as overlap:
        for microbatch, tokens in enumerate(batches):
            out = model(tokens)
            if hook is not None:
                out.register_hook(lambda grad, microbatch=microbatch: hook(microbatch) or grad)
            overlap.backward(out.square().mean())


def _all_reduce_in_hook(microbatch: int) -> None:
    dist.all_reduce(torch.ones(1))


def _functional_all_reduce_in_hook(microbatch: int) -> None:
    funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()


def _raise_in_hook(microbatch: int) -> None:
    if microbatch == 1:
        raise ValueError("a hook failed on microbatch 1")


class TwoAllToAllsInBackward(torch.autograd.Function):
    """Breaks run_in_lane's contract: its backward runs two collectives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.group = dist.group.WORLD
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        once, twice = torch.empty_like(grad), torch.empty_like(grad)
        dist.all_to_all_single(once, grad.contiguous(), group=ctx.group)
        dist.all_to_all_single(twice, once, group=ctx.group)
        return twice


class FailingAllToAll(torch.autograd.Function):
    """An all_to_all in backward over ``group`` that raises instead, before issuing it, in microbatch 1's
    backward, on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, microbatch: int) -> torch.Tensor:
        ctx.group = group
        ctx.microbatch = microbatch
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.microbatch == 1:
            raise ValueError("a lane node failed on microbatch 1")
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None, None


def _a_lane_node_fails_while_another_waits_its_turn(rank: int, other_group: dist.ProcessGroup) -> None:
    """Two lane nodes on two groups, side by side, taking turns with the forward's collectives: the first in the
    plan's order raises before issuing its collective, so the forward's next collective never gets its turn; the
    second waits for its own turn, after that forward collective, on its own lane, and must give up when the
    backward fails instead of waiting for a forward that waits for it."""
    torch.manual_seed(rank)
    linear = nn.Linear(DIM, DIM)
    with torch_ext.overlap_microbatches(forward_collectives=IN_TURNS) as overlap:
        for microbatch in range(MICROBATCHES):
            h = linear(torch.randn(2 * TOKENS, DIM))
            dist.all_reduce(torch.ones(1))  # the forward's collective, which waits for the backward's first
            out = FailingAllToAll.apply(h, dist.group.WORLD, microbatch) + FailingAllToAll.apply(
                h.tanh(), other_group, microbatch
            )
            overlap.backward(out.square().mean())


def _two_collectives_in_a_lane_node(rank: int) -> None:
    torch.manual_seed(rank)
    linear = nn.Linear(DIM, DIM)
    with torch_ext.overlap_microbatches() as overlap:
        for _ in range(MICROBATCHES):
            overlap.backward(TwoAllToAllsInBackward.apply(linear(torch.randn(2 * TOKENS, DIM))).sum())


def _outcome_in_lane(function: type, run, raised: type[Exception]) -> tuple[str, list[str]] | None:
    """``run()`` with ``function`` declared with run_in_lane: None, or the message and notes of the ``raised`` it
    raised."""
    torch_ext.run_in_lane(function)
    try:
        run()
        return None
    except raised as error:
        return (str(error), getattr(error, "__notes__", []))
    finally:
        torch_ext.unregister_collective_backward(function)


def _run_errors(rank: int) -> dict:
    FORWARD_THREAD[:] = [threading.current_thread()]
    torch_ext.run_in_lane(ExpertAllToAll)
    results = {}
    torch.manual_seed(0)
    model = Model(checkpointed=None)
    for name, hook, rule in (
        ("unplanned", _all_reduce_in_hook, "after_backward_collectives"),
        ("unplanned_after_backward", _all_reduce_in_hook, "after_backward"),
        ("unplanned_functional", _functional_all_reduce_in_hook, "after_backward_collectives"),
        ("unplanned_functional_after_backward", _functional_all_reduce_in_hook, "after_backward"),
        ("raises", _raise_in_hook, "after_backward_collectives"),
    ):
        try:
            _small_step(model, rank, 0, hook, rule)
            results[name] = None
        except Exception as error:  # noqa: BLE001 - compared across ranks
            results[name] = (type(error).__name__, str(error), getattr(error, "__notes__", []))
        # The next step works and runs no thread of the failed one.
        _small_step(model, rank, 1)
        results[name + "_threads_after"] = sorted(t.name for t in threading.enumerate())
    # A lane node's collective counts as started once issued, so a second one from the same node is refused.
    results["second_in_lane"] = _outcome_in_lane(
        TwoAllToAllsInBackward, lambda: _two_collectives_in_a_lane_node(rank), RuntimeError
    )
    _small_step(model, rank, 1)
    results["abandoned"] = _outcome_in_lane(
        FailingAllToAll,
        lambda: _a_lane_node_fails_while_another_waits_its_turn(rank, dist.new_group([0, 1])),
        ValueError,
    )
    _small_step(model, rank, 1)
    results["abandoned_threads_after"] = sorted(t.name for t in threading.enumerate())
    # The order check covers the overlap: rank 0's forward of microbatch 1 saves the RNG state (as a checkpoint
    # would on that rank only), so its backward makes the next forward's collectives wait for all of it, and
    # rank 1's does not. Both ranks raise before backward 1 starts a collective.
    torch_ext.check_collective_order()
    try:
        torch.manual_seed(rank)
        with torch_ext.overlap_microbatches() as overlap:
            for microbatch in range(MICROBATCHES):
                out = model(torch.randn(2 * TOKENS, DIM))
                if microbatch == 1 and rank == 0:
                    torch.get_rng_state()
                overlap.backward(out.square().mean())
        results["rule_mismatch"] = None
    except RuntimeError as error:
        results["rule_mismatch"] = str(error)
    finally:
        torch_ext.check_collective_order(False)
    _small_step(model, rank, 2)
    return results


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> list[dict]:
    return run_ranks(_run_errors, tmp_path_factory.mktemp("microbatch_overlap_errors"), timeout_s=180)


def test_a_collective_the_engine_did_not_plan_is_refused_on_every_rank(errors):
    kinds = [result["unplanned"] for result in errors]
    assert kinds[0] == kinds[1], kinds
    kind, message, notes = kinds[0]
    assert kind == "RuntimeError", kinds
    assert "c10d::allreduce_ was started during the backward of microbatch 0" in message, message
    assert "forward_collectives='after_backward'" in message
    assert any("microbatch 0" in note for note in notes), notes


def test_a_functional_collective_the_engine_did_not_plan_is_refused_on_every_rank(errors):
    """A hook's functional collective reaches c10d below the c10d operators' gate: the functional collectives'
    own gate (their BackendSelect kernel) refuses it before it is issued."""
    kinds = [result["unplanned_functional"] for result in errors]
    assert kinds[0] == kinds[1], kinds
    kind, message, notes = kinds[0]
    assert kind == "RuntimeError", kinds
    assert "_c10d_functional::all_reduce was started during the backward of microbatch 0" in message, message
    assert any("microbatch 0" in note for note in notes), notes


def test_waiting_for_the_whole_backward_lets_it_through(errors):
    assert [result["unplanned_after_backward"] for result in errors] == [None, None]
    assert [result["unplanned_functional_after_backward"] for result in errors] == [None, None]


def test_an_error_in_the_backward_surfaces_in_the_caller_naming_its_microbatch(errors):
    for result in errors:
        kind, message, notes = result["raises"]
        assert (kind, message) == ("ValueError", "a hook failed on microbatch 1"), result["raises"]
        assert any("the backward of microbatch 1" in note for note in notes), notes


def test_a_second_collective_of_a_lane_node_is_refused_on_every_rank(errors):
    outcomes = [result["second_in_lane"] for result in errors]
    assert outcomes[0] == outcomes[1], outcomes
    message, notes = outcomes[0]
    assert message.startswith(
        "torch_ext: c10d::alltoall_base_ was not started: it is the second collective of a "
        "backward node declared with run_in_lane"
    ), message
    assert "in the backward of microbatch 0" in message, message
    assert any("the backward of microbatch 0" in note for note in notes), notes


def test_a_failed_backward_releases_a_lane_waiting_for_its_turn(errors):
    for result in errors:
        message, notes = result["abandoned"]
        assert message == "a lane node failed on microbatch 1", result["abandoned"]
        assert any("the backward of microbatch 1" in note for note in notes), notes
        assert "torch_ext-microbatch-backward" not in result["abandoned_threads_after"], result


def test_the_order_check_covers_the_overlap_rule(errors):
    messages = [result["rule_mismatch"] for result in errors]
    assert messages[0] == messages[1], messages
    assert "disagree on the microbatch overlap" in messages[0], messages[0]
    assert "rank 0: the backward of microbatch 1, the next forward's collectives waiting for the whole" in messages[0]
    assert "rank 1: the backward of microbatch 1, the next forward's collectives waiting for its planned" in messages[0]


def test_no_thread_is_left_behind(errors):
    for result in errors:
        for name in (
            "unplanned",
            "unplanned_after_backward",
            "unplanned_functional",
            "unplanned_functional_after_backward",
            "raises",
        ):
            assert "torch_ext-microbatch-backward" not in result[name + "_threads_after"], result


# -- PyTorch's functional all_to_all -------------------------------------------------------------------------

FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single


class FunctionalMoE(nn.Module):
    """``all_to_all_single_autograd`` (DTensor's and torchtitan's) for dispatch and combine. Its forward reaches
    c10d from the functional op's kernel, under autograd's fallback (the Autograd key excluded), where only the
    forward thread's op observer sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.25), nn.Tanh())
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        h = self.pre(tokens)
        dispatched = funcol.all_to_all_single_autograd(h, None, None, group)
        returned = funcol.all_to_all_single_autograd(self.expert(dispatched), None, None, group)
        return self.head(returned + self.dense(h))


def _train_functional(rank: int, overlapped: bool) -> dict:
    torch.manual_seed(0)
    model = FunctionalMoE()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    result: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        batches = [torch.randn(2 * TOKENS, DIM) for _ in range(MICROBATCHES)]
        with torch_ext.overlap_microbatches() if overlapped else contextlib.nullcontext() as overlap:
            for tokens in batches:
                loss = model(tokens).square().mean() / MICROBATCHES
                result["losses"].append(loss.detach())
                overlap.backward(loss) if overlapped else loss.backward()
        result["grads"].append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result


def _run_functional(rank: int) -> dict:
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    return {"stock": _train_functional(rank, False), "overlap": _train_functional(rank, True)}


def test_the_functional_all_to_all_overlaps_with_stock_bits(tmp_path_factory):
    results = run_ranks(_run_functional, tmp_path_factory.mktemp("microbatch_overlap_funcol"))
    for rank, result in enumerate(results):
        for what in ("losses", "grads", "params"):
            assert_identical(result["overlap"][what], result["stock"][what], f"rank {rank} {what}")


def test_twins_the_backward_issues_on_the_twin_beside_the_forward(bits):
    """Under beside_backward_collectives each group keeps one thread's order: the forward's collectives on the
    group, in program order, and the backward's on its twin, in the plan's; how the two interleave is left to
    timing (rank 1's backward is late by design)."""
    forward_per_microbatch, backward_per_microbatch = 6, 4
    for rank, result in enumerate(bits):
        stock, twins = result["twins"]["stock"], result["twins"]["overlap"]
        sequential = _sequential_order()
        for phase in ("F", "B"):
            issued = [entry[:2] for entry in twins["collectives"] if entry[0] == phase]
            assert issued == [entry for entry in sequential if entry[0] == phase], (rank, phase)
        assert all(on_forward_thread == (phase == "F") for phase, _, on_forward_thread in twins["collectives"])
        microbatches = MICROBATCHES * STEPS
        assert (stock["issued_on_group"], stock["issued_on_twin"]) == (
            (forward_per_microbatch + backward_per_microbatch) * microbatches,
            0,
        ), rank
        assert (twins["issued_on_group"], twins["issued_on_twin"]) == (
            forward_per_microbatch * microbatches,
            backward_per_microbatch * microbatches,
        ), rank
        # Without the rule, every collective stays on the group.
        assert result["plain"]["overlap"]["issued_on_twin"] == 0, rank
