"""Four gloo ranks, expert parallel 2 x data parallel 2: a lane, DDP and the collective order check together.

Expert-parallel (EP) groups {0, 1} and {2, 3}, data-parallel (DP) groups {0, 2} and {1, 3}, made with
``dist.new_group`` on every rank in the same order. Each rank's MoE layer has two expert branches (top-2
routing, each choice dispatched by an all_to_all of its own); each branch dispatches the rank's tokens to the
experts of its EP group and combines them back through DeepSpeed's real ``_AllToAll``, declared to a lane. So
in backward each EP group starts four all_to_alls of one shape, and the two combines are independent: the
engine may start either first, and a priority changes which. A dense path beside them is wrapped in
DistributedDataParallel on the rank's DP group (DDP on another group than the lane's is allowed). The order
check is on: once per backward the members of each EP group compare that group's collectives over its mirror.

- A few AdamW steps on torch_ext give stock's bits on every rank: every loss, gradient and parameter.
- Rank 3 alone starts its EP group's two combines in the opposite order: ranks 2 and 3 raise the same error
  before any collective of that backward starts (unchecked, they get silently wrong gradients), ranks 0 and 1,
  whose EP group agrees, finish that backward with stock's bits, and the next backward, agreeing, gives
  stock's bits. DDP skips its all_reduce in these backwards (``no_sync``): ranks 0 and 1 would otherwise wait
  for ranks 2 and 3 in it, until the DP groups' timeout (tests/distributed/test_eight_ranks.py shows that).
- Rank 2 killed in its expert's backward, before its dispatch's all_to_all: the other three raise gloo's error
  within the groups' timeout, and nothing hangs.

Cases 1 and 2 share one spawn of four ranks (``_harness.run_ranks``); case 3 breaks its groups, so it runs in a
spawn of its own through test_faults' runner, which expects a rank to die.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    assert_identical,
    assert_torch_ext_matches_stock,
    node_threads,
    parameter_grads,
    ran_on_torch_ext,
    rank_batch,
    run_ranks,
    train_steps,
)
from test_faults import _run as run_with_a_fault
from test_faults import report_rank_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_ext

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and importlib.util.find_spec("deepspeed.moe")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed==0.19.8)"),
]

WORLD_SIZE = 4
EP_GROUPS = ([0, 1], [2, 3])
DP_GROUPS = ([0, 2], [1, 3])
DIM = 8
# Tokens each rank sends each expert of its EP group (a fixed capacity: equal splits).
CAPACITY = 3
TOKENS = len(EP_GROUPS[0]) * CAPACITY
CHOICES = 2
STEPS = 3
# The rank that starts its combines in the opposite order, and the step whose batch that backward uses.
DIVERGING_RANK = 3
SWAP_STEP = 7
AUTOMATIC_COLLECTIVE_PRIORITY = 2**62
# The killed rank, and the step in whose backward it dies.
KILLED_RANK = 2
KILL_STEP = 1
# The groups' and the order check's timeout: a group left out of step fails within it instead of hanging.
LAYOUT_TIMEOUT = datetime.timedelta(seconds=20)
# Shorter where a rank dies: the point is that every survivor raises within it, rather than waiting forever.
GROUP_TIMEOUT_S = 10
GLOO_ERROR = re.compile(r"Connection (reset|closed) by peer|Timed out")


def _groups(rank: int, timeout: datetime.timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's EP and DP groups. Every rank makes every group, in the same order."""
    options = {} if timeout is None else {"timeout": timeout}
    ep_groups = [dist.new_group(ranks, **options) for ranks in EP_GROUPS]
    dp_groups = [dist.new_group(ranks, **options) for ranks in DP_GROUPS]
    return ep_groups[rank // 2], dp_groups[rank % 2]


def _all_to_all():
    """DeepSpeed's ``_AllToAll`` (deepspeed.moe.sharded_moe), declared to a lane; deepspeed.comm adopts the
    process group already made."""
    import deepspeed.comm
    from deepspeed.moe.sharded_moe import _AllToAll

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch_ext.run_in_lane(_AllToAll)
    return _AllToAll


class ExpertParallelLayer(nn.Module):
    """Gate; per choice, tokens dispatched over the EP group to its experts, the expert, combined back; a dense
    path in DDP on the DP group; a head."""

    def __init__(self, rank: int, ep_group, dp_group) -> None:
        super().__init__()
        self.ep_group = ep_group
        self.all_to_all = _all_to_all()
        torch.manual_seed(0)
        # The layer's input comes from a layer before it, as in a model: the dispatches have a backward too.
        self.embed = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, CHOICES)
        dense = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())
        self.dense = DistributedDataParallel(dense, process_group=dp_group)
        self.head = nn.Linear(DIM, 1)
        # Each rank holds its own experts (its EP group's index decides them; DP replicas start equal).
        torch.manual_seed(1 + rank % 2)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(CHOICES)
        )
        # The last forward's combined outputs and expert outputs, one per choice.
        self.combined: list[torch.Tensor] = []
        self.expert_outputs: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(tokens)
        weights = torch.softmax(self.gate(tokens), dim=-1)
        out = self.dense(tokens)
        self.combined, self.expert_outputs = [], []
        for choice, expert in enumerate(self.experts):
            # Each choice routes the tokens differently.
            dispatched = self.all_to_all.apply(self.ep_group, tokens.roll(choice, dims=0))
            expert_output = expert(dispatched)
            combined = self.all_to_all.apply(self.ep_group, expert_output)
            self.expert_outputs.append(expert_output)
            self.combined.append(combined)
            out = out + combined * weights[:, choice : choice + 1]
        return self.head(out)


