"""Eight gloo ranks, expert parallel 4 x data parallel 2: the collective order check within each group.

Expert-parallel (EP) groups {0..3} and {4..7}, data-parallel (DP) groups {0, 4}, {1, 5}, {2, 6}, {3, 7}, made
with ``dist.new_group`` on every rank in the same order. Each rank's layer dispatches its tokens over its EP
group twice (two expert branches) and combines them back, each all_to_all an autograd Function declared to a
lane; a dense path beside them is wrapped in DistributedDataParallel on the rank's DP group. The order check
is on from the environment (``TORCH_EXT_CHECK_COLLECTIVES=1``, read at import, before the process group
exists), so the groups' mirrors are made at the first checked backward. Each backward's check then exchanges
over the rank's EP group's mirror only: four ranks, 16 bytes.

- Agreeing ranks: a few AdamW steps give stock's bits on all eight ranks; each backward made one exchange of
  16 bytes, over the EP group.
- A swap in one EP group (rank 7 starts its two combines in the opposite order), DDP not reducing in that
  backward (``no_sync``): ranks 4 to 7 raise the same error naming ranks 4 and 7; ranks 0 to 3, whose group
  agrees, finish that backward with stock's bits; the next backward, agreeing, gives stock's bits everywhere.
- A straggler: rank 4 starts a backward 2 s late, in a layer whose backward plans collectives on both groups
  (the EP all_to_alls, then torch_ext's own all_reduce on the DP group). Ranks 0 to 3 finish all their EP
  all_to_alls before rank 4 starts: a collective awaits only its own group's verdict.
- The same swap with DDP reducing: ranks 0 to 3 pass their check and wait in DDP's all_reduce for their DP
  peer, which raised. They end with gloo's timeout error within the DP groups' timeout, never a hang.
- Rank 5 killed in its backward (a spawn of its own through test_faults' runner): ranks 4, 6 and 7 end with
  the exchange's error (the check's note naming the EP group's mirror) or their all_to_all's; ranks 0 to 3 with
  gloo's error in DDP's all_reduce; all within the groups' timeout.
"""

from __future__ import annotations

import contextlib
import datetime
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
    parameter_grads,
    rank_batch,
    run_ranks,
    train_steps,
)
from test_faults import _run as run_with_a_fault
from test_faults import report_rank_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_ext
import torch_ext.ops
from torch_ext._loader import CHECK_COLLECTIVES_VARIABLE
from torch_ext.collectives import order_check

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD_SIZE = 8
EP = 4
EP_GROUPS = ([0, 1, 2, 3], [4, 5, 6, 7])
DP_GROUPS = ([0, 4], [1, 5], [2, 6], [3, 7])
DIM = 4
TOKENS = EP  # one token for each expert of the EP group
STEPS = 3
DIVERGING_RANK = 7
SWAP_STEP = 7
AUTOMATIC_COLLECTIVE_PRIORITY = 2**62
KILLED_RANK = 5
# The rank that starts a backward late, and by how much.
STRAGGLER = 4
STRAGGLE_S = 2.0
# The DP groups' timeout: where a DP peer raised or died, a rank waiting for it in DDP's all_reduce fails within
# it. The EP groups and the check keep the harness's (a loaded 2-core machine runs eight ranks).
DP_TIMEOUT_S = 8
GLOO_ERROR = re.compile(r"Connection (reset|closed) by peer|Timed out")


class GroupAllToAll(torch.autograd.Function):
    """An all_to_all over ``group``, synchronous in forward and in backward, as Megatron-core's ``_AllToAll``
    (``ctx.group``: what a lane and the order check read)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x.contiguous(), group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return None, received


def _groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's EP and DP groups. Every rank makes every group, in the same order."""
    ep_groups = [dist.new_group(ranks) for ranks in EP_GROUPS]
    dp_groups = [dist.new_group(ranks, timeout=datetime.timedelta(seconds=DP_TIMEOUT_S)) for ranks in DP_GROUPS]
    return ep_groups[rank // EP], dp_groups[rank % EP]


class ExpertParallelLayer(nn.Module):
    """Per branch: dispatch over the EP group, the rank's expert, combine back; a dense path in DDP on the DP
    group; a head."""

    def __init__(self, rank: int, ep_group, dp_group) -> None:
        super().__init__()
        self.ep_group = ep_group
        torch.manual_seed(0)
        self.embed = nn.Linear(DIM, DIM)
        self.dense = DistributedDataParallel(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()), process_group=dp_group)
        self.head = nn.Linear(DIM, 1)
        torch.manual_seed(1 + rank % EP)  # each rank of an EP group holds its own experts; DP replicas alike
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.combined: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(tokens)
        out = self.dense(tokens)
        self.combined = []
        for branch, expert in enumerate(self.experts):
            dispatched = GroupAllToAll.apply(self.ep_group, tokens.roll(branch, dims=0))
            combined = GroupAllToAll.apply(self.ep_group, expert(dispatched).tanh())
            self.combined.append(combined)
            out = out + combined
        return self.head(out)


