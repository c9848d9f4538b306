"""torch_ext.trace(): what it records on small single-process graphs, and its Chrome and PNG output.

Collectives (launch and wait pairs, flows) are in tests/distributed/test_trace_collectives.py.
"""

import json
import threading
import time

import pytest
import torch
from engine_helpers import graph_nodes, recsys_like

import torch_ext
from torch_ext.testing import assert_identical
from torch_ext.tracing import plot_timelines, trace_clock_ns


def small_graph():
    """loss = (sin(x * 2) * w).sum() + (x * 3).exp().sum(): two branches meeting at x's AccumulateGrad."""
    x = torch.linspace(0.1, 1.0, 4).requires_grad_()
    w = torch.linspace(1.0, 2.0, 4).requires_grad_()
    loss = ((x * 2).sin() * w).sum() + (x * 3).exp().sum()
    return loss, [x, w]


def record_execution_order(root):
    """(name, sequence_nr as traced) of every node, appended as each starts running (pre-hooks)."""
    order = []
    for node in graph_nodes([root]):
        seq = node._sequence_nr()
        traced_seq = -1 if seq == 2**64 - 1 else seq
        node.register_prehook(lambda grads, node=node, seq=traced_seq: order.append((node.name(), seq)))
    return order


def kinds(events, kind):
    return [event for event in events if event["kind"] == kind]


def by_name(events, name):
    matches = [event for event in kinds(events, "node") if event["name"] == name]
    assert len(matches) == 1, f"{name}: {len(matches)} node events"
    return matches[0]


def test_node_events_follow_execution_order():
    loss, _ = small_graph()
    order = record_execution_order(loss)
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    assert [(e["name"], e["sequence_nr"]) for e in kinds(t.events, "node")] == order
    assert len(order) == len(graph_nodes([loss]))
    (call,) = kinds(t.events, "backward")
    assert call["name"] == "backward" and call["id"] == 0
    assert [event["id"] for event in t.events] == list(range(len(t.events)))


def test_events_are_sorted_and_spans_nest_in_their_backward():
    loss, _ = small_graph()
    before = time.perf_counter_ns()
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    after = time.perf_counter_ns()
    starts = [event["start_ns"] for event in t.events]
    assert starts == sorted(starts)
    calls = {event["backward_id"]: event for event in kinds(t.events, "backward")}
    for event in t.events:
        call = calls[event["backward_id"]]
        assert before <= call["start_ns"] <= event["start_ns"] <= event["end_ns"] <= call["end_ns"] <= after
        assert event["thread"] == call["thread"] == threading.get_native_id()
        assert event["wait_for"] is None and event["collective"] is False


def test_trace_clock_is_perf_counter():
    before = time.perf_counter_ns()
    now = trace_clock_ns()
    after = time.perf_counter_ns()
    assert before <= now <= after


def test_gradients_equal_stock_with_tracing_on():
    loss, leaves = small_graph()
    torch.autograd.backward(loss)
    stock = [leaf.grad for leaf in leaves]
    loss, leaves = small_graph()
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    assert t.events
    assert_identical([leaf.grad for leaf in leaves], stock, "gradients")


def test_priority_and_where_it_came_from():
    loss, lookup, *_ = recsys_like(layers=2)
    torch_ext.set_priority(lookup, 7)
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    boosted = by_name(t.events, "ExpBackward0")
    assert (boosted["priority"], boosted["priority_from"], boosted["priority_origin"]) == (7, "set_priority", None)
    for event in kinds(t.events, "node"):
        if event["name"] in ("TanhBackward0", "SumBackward0", "MulBackward0"):
            assert event["priority"] == 7 and event["priority_from"] == "propagated", event
            assert event["priority_origin"] == {
                "name": "ExpBackward0",
                "sequence_nr": lookup.grad_fn._sequence_nr(),
                "priority_from": "set_priority",
            }
        if event["name"] == "ReluBackward0":
            assert (event["priority"], event["priority_from"], event["priority_origin"]) == (0, None, None)
    # The boosted path ran before the dense path.
    names = [event["name"] for event in kinds(t.events, "node")]
    assert names.index("ExpBackward0") < names.index("ReluBackward0")


def test_launch_first_and_per_call_priorities():
    loss, lookup, *_ = recsys_like(layers=2)
    dense = loss.grad_fn.next_functions[0][0].next_functions[1][0]  # Sum <- Mul(sparse, dense): the top dense node
    torch_ext.launch_first(lookup)
    with torch_ext.trace() as t:
        torch_ext.backward(loss, retain_graph=True)
    assert by_name(t.events, "ExpBackward0")["priority"] == torch_ext.LAUNCH_FIRST
    torch_ext.clear_priority(lookup)

    with torch_ext.trace() as t:
        torch_ext.backward(loss, priorities={dense: 3})
    relus = [event for event in kinds(t.events, "node") if event["name"] == "ReluBackward0"]
    assert relus[0]["priority_from"] == "priorities" and relus[0]["priority"] == 3
    # Below the target nothing changes; above it (between the loss and it) the priority propagates.
    assert (relus[1]["priority"], relus[1]["priority_from"]) == (0, None)
    mul = by_name(t.events, "MulBackward0")
    assert (mul["priority"], mul["priority_from"]) == (3, "propagated")
    assert mul["priority_origin"] == {
        "name": "ReluBackward0",
        "sequence_nr": dense._sequence_nr(),
        "priority_from": "priorities",
    }
    exp = by_name(t.events, "ExpBackward0")
    assert (exp["priority"], exp["priority_from"]) == (0, None)