def _train(rank: int, groups, on_torch_ext: bool) -> dict:
    """STEPS AdamW steps from the same initial state on either engine: every loss, gradient and parameter, and
    the threads the first backward ran its all_to_alls and dense nodes on."""

    def first_backward(events) -> dict:
        threads = node_threads(events, lambda name: name.endswith("_AllToAllBackward"))
        return {"driver_ran": ran_on_torch_ext(events), "threads": threads}

    batch = lambda step: rank_batch(rank, step, TOKENS, DIM)
    return train_steps(ExpertParallelLayer(rank, *groups), batch, STEPS, on_torch_ext, first_backward)


def _swap_step(rank: int, groups, diverge: bool, on_torch_ext: bool) -> dict:
    """One backward of a fresh layer, the combines given priorities: with ``diverge``, reversed on rank 3 only."""
    model = ExpertParallelLayer(rank, *groups)
    tokens, target = rank_batch(rank, SWAP_STEP, TOKENS, DIM)
    # No DP all_reduce in this backward (DDP decides in forward): a rank of the agreeing EP group would wait in it
    # for a raising one.
    with model.dense.no_sync():
        loss = F.mse_loss(model(tokens), target)
    first, second = model.combined
    if diverge and rank == DIVERGING_RANK:
        first, second = second, first
    # Above the automatic collective priority (2**62), which the combines also get from the dispatches behind them.
    torch_ext.set_priority(first, AUTOMATIC_COLLECTIVE_PRIORITY + 2)
    torch_ext.set_priority(second, AUTOMATIC_COLLECTIVE_PRIORITY + 1)
    try:
        with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
            loss.backward()
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None, "loss": loss.detach(), "grads": parameter_grads(model)}


def _divergence_cases(rank: int, groups) -> dict:
    """Stock's backward, the divergence unchecked and checked, then an agreeing backward; the first unexpected
    error (a group left out of step hangs until its timeout) ends them, reported as ``"failure"``."""
    results = {"swap_stock": _swap_step(rank, groups, diverge=False, on_torch_ext=False)}
    try:
        # Unchecked first: it issues every collective on every rank (mispaired), so the groups stay in step.
        torch_ext.check_collective_order(False)
        results["swap_unchecked"] = _swap_step(rank, groups, diverge=True, on_torch_ext=True)
        torch_ext.check_collective_order(timeout=LAYOUT_TIMEOUT)
        results["swap"] = _swap_step(rank, groups, diverge=True, on_torch_ext=True)
        results["swap_after"] = _swap_step(rank, groups, diverge=False, on_torch_ext=True)
    except RuntimeError:
        results["failure"] = traceback.format_exc()
    return results


