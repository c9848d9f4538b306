"""Faults with communication in flight, on 2 gloo ranks: the surviving rank's backward raises, cleanly.

With a lane's collective (a synchronous all_to_all, declared with ``torch_ext.run_in_lane``), one of
torch_ext's own collectives (its wait deferred to first use) or TorchRec's pooled all_to_all (its real
Req/Wait pair of autograd Functions: in backward the Wait's node launches, the Req's node waits, and
torch_ext runs the dense chain between them) in flight: a peer killed mid-backward, a user hook that
raises, a collective that times out. The surviving rank's backward must raise within the process group's
timeout with an error saying what happened, leave no thread running, and the engine must run the next
backward. A rank here may die on purpose, so these tests spawn their ranks themselves rather than
through ``_harness.run_ranks`` (which fails on any rank that does not return).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_ext
import torch_ext.ops

HAS_TORCHREC = all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))
TORCHREC = pytest.param(
    "torchrec", marks=pytest.mark.skipif(not HAS_TORCHREC, reason="TorchRec is not installed (README, 'TorchRec')")
)

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
# Short: the point is that a rank raises within it, rather than waiting forever.
GROUP_TIMEOUT_S = 10
SPAWN_TIMEOUT_S = 90
# The frame TorchRec's all_to_all waits in, in backward: All2All_Pooled_Req.backward (torchrec/distributed/comm_ops.py).
TORCHREC_WAIT = ("comm_ops.py", "backward", "myreq.req.wait()")


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


def _torchrec_all_to_all(pooled: torch.Tensor, fault: str, rank: int) -> tuple[torch.Tensor, list]:
    """TorchRec's pooled all_to_all (comm_ops.alltoall_pooled), its real All2All_Pooled_Req/_Wait pair.

    Returns the exchanged tensor and its backward's launch and wait nodes, labelled. ``pooled`` is
    (sum of the batches, this rank's embedding dims); the result (this rank's batch, every rank's dims).
    """
    from torchrec.distributed.comm_ops import alltoall_pooled

    batch, dims = pooled.shape
    exchanged = alltoall_pooled(pooled, [batch // WORLD_SIZE] * WORLD_SIZE, [dims] * WORLD_SIZE).wait()
    launch = exchanged.grad_fn  # All2All_Pooled_WaitBackward: starts the gradient's all_to_all
    (wait,) = [node for node, _ in launch.next_functions if node is not None]  # All2All_Pooled_ReqBackward
    assert (launch.name(), wait.name()) == ("All2All_Pooled_WaitBackward", "All2All_Pooled_ReqBackward")
    if fault == "killed" and rank == 1:
        # Dies in backward with its all_to_all unissued, rank 0's already launched.
        launch.register_prehook(lambda grads: os._exit(0))
    if fault == "late" and rank == 1:
        launch.register_prehook(lambda grads: time.sleep(GROUP_TIMEOUT_S + 3))
    return exchanged, [("launch", launch), ("wait", wait)]


def _dense_leaves() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(16, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def _dense_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dense = x
    for _ in range(4):
        dense = torch.tanh(dense @ w)
    return dense


def _stock_dense_grads() -> list[torch.Tensor]:
    """Stock's gradients of x and w through the dense chain alone: the TorchRec loss's, whose all_to_all reads neither."""
    x, w = _dense_leaves()
    return list(torch.autograd.grad(_dense_chain(x, w).sum(), [x, w]))


def _loss(fault: str, rank: int, through: str) -> tuple[torch.Tensor, list[torch.Tensor], list]:
    """The loss, its leaves, and (TorchRec's) its collective's backward nodes, labelled."""
    x, w = _dense_leaves()
    leaves, nodes = [x, w], []
    if through == "lane":
        moe = Exchange.apply(x @ w, fault, rank)
    elif through == "deferred_wait":
        moe = torch_ext.ops.all_reduce(x @ w)
        if fault == "killed" and rank == 1:
            # Dies in backward, just before launching the all_reduce's backward.
            moe.grad_fn.register_prehook(lambda grads: os._exit(0))
    else:
        # An embedding table of its own: x and w complete in the dense chain, while the all_to_all is in flight.
        table = torch.randn(16, 8, requires_grad=True)
        leaves.append(table)
        moe, nodes = _torchrec_all_to_all(table.exp(), fault, rank)
    return moe.sum() + _dense_chain(x, w).sum(), leaves, nodes


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def report_rank_result(out_dir: str, rank: int, result: dict) -> None:
    """Leaves ``result`` for the parent, whole or not at all: it reads what a rank left when it is gone."""
    partial = os.path.join(out_dir, f"rank{rank}.partial")
    torch.save(result, partial)
    os.replace(partial, os.path.join(out_dir, f"rank{rank}.pt"))


def _rank(rank: int, port: int, fault: str, through: str, out_dir: str) -> None:
    def report(result: dict) -> None:
        report_rank_result(out_dir, rank, result)

    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
        torch_ext.run_in_lane(Exchange)
        loss, leaves, nodes = _loss(fault, rank, through)
        # The collective's launch and wait nodes and w's gradient hook (after the dense chain), as they ran.
        order = []
        for label, node in nodes:
            node.register_prehook(lambda grads, label=label: order.append(label))

        def w_hook(grad):
            order.append("w")
            if fault == "hook" and rank == 0:
                # A dense node's hook raises while the collective is in flight.
                raise ValueError("user hook failed")

        leaves[1].register_hook(w_hook)
        threads = _os_threads()
        start = time.monotonic()
        error, raised_in = None, []
        try:
            with torch_ext.enable():
                loss.backward()
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}\n{''.join(getattr(e, '__notes__', []))}"
            # Where it was raised: the Python frames the error passed through, innermost last.
            raised_in = [
                (os.path.basename(frame.filename), frame.name, frame.line)
                for frame in traceback.extract_tb(e.__traceback__)
            ]
        elapsed = time.monotonic() - start
        # The engine runs the next backward, a local one (the group may be broken).
        x = torch.randn(4, 4, requires_grad=True)
        (expected,) = torch.autograd.grad((x.tanh() * 3).sum(), x)
        with torch_ext.enable():
            (x.tanh() * 3).sum().backward()
        reference = next_step = None
        if fault == "hook":
            # The group is intact here: stock's full backward of the same step, for the gradients that completed.
            reference_loss, reference_leaves, _ = _loss("none", rank, through)
            reference_loss.backward()
            reference = [leaf.grad for leaf in reference_leaves]
            # And torch_ext's, of a fresh graph, communication included.
            next_loss, next_leaves, _ = _loss("none", rank, through)
            with torch_ext.enable():
                next_loss.backward()
            next_step = [leaf.grad for leaf in next_leaves]
        report(
            {
                "rank": rank,
                "error": error,
                "elapsed": elapsed,
                "threads_left": _os_threads() - threads,
                "next_backward": x.grad is not None and torch.equal(x.grad, expected),
                "grads": [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves],
                "reference": reference,
                "next_step": next_step,
                "order": order,
                "raised_in": raised_in,
                "dense_reference": _stock_dense_grads(),
            }
        )
    except BaseException:  # noqa: BLE001 - a rank's crash goes to the test, whatever it was
        report({"rank": rank, "crash": traceback.format_exc()})
    finally:
        # Out without teardown: a peer may be gone, and its group with it.
        os._exit(0)


def _run(fault: str, through: str, out_dir, *, world_size: int = WORLD_SIZE, rank_main=_rank) -> dict[int, dict]:
    """Each rank's report, ``rank_main(rank, port, fault, through, out_dir)`` on ``world_size`` ranks; a rank that
    died reports nothing. (tests/distributed/test_four_ranks.py runs its own ``rank_main`` on 4 ranks.)"""
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [
        context.Process(target=rank_main, args=(r, store.port, fault, through, str(out_dir))) for r in range(world_size)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        for process in ranks:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(p.is_alive() for p in ranks), f"a rank still ran after {SPAWN_TIMEOUT_S} s: a hang"
    finally:
        for process in ranks:
            process.kill()
            process.join()
    collected = {}
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.pt"
        if path.exists():
            collected[rank] = torch.load(path)
            assert "crash" not in collected[rank], collected[rank]["crash"]
    return collected


def _assert_dense_grads_are_stocks(result: dict) -> None:
    """TorchRec's case: x's and w's gradients (the dense chain's, run while the all_to_all was in flight) completed
    before the error, stock's bits; the table's, behind the failed wait, did not."""
    x_grad, w_grad, table_grad = result["grads"]
    assert table_grad is None, "the table's gradient came through a failed all_to_all"
    assert x_grad is not None and w_grad is not None, "the dense backward did not complete while in flight"
    assert all(
        torch.equal(ours, stock) for ours, stock in zip((x_grad, w_grad), result["dense_reference"], strict=True)
    )


@pytest.mark.parametrize("through", ["lane", "deferred_wait", TORCHREC])
def test_a_killed_peer_ends_the_survivors_backward_with_an_error(through, tmp_path):
    results = _run("killed", through, tmp_path)
    assert 1 not in results, "rank 1 was to die in its backward"
    survivor = results[0]
    assert survivor["error"] is not None, "rank 0's backward returned with its peer dead"
    assert survivor["elapsed"] < GROUP_TIMEOUT_S + 5, survivor
    assert survivor["threads_left"] <= 0 and survivor["next_backward"], survivor
    if through == "lane":
        assert "ExchangeBackward" in survivor["error"]  # the note naming the lane's node
    if through == "torchrec":
        # Rank 0 launched its all_to_all, ran the dense chain, and failed in the Req's node, waiting on the dead peer.
        assert survivor["order"] == ["launch", "w", "wait"], survivor["order"]
        assert survivor["raised_in"][-1] == TORCHREC_WAIT, survivor["raised_in"]
        assert re.search("Connection (reset|closed) by peer", survivor["error"]), survivor["error"]
        # The note naming the node, as a lane node's error has.
        assert (
            "raised by All2All_Pooled_ReqBackward, a collective node, on torch_ext's engine thread" in survivor["error"]
        )
        _assert_dense_grads_are_stocks(survivor)


@pytest.mark.parametrize("through", ["lane", TORCHREC])
def test_a_hook_that_raises_while_the_collective_is_in_flight(through, tmp_path):
    results = _run("hook", through, tmp_path)
    failed, peer = results[0], results[1]
    assert failed["error"].startswith("ValueError: user hook failed"), failed["error"]
    if through == "torchrec":
        # The hook (w's, after the dense chain) raised between the all_to_all's launch and its wait: in flight.
        # The Req's node never ran on rank 0, so the table got no gradient; rank 1 launched and waited.
        assert failed["order"] == ["launch", "w"], failed["order"]
        assert failed["grads"][2] is None and peer["order"] == ["launch", "w", "wait"], (failed, peer)
    # The collective had started on rank 0 and finished with its peer's: rank 1's backward completed.
    assert peer["error"] is None, peer["error"]
    assert failed["threads_left"] <= 0 and failed["next_backward"]
    # Every gradient rank 0 accumulated before the error is stock's full backward's, bit for bit.
    completed = [
        (ours, stock) for ours, stock in zip(failed["grads"], failed["reference"], strict=True) if ours is not None
    ]
    assert completed, "no gradient completed before the hook's error"
    assert all(torch.equal(ours, stock) for ours, stock in completed)
    # The group still works: torch_ext's next backward, collective included, is stock's on both ranks.
    for rank in (failed, peer):
        assert all(torch.equal(ours, stock) for ours, stock in zip(rank["next_step"], rank["reference"], strict=True))


@pytest.mark.parametrize("through", ["lane", TORCHREC])
def test_a_collective_that_times_out_raises_within_the_group_timeout(through, tmp_path):
    results = _run("late", through, tmp_path)
    early = results[0]
    assert early["error"] is not None and early["elapsed"] < GROUP_TIMEOUT_S + 5, early
    if through == "lane":
        assert "ExchangeBackward" in early["error"], early["error"]
    else:
        # Rank 0 launched, ran the dense chain, and timed out in the Req's node waiting for its peer.
        assert early["order"] == ["launch", "w", "wait"], early["order"]
        assert early["raised_in"][-1] == TORCHREC_WAIT, early["raised_in"]
        assert f"Timed out waiting {GROUP_TIMEOUT_S * 1000}ms" in early["error"], early["error"]
        assert "raised by All2All_Pooled_ReqBackward, a collective node, on torch_ext's engine thread" in early["error"]
        _assert_dense_grads_are_stocks(early)
    assert early["threads_left"] <= 0 and early["next_backward"], early