def test_priority_without_propagation_stays_on_its_node():
    loss, lookup, *_ = recsys_like(layers=2)
    torch_ext.set_priority(lookup, 5, propagate=False)
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    for event in kinds(t.events, "node"):
        expected = (5, "set_priority") if event["name"] == "ExpBackward0" else (0, None)
        assert (event["priority"], event["priority_from"]) == expected, event


def test_off_records_nothing():
    loss, _ = small_graph()
    torch_ext.backward(loss)  # before: not recorded
    with torch_ext.trace() as t:
        pass
    assert t.events == []
    loss, _ = small_graph()
    torch_ext.backward(loss)  # after: not recorded either
    assert t.events == []
    # Stock's engine is not traced.
    with torch_ext.trace() as t:
        small_graph()[0].backward()
    assert t.events == []


def test_grad_enabled_engine_and_split_passes_are_traced():
    loss, (x, w) = small_graph()
    with torch_ext.trace() as t:
        torch_ext.grad(loss, [x], retain_graph=True)
        with torch_ext.enable():
            loss.backward(retain_graph=True)
        _, state = torch_ext.backward_input(loss, None, [x], [w])
        torch_ext.backward_weight(state)
    calls = [event["name"] for event in kinds(t.events, "backward")]
    assert calls == ["grad", "backward", "backward_input", "backward_weight"]
    assert len({event["backward_id"] for event in t.events}) == 4


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward failed on purpose")


def test_error_in_backward_keeps_trace_and_engine():
    x = torch.ones(3, requires_grad=True)
    with torch_ext.trace() as t, pytest.raises(ValueError, match="on purpose"):
        torch_ext.backward((Fails.apply(x) * 2).sum())
    failed = by_name(t.events, "FailsBackward")
    (call,) = kinds(t.events, "backward")
    assert call["start_ns"] <= failed["start_ns"] <= failed["end_ns"] <= call["end_ns"]
    # The recorder is stopped and the engine still works, traced or not.
    loss, _ = small_graph()
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    assert len(kinds(t.events, "backward")) == 1


def test_exception_in_block_still_stops_the_trace():
    with pytest.raises(KeyError), torch_ext.trace() as t:
        torch_ext.backward(small_graph()[0])
        raise KeyError("user code")
    assert len(kinds(t.events, "backward")) == 1
    with torch_ext.trace():  # not still active
        pass


def test_backward_on_another_thread_is_recorded():
    thread_ids = []

    def run():
        thread_ids.append(threading.get_native_id())
        torch_ext.backward(small_graph()[0])

    with torch_ext.trace() as t:
        worker = threading.Thread(target=run)
        worker.start()
        torch_ext.backward(small_graph()[0])
        worker.join()
    calls = kinds(t.events, "backward")
    assert sorted(call["thread"] for call in calls) == sorted([threading.get_native_id(), thread_ids[0]])
    for call in calls:
        nodes = [e for e in t.events if e["backward_id"] == call["backward_id"] and e["kind"] == "node"]
        assert len(nodes) == 10 and all(e["thread"] == call["thread"] for e in nodes)