def _run_on_four_ranks(rank: int) -> dict:
    groups = _groups(rank, LAYOUT_TIMEOUT)
    torch_ext.check_collective_order(timeout=LAYOUT_TIMEOUT)
    try:
        results = {"train": {"stock": _train(rank, groups, False), "torch_ext": _train(rank, groups, True)}}
        results["checks"] = torch_ext.debug.collective_check_count()
        results.update(_divergence_cases(rank, groups))
    finally:
        torch_ext.check_collective_order(False)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run_on_four_ranks, tmp_path_factory.mktemp("four_ranks"), world_size=WORLD_SIZE)


def test_ep2_dp2_trains_with_stock_bits(results):
    for rank, result in enumerate(results):
        # The lane ran the all_to_alls on a thread of their own, beside the matmuls on the engine's.
        result["train"]["stock"].pop("threads")
        threads = result["train"]["torch_ext"].pop("threads")
        assert threads["all_to_all"] and threads["dense"], (rank, threads)
        assert not threads["all_to_all"] & threads["dense"], (rank, threads)
        # The order check compared every backward's collectives.
        assert result["checks"] >= STEPS, (rank, result["checks"])
    # Every loss, gradient (after every step) and final parameter, bit for bit; the backward ran on torch_ext.
    assert_torch_ext_matches_stock(results, "train")
    # DDP averaged the dense path's gradients over each DP group (the ranks saw different data); the experts'
    # stayed each rank's own.
    for first, second in DP_GROUPS:
        ours, theirs = (results[rank]["train"]["torch_ext"] for rank in (first, second))
        assert ours["losses"] != theirs["losses"]
        for step in range(STEPS):
            dense = {name: grad for name, grad in ours["grads"][step].items() if name.startswith("dense.")}
            assert dense, ours["grads"][step].keys()
            assert_identical({name: theirs["grads"][step][name] for name in dense}, dense, f"step {step}")
            assert not torch.equal(
                ours["grads"][step]["experts.0.0.weight"], theirs["grads"][step]["experts.0.0.weight"]
            )


def test_a_divergence_on_one_rank_raises_in_its_ep_group_only(results):
    assert all("swap" in result for result in results), [result.get("failure") for result in results]
    messages = [result["swap"]["error"] for result in results]
    # Ranks 0 and 1 compared over their own EP group's mirror, which agrees: that backward gave stock's bits.
    for rank in (0, 1):
        assert messages[rank] is None, (rank, messages[rank])
        assert_identical(results[rank]["swap"], results[rank]["swap_stock"], f"rank {rank}")
    # Both members of the disagreeing group saw each other's sequence: the same message on both.
    assert messages[2] is not None and messages[2] == messages[3], messages
    message = messages[2]
    # The pair that disagrees, on the EP group it shares.
    assert "the ranks disagree on collective #0 of this backward on the groups ranks 2 and 3 share" in message, message
    assert "rank 0:" not in message and "rank 1:" not in message, message
    lines = message.splitlines()
    first = {rank: next(line for line in lines if line.startswith(f"  rank {rank}: #0")) for rank in (2, 3)}
    # Same kind and shape on both; rank 3 starts the other combine.
    assert first[2].removeprefix("  rank 2") != first[3].removeprefix("  rank 3"), first
    for rank in (2, 3):
        assert "_AllToAllBackward" in first[rank] and f"float32[{TOKENS}, {DIM}]" in first[rank], first
        assert "on ranks [2, 3]" in first[rank], first


def test_the_next_backward_after_the_divergence_gives_stock_bits(results):
    for rank, result in enumerate(results):
        assert "failure" not in result, f"rank {rank}: {result['failure']}"
        after = result["swap_after"]
        assert after["error"] is None, (rank, after["error"])
        assert_identical(after, result["swap_stock"], f"rank {rank}")


