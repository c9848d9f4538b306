"""Faults with communication in flight, on 2 gloo ranks: the surviving rank's backward raises, cleanly.

With a lane's collective (a synchronous all_to_all, declared with ``torch_ext.run_in_lane``) or one of
torch_ext's own collectives (its wait deferred to first use) in flight: a peer killed mid-backward, a user
hook that raises, a collective that times out. The surviving rank's backward must raise within the process
group's timeout with an error saying what happened, leave no thread running, and the engine must run the
next backward. A rank here may die on purpose, so these tests spawn their ranks themselves rather than
through ``_harness.run_ranks`` (which fails on any rank that does not return).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_ext
import torch_ext.ops

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
# Short: the point is that a rank raises within it, rather than waiting forever.
GROUP_TIMEOUT_S = 10
SPAWN_TIMEOUT_S = 90


class Exchange(torch.autograd.Function):
    """Megatron's _AllToAll in miniature, with a fault injected on one rank before its collective."""

    @staticmethod
    def forward(ctx, x, fault, rank):
        ctx.group, ctx.fault, ctx.rank = dist.group.WORLD, fault, rank
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if ctx.fault == "killed" and ctx.rank == 1:
            os._exit(0)  # the peer dies with its collective unissued
        if ctx.fault == "late" and ctx.rank == 1:
            time.sleep(GROUP_TIMEOUT_S + 3)
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return received, None, None


def _loss(fault: str, rank: int, through: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    if through == "lane":
        moe = Exchange.apply(x @ w, fault, rank)
    else:
        moe = torch_ext.ops.all_reduce(x @ w)
        if fault == "killed" and rank == 1:
            # Dies in backward, just before launching the all_reduce's backward.
            moe.grad_fn.register_prehook(lambda grads: os._exit(0))
    dense = x
    for _ in range(4):
        dense = torch.tanh(dense @ w)
    return moe.sum() + dense.sum(), [x, w]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(rank: int, port: int, fault: str, through: str, out_dir: str) -> None:
    def report(result: dict) -> None:
        # Whole or not at all: the parent reads what a rank left when it is gone.
        partial = os.path.join(out_dir, f"rank{rank}.partial")
        torch.save(result, partial)
        os.replace(partial, os.path.join(out_dir, f"rank{rank}.pt"))

    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
        torch_ext.run_in_lane(Exchange)
        loss, leaves = _loss(fault, rank, through)
        if fault == "hook" and rank == 0:
            # A dense node's hook raises while the collective is in flight.
            leaves[1].register_hook(lambda grad: (_ for _ in ()).throw(ValueError("user hook failed")))
        threads = _os_threads()
        start = time.monotonic()
        error = None
        try:
            with torch_ext.enabled():
                loss.backward()
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}\n{''.join(getattr(e, '__notes__', []))}"
        elapsed = time.monotonic() - start
        # The engine runs the next backward, a local one (the group may be broken).
        x = torch.randn(4, 4, requires_grad=True)
        (expected,) = torch.autograd.grad((x.tanh() * 3).sum(), x)
        with torch_ext.enabled():
            (x.tanh() * 3).sum().backward()
        reference = None
        if fault == "hook":
            # The group is intact here: stock's full backward of the same step, for the gradients that completed.
            reference_loss, reference_leaves = _loss("none", rank, through)
            reference_loss.backward()
            reference = [leaf.grad for leaf in reference_leaves]
        report(
            {
                "rank": rank,
                "error": error,
                "elapsed": elapsed,
                "threads_left": _os_threads() - threads,
                "next_backward": x.grad is not None and torch.equal(x.grad, expected),
                "grads": [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves],
                "reference": reference,
            }
        )
    except BaseException:  # noqa: BLE001 - a rank's crash goes to the test, whatever it was
        report({"rank": rank, "crash": traceback.format_exc()})
    finally:
        # Out without teardown: a peer may be gone, and its group with it.
        os._exit(0)


def _run(fault: str, through: str, out_dir) -> dict[int, dict]:
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [
        context.Process(target=_rank, args=(r, store.port, fault, through, str(out_dir))) for r in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=max(0.0, SPAWN_TIMEOUT_S))
        assert not any(p.is_alive() for p in ranks), f"a rank still ran after {SPAWN_TIMEOUT_S} s: a hang"
    finally:
        for process in ranks:
            process.kill()
            process.join()
    collected = {}
    for rank in range(WORLD_SIZE):
        path = out_dir / f"rank{rank}.pt"
        if path.exists():
            collected[rank] = torch.load(path)
            assert "crash" not in collected[rank], collected[rank]["crash"]
    return collected


@pytest.mark.parametrize("through", ["lane", "deferred_wait"])
def test_a_killed_peer_ends_the_survivors_backward_with_an_error(through, tmp_path):
    results = _run("killed", through, tmp_path)
    assert 1 not in results, "rank 1 was to die in its backward"
    survivor = results[0]
    assert survivor["error"] is not None, "rank 0's backward returned with its peer dead"
    assert survivor["elapsed"] < GROUP_TIMEOUT_S + 5, survivor
    assert survivor["threads_left"] <= 0 and survivor["next_backward"], survivor
    if through == "lane":
        assert "ExchangeBackward" in survivor["error"]  # the note naming the lane's node


def test_a_hook_that_raises_while_the_lane_is_in_flight(tmp_path):
    results = _run("hook", "lane", tmp_path)
    failed, peer = results[0], results[1]
    assert failed["error"].startswith("ValueError: user hook failed"), failed["error"]
    # The lane's collective had started on rank 0 and finished with its peer's: rank 1's backward completed.
    assert peer["error"] is None, peer["error"]
    assert failed["threads_left"] <= 0 and failed["next_backward"]
    # Every gradient rank 0 accumulated before the error is stock's full backward's, bit for bit.
    completed = [
        (ours, stock) for ours, stock in zip(failed["grads"], failed["reference"], strict=True) if ours is not None
    ]
    assert completed, "no gradient completed before the hook's error"
    assert all(torch.equal(ours, stock) for ours, stock in completed)


def test_a_collective_that_times_out_raises_within_the_group_timeout(tmp_path):
    results = _run("late", "lane", tmp_path)
    early = results[0]
    assert early["error"] is not None and early["elapsed"] < GROUP_TIMEOUT_S + 5, early
    assert "ExchangeBackward" in early["error"], early["error"]
    assert early["threads_left"] <= 0 and early["next_backward"], early
