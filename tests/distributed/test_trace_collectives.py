"""torch_ext.trace() with collectives on two gloo ranks: each launch paired with its wait.

Every rank traces one backward through ``torch_ext.ops.all_to_all_single`` (the automatic collective
priority on) and one through ``all_reduce_coalesced`` (whose bucket is waited on piece by piece),
and returns its events and Chrome trace as plain data.
"""

from __future__ import annotations

import pytest
import torch
from _harness import WORLD_SIZE, run_ranks

import torch_ext
import torch_ext.ops as xops
from torch_ext.tracing import chrome_trace

pytestmark = pytest.mark.distributed

COLLECTIVE_PRIORITY = torch_ext._C.collective_priority


def _leaf(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(*shape, generator=generator).requires_grad_()


def _all_to_all(rank: int) -> dict:
    """lookup -> all_to_all -> two sparse layers; a dense chain created later; loss joins them."""
    sent = [1 + rank + 2 * peer for peer in range(WORLD_SIZE)]
    received = [1 + peer + 2 * rank for peer in range(WORLD_SIZE)]
    table = _leaf(rank, sum(sent), 3)
    lookup = table.exp()
    exchanged = xops.all_to_all_single(lookup, received, sent)
    sparse = exchanged
    for salt in range(2):
        sparse = torch.tanh(sparse @ _leaf(rank, 3, 3, salt=salt + 1))
    dense = _leaf(rank, 4, 3, salt=9)
    for _ in range(3):
        dense = dense.tanh()
    loss = sparse.sum() + dense.sum()
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    return {
        "events": t.events,
        "chrome": chrome_trace(t.events),
        "consumer_sequence_nr": lookup.grad_fn._sequence_nr(),
    }


def _coalesced(rank: int) -> dict:
    leaves = [_leaf(rank, 3, 2, salt=i) for i in range(2)]
    outs = xops.all_reduce_coalesced([leaf * (i + 2.0) for i, leaf in enumerate(leaves)])
    with torch_ext.trace() as t:
        torch_ext.backward(sum(out.sum() for out in outs), retain_graph=True)
    # grad() of the first leaf only: the second piece goes to a node that does not run, so the
    # engine waits on it when the call ends.
    with torch_ext.trace() as partial:
        torch_ext.grad(sum(out.sum() for out in outs), [leaves[0]])
    return {"events": t.events, "partial_events": partial.events}


def _run_everything(rank: int) -> dict:
    return {"all_to_all": _all_to_all(rank), "coalesced": _coalesced(rank)}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(_run_everything, tmp_path_factory.mktemp("trace_collectives"))


def _launches_and_waits(events):
    launches = [event for event in events if event["kind"] == "node" and event["collective"]]
    waits = [event for event in events if event["kind"] == "collective_wait"]
    return launches, waits


def test_all_to_all_launch_paired_with_its_wait(rank_results):
    for rank, result in enumerate(rank_results):
        run = result["all_to_all"]
        events = run["events"]
        (launch,), (wait,) = _launches_and_waits(events)
        assert "all_to_all_single" in launch["name"], launch
        assert (launch["priority"], launch["priority_from"]) == (COLLECTIVE_PRIORITY, "collective")
        assert wait["wait_for"] == launch["id"], f"rank {rank}"
        assert launch["end_ns"] <= wait["start_ns"] <= wait["end_ns"]
        assert wait["backward_id"] == launch["backward_id"] and wait["thread"] == launch["thread"]
        # The wait is attributed to, and happens inside, the first consumer: lookup's ExpBackward0.
        assert (wait["name"], wait["sequence_nr"]) == ("ExpBackward0", run["consumer_sequence_nr"])
        consumer = next(e for e in events if e["kind"] == "node" and e["name"] == "ExpBackward0")
        assert consumer["start_ns"] <= wait["start_ns"] <= wait["end_ns"] <= consumer["end_ns"]
        # The dense chain ran while the collective was in flight.
        nodes = [e for e in events if e["kind"] == "node"]
        in_flight = nodes[nodes.index(launch) + 1 : nodes.index(consumer)]
        assert sum(e["name"] == "TanhBackward0" and e["priority"] == 0 for e in in_flight) == 3, in_flight
        # Everything between the loss and the collective got its priority from the collective.
        before = nodes[: nodes.index(launch)]
        assert before and all(e["priority_from"] == "propagated" for e in before), before
        assert all(e["priority_origin"]["name"] == launch["name"] for e in before)
        assert all(e["priority_origin"]["priority_from"] == "collective" for e in before)


def test_chrome_trace_links_launch_to_wait(rank_results):
    for result in rank_results:
        events = result["all_to_all"]["events"]
        (launch,), (wait,) = _launches_and_waits(events)
        chrome = result["all_to_all"]["chrome"]["traceEvents"]
        starts = [e for e in chrome if e["ph"] == "s"]
        finishes = [e for e in chrome if e["ph"] == "f"]
        assert len(starts) == len(finishes) == 1 and starts[0]["id"] == finishes[0]["id"]
        assert starts[0]["ts"] == launch["start_ns"] / 1e3 and starts[0]["tid"] == launch["thread"]
        assert finishes[0]["ts"] == wait["start_ns"] / 1e3 and finishes[0]["bp"] == "e"
        spans = {e["name"]: e for e in chrome if e["ph"] == "X"}
        assert spans[launch["name"]]["cat"] == "collective"
        assert spans["wait: ExpBackward0"]["args"]["wait_for"] == launch["id"]


def test_coalesced_bucket_waits_all_point_at_its_launch(rank_results):
    for result in rank_results:
        launches, waits = _launches_and_waits(result["coalesced"]["events"])
        assert len(launches) == 1 and "all_reduce_coalesced" in launches[0]["name"]
        # One wait per piece read by a node (the two MulBackward0), all paired with the one launch.
        assert sorted(wait["name"] for wait in waits) == ["MulBackward0", "MulBackward0"]
        assert all(wait["wait_for"] == launches[0]["id"] for wait in waits)
        assert all(launches[0]["end_ns"] <= wait["start_ns"] for wait in waits)


def test_result_no_node_reads_is_waited_on_at_the_end(rank_results):
    for result in rank_results:
        events = result["coalesced"]["partial_events"]
        (launch,), waits = _launches_and_waits(events)
        (call,) = [e for e in events if e["kind"] == "backward"]
        assert call["name"] == "grad"
        assert [(w["name"], w["sequence_nr"]) for w in waits] == [
            ("MulBackward0", waits[0]["sequence_nr"]),
            ("end of backward", -1),
        ]
        assert all(w["wait_for"] == launch["id"] for w in waits)
        last_node_end = max(e["end_ns"] for e in events if e["kind"] == "node")
        assert last_node_end <= waits[1]["start_ns"] <= waits[1]["end_ns"] <= call["end_ns"]