def test_unchecked_the_divergence_silently_corrupts_one_ep_group(results):
    """Why the check must catch it: unchecked, nothing hangs or raises, and gloo pairs rank 2's first combine
    with rank 3's second. The other EP group, and DDP's dense gradients, are untouched."""
    wrong = []
    for rank, result in enumerate(results):
        unchecked = result["swap_unchecked"]
        assert unchecked["error"] is None, (rank, unchecked["error"])
        stock = result["swap_stock"]["grads"]
        wrong.append(sorted(name for name, grad in unchecked["grads"].items() if not torch.equal(grad, stock[name])))
    assert wrong[0] == wrong[1] == [], wrong
    for names in wrong[2:]:
        assert names and all(name.startswith(("experts.", "embed.")) for name in names), wrong


def _killed_rank(rank: int, port: int, fault: str, through: str, out_dir: str) -> None:
    """One rank of test_faults' runner (``fault`` and ``through`` unused): trains STEPS steps on torch_ext; rank 2
    dies in KILL_STEP's backward, in its expert's backward node, before its dispatch's all_to_all. Each survivor
    reports the first error it meets and when."""

    def report(result: dict) -> None:
        report_rank_result(out_dir, rank, result)

    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
        groups = _groups(rank, timeout)
        torch_ext.check_collective_order(timeout=timeout)
        model = ExpertParallelLayer(rank, *groups)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        error, failed_in, start = None, None, None
        for step in range(STEPS):
            if step == KILL_STEP:
                start = time.monotonic()
            phase = "forward"
            try:
                tokens, target = rank_batch(rank, step, TOKENS, DIM)
                optimizer.zero_grad()
                loss = F.mse_loss(model(tokens), target)
                if step == KILL_STEP and rank == KILLED_RANK:
                    model.expert_outputs[0].grad_fn.register_prehook(lambda grads: os._exit(1))
                phase = "backward"
                with torch_ext.enable():
                    loss.backward()
                optimizer.step()
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = f"{type(e).__name__}: {e}\n{''.join(getattr(e, '__notes__', []))}"
                failed_in = (step, phase)
                break
        elapsed = None if start is None else time.monotonic() - start
        # The engine runs the next backward, a local one (the groups are broken).
        x = torch.randn(4, 4, requires_grad=True)
        (expected,) = torch.autograd.grad((x.tanh() * 3).sum(), x)
        with torch_ext.enable():
            (x.tanh() * 3).sum().backward()
        report(
            {
                "error": error,
                "failed_in": failed_in,
                "elapsed": elapsed,
                "next_backward": x.grad is not None and torch.equal(x.grad, expected),
            }
        )
    except BaseException:  # noqa: BLE001 - a rank's crash goes to the test, whatever it was
        report({"crash": traceback.format_exc()})
    finally:
        # Out without teardown: a peer is gone, and its groups with it.
        os._exit(0)


def test_a_rank_killed_mid_backward_ends_the_other_three_with_an_error(tmp_path):
    reports = run_with_a_fault("killed", "lane", tmp_path, world_size=WORLD_SIZE, rank_main=_killed_rank)
    assert sorted(reports) == [rank for rank in range(WORLD_SIZE) if rank != KILLED_RANK], reports
    for rank, report in reports.items():
        assert report["error"] is not None, f"rank {rank} trained on with rank {KILLED_RANK} dead: {report}"
        assert GLOO_ERROR.search(report["error"]), (rank, report["error"])
        # Rank 3 (its EP peer) in that backward; ranks 0 and 1 may finish it (their collectives there did not need
        # rank 2 any more), and then meet it gone (or rank 3 left) in the next backward's DDP all_reduce.
        assert KILL_STEP <= report["failed_in"][0] <= KILL_STEP + 1, (rank, report)
        assert report["elapsed"] < GROUP_TIMEOUT_S + 5, (rank, report)
        assert report["next_backward"], (rank, report)
    # Rank 3 waited for rank 2 in its lane's all_to_all; the error carries the note naming that node.
    peer = reports[3]
    assert peer["failed_in"] == (KILL_STEP, "backward"), peer
    assert "_AllToAllBackward" in peer["error"], peer["error"]