# When each of this rank's EP all_to_alls finished in backward (time.time(), comparable across the ranks of one
# machine).
ep_backward_done: list[float] = []


class TimedAllToAll(GroupAllToAll):
    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = GroupAllToAll.backward(ctx, grad)
        ep_backward_done.append(time.time())
        return received


class DataParallelLayer(nn.Module):
    """A layer whose backward plans collectives on two groups: the experts' all_to_alls on the EP group, then,
    last, torch_ext's own all_reduce on the DP group (of the embedding's output gradient). No DDP: its hooks
    would await every group's verdict."""

    def __init__(self, rank: int, ep_group, dp_group) -> None:
        super().__init__()
        self.ep_group, self.dp_group = ep_group, dp_group
        torch.manual_seed(0)
        self.embed = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)
        torch.manual_seed(1 + rank % EP)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch_ext.ops.all_reduce(self.embed(tokens), group=self.dp_group)
        out = tokens
        for branch, expert in enumerate(self.experts):
            dispatched = TimedAllToAll.apply(self.ep_group, tokens.roll(branch, dims=0))
            out = out + TimedAllToAll.apply(self.ep_group, expert(dispatched).tanh())
        return self.head(out)


def _straggler_step(rank: int, groups) -> dict:
    """One backward of DataParallelLayer, rank 4 starting it STRAGGLE_S late: when it started, and when this
    rank's EP all_to_alls finished."""
    model = DataParallelLayer(rank, *groups)
    tokens, target = rank_batch(rank, SWAP_STEP, TOKENS, DIM)
    loss = F.mse_loss(model(tokens), target)
    if rank == STRAGGLER:
        time.sleep(STRAGGLE_S)
    ep_backward_done.clear()
    started = time.time()
    with torch_ext.enable():
        loss.backward()
    return {"started": started, "ep_done": list(ep_backward_done)}


def _train(rank: int, groups, on_torch_ext: bool) -> dict:
    return train_steps(
        ExpertParallelLayer(rank, *groups), lambda step: rank_batch(rank, step, TOKENS, DIM), STEPS, on_torch_ext
    )


def _swap_step(rank: int, groups, diverge: bool, reduce: bool, on_torch_ext: bool = True) -> dict:
    """One backward of a fresh layer, the combines given priorities: with ``diverge``, reversed on rank 7 only;
    with ``reduce``, DDP reduces the dense path's gradients in it."""
    model = ExpertParallelLayer(rank, *groups)
    tokens, target = rank_batch(rank, SWAP_STEP, TOKENS, DIM)
    with contextlib.nullcontext() if reduce else model.dense.no_sync():
        loss = F.mse_loss(model(tokens), target)
    first, second = model.combined
    if diverge and rank == DIVERGING_RANK:
        first, second = second, first
    torch_ext.set_priority(first, AUTOMATIC_COLLECTIVE_PRIORITY + 2)
    torch_ext.set_priority(second, AUTOMATIC_COLLECTIVE_PRIORITY + 1)
    start = time.monotonic()
    try:
        with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
            loss.backward()
    except RuntimeError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None, "loss": loss.detach(), "grads": parameter_grads(model)}


def _run_on_eight_ranks(rank: int) -> dict:
    torch_ext.run_in_lane(GroupAllToAll, TimedAllToAll)
    groups = _groups(rank)
    results: dict = {"train": {"stock": _train(rank, groups, False), "torch_ext": _train(rank, groups, True)}}
    checker = order_check._checker
    results["checked"] = {"exchanges": checker.exchanges, "bytes": checker.bytes_sent}
    results["swap_stock"] = _swap_step(rank, groups, diverge=False, reduce=False, on_torch_ext=False)
    results["swap"] = _swap_step(rank, groups, diverge=True, reduce=False)
    results["swap_after"] = _swap_step(rank, groups, diverge=False, reduce=False)
    results["straggler"] = _straggler_step(rank, groups)
    # Last: it leaves the DP groups out of step.
    results["swap_reducing"] = _swap_step(rank, groups, diverge=True, reduce=True)
    # The raising ranks stay until the others have met their timeout (gone, they would close the connections).
    store = dist.distributed_c10d._get_default_store()
    if rank < EP:
        store.add("met_the_raising_ranks", 1)
    while int(store.add("met_the_raising_ranks", 0)) < EP:
        time.sleep(0.1)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(
        _run_on_eight_ranks,
        tmp_path_factory.mktemp("eight_ranks"),
        world_size=WORLD_SIZE,
        env={CHECK_COLLECTIVES_VARIABLE: "1"},
        timeout_s=240,
    )


def test_ep4_dp2_trains_with_stock_bits_checked_within_each_ep_group(results):
    assert_torch_ext_matches_stock(results, "train")
    for rank, result in enumerate(results):
        # One exchange a backward, over the EP group's mirror only: one 16-byte digest pair, whatever the world.
        assert result["checked"] == {"exchanges": STEPS, "bytes": 16 * STEPS}, (rank, result["checked"])


