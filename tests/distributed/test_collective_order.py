"""The collective order check on 2 gloo ranks: ranks that diverge raise, naming the collective, instead of hanging.

Each case makes the ranks issue their backward collectives (lane nodes running a real all_to_all, and
torch_ext's own all_reduce) in the same order or not: a graph that differs by rank, a priority set on one
rank only. With ``torch_ext.check_collective_order()`` on, agreeing ranks train with stock's bits and
diverging ranks all raise the same clear error before any of them issues the collective that differs; a
backward that agrees then runs.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_ranks

import torch_ext
import torch_ext.ops
from torch_ext.testing import SyncAllToAll

pytestmark = pytest.mark.distributed


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


def _run(rank: int) -> dict:
    torch_ext.run_in_lane(SyncAllToAll)
    torch_ext.check_collective_order()
    results = {}
    for case, (extra, priority) in {"agree": (None, None), "extra": (1, None), "priority": (None, 1)}.items():
        loss, leaves = _model_loss(rank, extra, priority)
        try:
            with torch_ext.enabled():
                loss.backward()
            results[case] = {"error": None, "grads": [leaf.grad for leaf in leaves]}
        except RuntimeError as error:
            results[case] = {"error": str(error)}
    # Stock's bits for the agreeing case, and the engine usable after the errors.
    loss, leaves = _model_loss(rank, None, None)
    loss.backward()
    results["stock"] = [leaf.grad for leaf in leaves]
    loss, leaves = _model_loss(rank, None, None)
    with torch_ext.enabled():
        loss.backward()
    results["after_errors"] = [leaf.grad for leaf in leaves]
    results["checks"] = torch_ext.collective_checks()
    torch_ext.check_collective_order(False)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("collective_order"))


def test_agreeing_ranks_run_with_stock_bits(results):
    for rank, result in enumerate(results):
        assert result["agree"]["error"] is None, (rank, result["agree"]["error"])
        for ours, stock in zip(result["agree"]["grads"], result["stock"], strict=True):
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