class BackwardInside(torch.autograd.Function):
    """Its backward runs a torch_ext backward of its own (as a reentrant checkpoint does)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            torch_ext.backward(small_graph()[0])
        return grad


def test_backward_inside_a_node_is_its_own_call_inside_that_node():
    x = torch.ones(3, requires_grad=True)
    with torch_ext.trace() as t:
        torch_ext.backward(BackwardInside.apply(x).sum())
    outer, inner = kinds(t.events, "backward")
    node = by_name(t.events, "BackwardInsideBackward")
    assert node["backward_id"] == outer["backward_id"] != inner["backward_id"]
    assert node["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= node["end_ns"]
    assert len([e for e in t.events if e["backward_id"] == inner["backward_id"]]) == 11
    assert torch.equal(x.grad, torch.ones(3))


def test_traces_do_not_nest():
    with torch_ext.trace() as outer:
        with pytest.raises(RuntimeError, match="already active"), torch_ext.trace():
            pass
        torch_ext.backward(small_graph()[0])
    assert len(kinds(outer.events, "backward")) == 1


def profiled_nodes(profile):
    """(name, concrete inputs) of each node's profiler event; the driver is the host task's node."""
    return [
        (e.name.removeprefix(EVALUATE), e.concrete_inputs)
        for e in profile.events()
        if e.name.startswith(EVALUATE) and "BackwardDriver" not in e.name
    ]


EVALUATE = "autograd::engine::evaluate_function: "


def test_node_spans_appear_in_profiler_trace_with_their_priority():
    loss, lookup, *_ = recsys_like(layers=2)
    torch_ext.set_priority(lookup, 4)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, record_shapes=True) as profile, torch_ext.trace() as t:
        torch_ext.backward(loss, retain_graph=True)
    traced = [(e["name"], [e["priority"]]) for e in kinds(t.events, "node")]
    assert profiled_nodes(profile) == traced and len(traced) == 16
    assert ("ExpBackward0", [4]) in traced and ("ReluBackward0", [0]) in traced
    # Not tracing: the events carry no input, as stock's.
    with torch.profiler.profile(activities=cpu, record_shapes=True) as profile:
        torch_ext.backward(loss)
    assert [inputs for _, inputs in profiled_nodes(profile)] == [[]] * 16


def test_chrome_trace_is_valid_json_with_spans_and_names(tmp_path):
    loss, _ = small_graph()
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    path = tmp_path / "trace.json"
    t.save_chrome_trace(path)
    with open(path) as f:
        chrome = json.load(f)
    spans = [event for event in chrome["traceEvents"] if event["ph"] == "X"]
    assert [span["name"] for span in spans] == [event["name"] for event in t.events]
    for span, event in zip(spans, t.events, strict=True):
        assert span["ts"] == pytest.approx(event["start_ns"] / 1e3)
        assert span["dur"] == pytest.approx((event["end_ns"] - event["start_ns"]) / 1e3)
        assert span["tid"] == event["thread"]
    metadata = {event["name"]: event for event in chrome["traceEvents"] if event["ph"] == "M"}
    assert metadata.keys() == {"process_name", "thread_name"}
    assert str(threading.get_native_id()) in metadata["thread_name"]["args"]["name"]


def test_png_timeline_is_written(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    loss, lookup, *_ = recsys_like(layers=2)
    torch_ext.set_priority(lookup, 1)
    with torch_ext.trace() as t:
        torch_ext.backward(loss)
    path = tmp_path / "timeline.png"
    t.plot(path)
    assert path.stat().st_size > 10_000
    pixels = image.imread(path)
    assert len(torch.from_numpy(pixels.reshape(-1, pixels.shape[-1])).unique(dim=0)) > 4


def test_plot_timelines_takes_foreign_events(tmp_path):
    """Rows of events built elsewhere (stock PyTorch from torch.profiler): only start and end are required."""
    pytest.importorskip("matplotlib")
    stock = [
        {"name": "MulBackward0", "start_ns": 1_000_000, "end_ns": 2_000_000},
        {"kind": "node", "name": "AllToAll", "start_ns": 2_000_000, "end_ns": 2_500_000, "collective": True},
        {"kind": "collective_wait", "name": "wait", "start_ns": 2_500_000, "end_ns": 4_000_000, "wait_for": 1},
    ]
    with torch_ext.trace() as t:
        torch_ext.backward(small_graph()[0])
    path = tmp_path / "rows.png"
    plot_timelines([("stock", stock), ("torch_ext", t.events), ("empty", [])], path, title="two engines")
    assert path.stat().st_size > 10_000


def test_weight_pass_says_where_its_priorities_came_from_when_only_it_is_traced():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    hidden = x @ w
    torch_ext.set_priority(hidden, 7)
    loss = hidden.tanh().sum()
    _, state = torch_ext.backward_input(loss, None, [x], [w])  # not traced
    with torch_ext.trace() as t:
        torch_ext.backward_weight(state)
    sources = {event["name"]: (event["priority"], event["priority_from"]) for event in kinds(t.events, "node")}
    assert sources["MmBackward0"] == (7, "set_priority"), sources


def test_launch_wait_pairs_follow_ids_in_a_filtered_event_list():
    from torch_ext.tracing import _launch_wait_pairs

    events = [
        {"id": 0, "kind": "backward", "name": "backward", "start_ns": 0, "end_ns": 10},
        {"id": 1, "kind": "node", "name": "launch", "start_ns": 1, "end_ns": 2, "collective": True},
        {"id": 2, "kind": "node", "name": "other", "start_ns": 2, "end_ns": 3},
        {"id": 3, "kind": "collective_wait", "name": "wait", "start_ns": 4, "end_ns": 5, "wait_for": 1},
    ]
    without_call = [event for event in events if event["kind"] != "backward"]
    assert [(launch["name"], wait["name"]) for launch, wait in _launch_wait_pairs(without_call)] == [("launch", "wait")]
    # Events built elsewhere without ids: wait_for is a position.
    anonymous = [{k: v for k, v in event.items() if k != "id"} for event in events]
    assert [(launch["name"], wait["name"]) for launch, wait in _launch_wait_pairs(anonymous)] == [("launch", "wait")]