def test_a_swap_in_one_ep_group_raises_there_only(results):
    messages = [result["swap"]["error"] for result in results]
    for rank in range(EP):
        assert messages[rank] is None, (rank, messages[rank])
        assert_identical(
            {k: results[rank]["swap"][k] for k in ("loss", "grads")},
            {k: results[rank]["swap_stock"][k] for k in ("loss", "grads")},
            f"rank {rank}",
        )
    assert len(set(messages[EP:])) == 1 and messages[EP] is not None, messages
    message = messages[EP]
    assert "the ranks disagree on collective #0 of this backward on the groups ranks 4 and 7 share" in message, message
    assert "GroupAllToAllBackward" in message and "on ranks [4, 5, 6, 7]" in message, message


def test_the_next_backward_after_the_swap_gives_stock_bits(results):
    for rank, result in enumerate(results):
        assert result["swap_after"]["error"] is None, (rank, result["swap_after"]["error"])
        assert_identical(
            {k: result["swap_after"][k] for k in ("loss", "grads")},
            {k: result["swap_stock"][k] for k in ("loss", "grads")},
            f"rank {rank}",
        )


def test_a_straggler_in_one_ep_group_does_not_hold_up_the_other_ep_groups_collectives(results):
    """Rank 4 starts its backward late. Ranks 0 to 3 share only their DP groups with it: their EP all_to_alls
    need only their EP group's verdict, so they all finish before rank 4 even starts; only the DP all_reduce,
    last, waits for it. (Awaiting every verdict before the first collective, or one exchange over the world,
    would hold them until rank 4 arrives.)"""
    straggler_started = results[STRAGGLER]["straggler"]["started"]
    for rank in range(EP):
        done = results[rank]["straggler"]["ep_done"]
        assert len(done) == 4, (rank, done)
        assert max(done) < straggler_started, (rank, straggler_started - max(done))


def test_ranks_outside_the_disagreeing_group_end_in_a_timeout_not_a_hang(results):
    for rank in range(EP, WORLD_SIZE):
        assert "the ranks disagree on collective #0" in results[rank]["swap_reducing"]["error"], rank
    for rank in range(EP):
        outcome = results[rank]["swap_reducing"]
        # Their EP group agreed; DDP's all_reduce waited for a DP peer that had raised, until the DP group's timeout.
        assert outcome["error"] is not None and "Timed out" in outcome["error"], (rank, outcome)
        assert DP_TIMEOUT_S - 1 < outcome["elapsed"] < DP_TIMEOUT_S + 10, (rank, outcome)


def _killed_rank(rank: int, port: int, fault: str, through: str, out_dir: str) -> None:
    """One rank of test_faults' runner (``fault`` and ``through`` unused): the check on, one agreeing step, then
    rank 5 dies in the next backward, in its first combine's backward, before any all_to_all of it. Each
    survivor reports the first error it meets, in which step, and how long after that step began (a rank whose
    collectives in that step no longer needed rank 5 meets the broken groups in the next)."""
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # Eight ranks start on two cores: they meet in the store within a minute, then every group gives up on a
        # peer within DP_TIMEOUT_S.
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
        torch_ext.run_in_lane(GroupAllToAll)
        timeout = datetime.timedelta(seconds=DP_TIMEOUT_S)
        ep_group = [dist.new_group(ranks, timeout=timeout) for ranks in EP_GROUPS][rank // EP]
        dp_group = [dist.new_group(ranks, timeout=timeout) for ranks in DP_GROUPS][rank % EP]
        torch_ext.check_collective_order()
        model = ExpertParallelLayer(rank, ep_group, dp_group)
        error, failed_in, elapsed = None, None, None
        for step in range(STEPS):
            start = time.monotonic()
            try:
                tokens, target = rank_batch(rank, step, TOKENS, DIM)
                loss = F.mse_loss(model(tokens), target)
                if step == 1 and rank == KILLED_RANK:
                    model.combined[0].grad_fn.register_prehook(lambda grads: os._exit(1))
                with torch_ext.enable():
                    loss.backward()
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = f"{type(e).__name__}: {e}\n{''.join(getattr(e, '__notes__', []))}"
                failed_in, elapsed = step, time.monotonic() - start
                break
        report_rank_result(out_dir, rank, {"error": error, "failed_in": failed_in, "elapsed": elapsed})
    except BaseException:  # noqa: BLE001 - a rank's crash goes to the test, whatever it was
        report_rank_result(out_dir, rank, {"crash": traceback.format_exc()})
    finally:
        os._exit(0)  # without teardown: a peer is gone, and its groups with it


def test_a_rank_killed_ends_every_other_rank_with_an_error_within_the_timeout(tmp_path):
    reports = run_with_a_fault("killed", "lane", tmp_path, world_size=WORLD_SIZE, rank_main=_killed_rank)
    assert sorted(reports) == [rank for rank in range(WORLD_SIZE) if rank != KILLED_RANK], reports
    for rank, report in reports.items():
        assert report["failed_in"] in (1, 2), (rank, report)
        assert GLOO_ERROR.search(report["error"]), (rank, report["error"])
        assert report["elapsed"] < DP_TIMEOUT_S + 10, (rank, report)
