"""Collective lanes in one process: a lane node's apply() on its group's thread, stock's bits and errors.

The lane nodes here are a Function whose backward runs a real all_to_all on a one-rank gloo group
(``ProcessGroupGloo`` over a ``HashStore``) and then sleeps, releasing the GIL like a collective waiting
for its bytes. Two ranks, Megatron-core and DeepSpeed are in tests/distributed/test_sync_collectives.py.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (
    _logs_identical,
    assert_same_error,
    fuzz_settings,
    programs,
    run_recorded,
    tensors_identical,
)
from hypothesis import given
from hypothesis import strategies as st

import torch_ext

GROUP = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
OTHER_GROUP = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
# The threads the lane nodes' backward ran on, and the order they started in; the labels of those that
# returned.
started: list[tuple[str, int]] = []
finished: list[str] = []
# The OS thread ids (/proc/self/task) those lane threads had: lanes_joined() checks that each is gone.
lane_native_ids: set[int] = set()


class LaneExchange(torch.autograd.Function):
    """An all_to_all over ``group`` (the identity on one rank) that doubles; backward sleeps ``delay_s`` after its
    all_to_all, as a synchronous collective blocks until its bytes arrive."""

    @staticmethod
    def forward(ctx, x, group, delay_s, label, fail):
        ctx.group, ctx.delay_s, ctx.label, ctx.fail = group, delay_s, label, fail
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        started.append((ctx.label, threading.get_ident()))
        if threading.get_ident() != threading.main_thread().ident:
            lane_native_ids.add(threading.get_native_id())
        if ctx.fail:
            raise ValueError(f"lane node {ctx.label} failed")
        exchanged = torch.empty_like(grad)
        ctx.group.alltoall_base(exchanged, grad.contiguous(), [], []).wait()
        time.sleep(ctx.delay_s)
        finished.append(ctx.label)
        return exchanged * 2, None, None, None, None


def exchange(x, delay_s=0.0, label="lane", group=GROUP, fail=False):
    return LaneExchange.apply(x, group, delay_s, label, fail)


@pytest.fixture
def lane():
    started.clear()
    finished.clear()
    lane_native_ids.clear()
    torch_ext.run_in_lane(LaneExchange)
    yield
    torch_ext.unregister_collective_backward(LaneExchange)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# How long a joined lane thread's /proc/self/task entry may outlive the join. The join returns once the kernel has
# cleared the thread's tid word, a step of its exit before the task is released: in one CI run (2 busy cores) the
# entry was still listed right after backward returned. A leaked thread never goes, so waiting cannot hide one.
THREAD_EXIT_GRACE_S = 5.0


def lanes_joined() -> bool:
    """Whether every lane thread a lane node ran on has ended (within THREAD_EXIT_GRACE_S). Not a count of the
    process's threads: another test's background thread (a pool starting late) can come or go meanwhile, which once
    read 15 threads against 14."""
    if not lane_native_ids:
        return False
    deadline = time.monotonic() + THREAD_EXIT_GRACE_S
    while lane_native_ids & {int(tid) for tid in os.listdir("/proc/self/task")}:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _hooks_by_label(log):
    # The lane reorders nodes, so hooks run in another order; each hook's calls stay the same.
    return sorted((event for event in log if event[0] != "order"), key=lambda event: str(event[1]))


@fuzz_settings(60)
@given(programs(fan_in=True), st.data())
def test_random_graphs_with_lane_nodes_keep_stock_bits(lane, program, data):
    # Some results go through a lane node with a drawn delay, so lanes finish in varying order against the
    # engine thread; the held-gradient rule must still sum every input buffer in stock's order.
    delays = {
        i: data.draw(st.sampled_from([0.0, 0.001, 0.003]))
        for i in range(len(program.ops))
        if data.draw(st.integers(0, 2)) == 0
    }

    def wrap(i, value):
        return exchange(value, delays[i], f"op {i}") if i in delays and value.requires_grad else value

    def build():
        return program.build(wrap)

    options = {"grad_tensors": program.grad_tensors(), "retain_graph": program.runs > 1, "runs": program.runs}
    stock = run_recorded(build, torch.autograd.backward, **options)
    ours = run_recorded(build, torch_ext.backward, **options)
    for i, (expected, actual) in enumerate(zip(stock.grads, ours.grads, strict=True)):
        assert tensors_identical(expected, actual), f"leaf {i}"
    stock_hooks, our_hooks = _hooks_by_label(stock.log), _hooks_by_label(ours.log)
    assert len(stock_hooks) == len(our_hooks) and all(map(_logs_identical, stock_hooks, our_hooks))
    if any(label.startswith("op") for label, _ in started):
        assert {thread for _, thread in started} != {threading.get_ident()}


def _overlapping_graph(lane_delay_s=0.2, dense_layers=20, fail=False):
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    # The dense path is created after the lane node: stock runs it first, torch_ext dispatches the lane first.
    moe = exchange(x @ w, lane_delay_s, "moe", fail=fail)
    dense = x
    for _ in range(dense_layers):
        dense = torch.tanh(dense @ w)
    return moe.sum() + dense.sum(), (x, w)


@pytest.mark.slow
def test_lane_runs_apply_beside_the_dense_path_with_stock_bits(lane):
    loss, leaves = _overlapping_graph()
    loss.backward()
    expected = [leaf.grad for leaf in leaves]
    started.clear()
    loss, leaves = _overlapping_graph()
    finished.clear()
    dense_runs = []
    # The dense path runs on the engine thread while the lane's node is still inside its backward.
    dense_node = loss.grad_fn.next_functions[1][0]
    dense_node.register_prehook(lambda grads: dense_runs.append((threading.get_ident(), list(finished))))
    torch_ext.backward(loss)
    assert all(torch.equal(a.grad, b) for a, b in zip(leaves, expected, strict=True))
    ((lane_label, lane_thread),) = started
    assert lane_label == "moe" and lane_thread != threading.get_ident()
    assert dense_runs == [(threading.get_ident(), [])]
    assert finished == ["moe"]


def test_hooks_of_a_lane_node_run_on_the_engine_thread_as_on_stock(lane):
    def build():
        x = torch.randn(4, 4, requires_grad=True)
        y = exchange(x * 3, 0.01, "hooked")
        threads = []
        y.register_hook(lambda grad: threads.append("tensor") or grad * 0.5)
        y.grad_fn.register_prehook(lambda grads: threads.append(("pre", threading.get_ident())))
        y.grad_fn.register_hook(
            lambda grads_in, grads_out: threads.append(("post", threading.get_ident(), grads_out[0].clone()))
        )
        return y.sum(), x, threads

    loss, x, stock_calls = build()
    loss.backward()
    loss, y, our_calls = build()
    torch_ext.backward(loss)
    assert torch.equal(x.grad, y.grad)
    assert [call[0] if isinstance(call, tuple) else call for call in our_calls] == ["tensor", "pre", "post"]
    assert our_calls[1][1] == our_calls[2][1] == threading.get_ident()
    assert torch.equal(our_calls[2][2], stock_calls[2][2])
    assert started[-1][1] != threading.get_ident()


def test_grad_and_retain_graph_through_a_lane(lane):
    def build():
        torch.manual_seed(1)
        x = torch.randn(5, 5, requires_grad=True)
        return (exchange(x.sin(), 0.01) * x).sum(), x

    loss, x = build()
    (expected,) = torch.autograd.grad(loss, x, retain_graph=True)
    expected_again = torch.autograd.grad(loss, x)[0]
    loss, x = build()
    (first,) = torch_ext.grad(loss, x, retain_graph=True)
    (second,) = torch_ext.grad(loss, x)
    assert torch.equal(first, expected) and torch.equal(second, expected_again)


def test_collectives_start_in_the_plans_order_whatever_finishes_first(lane):
    # Planned order: first (created last in forward), then the tanh it feeds, then second (newer than third),
    # then third. third is ready at once, second only after first's slow lane returns: without the collective
    # sequence the lane would start third before second, an order that depends on timing and so can differ
    # between ranks.
    x = torch.randn(8, 8, requires_grad=True)
    third = exchange(x, 0.0, "third")
    second = exchange(x.cos(), 0.0, "second")
    first = exchange(torch.tanh(second), 0.2, "first")
    loss = first.sum() + third.sum()
    planned = [node.name() for node in torch_ext.debug.execution_order(loss) if node.name() == "LaneExchangeBackward"]
    assert len(planned) == 3
    torch_ext.backward(loss)
    assert [label for label, _ in started] == ["first", "second", "third"]


def test_one_lane_per_group(lane):
    x = torch.randn(8, 8, requires_grad=True)
    loss = exchange(x, 0.05, "a", GROUP).sum() + exchange(x, 0.05, "b", OTHER_GROUP).sum()
    torch_ext.backward(loss)
    threads = {label: thread for label, thread in started}
    assert threads["a"] != threads["b"]
    assert lanes_joined()


def test_an_error_on_the_lane_names_the_node_and_the_engine_goes_on(lane):
    pair = assert_same_error(
        lambda: _overlapping_graph(fail=True)[0].backward(),
        lambda: torch_ext.backward(_overlapping_graph(fail=True)[0]),
    )
    assert "LaneExchangeBackward" in "".join(getattr(pair.ext, "__notes__", []))
    assert lanes_joined()
    loss, leaves = _overlapping_graph()
    torch_ext.backward(loss)
    assert all(leaf.grad is not None for leaf in leaves)


class FailingDense(torch.autograd.Function):
    """Raises in backward; with ``after_lane_started``, only once a lane node's backward has started."""

    @staticmethod
    def forward(ctx, x, after_lane_started):
        ctx.after_lane_started = after_lane_started
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        deadline = time.monotonic() + 5
        while ctx.after_lane_started and not started and time.monotonic() < deadline:
            time.sleep(0.001)
        raise RuntimeError("dense node failed")


def test_an_error_on_the_engine_thread_waits_for_the_running_lane_node_then_raises(lane):
    def run(backward, after_lane_started):
        x = torch.randn(8, 8, requires_grad=True)
        loss = exchange(x, 0.2, "in flight").sum() + FailingDense.apply(x.tanh(), after_lane_started).sum()
        backward(loss)

    assert_same_error(lambda: run(torch.autograd.backward, False), lambda: run(torch_ext.backward, True))
    # Stock raised before its lane node ran; torch_ext had dispatched it first, and returned only once it had
    # finished. Its thread is gone.
    assert [label for label, _ in started] == ["in flight"]
    assert finished == ["in flight"]
    assert lanes_joined()


def test_an_unsafe_group_is_refused_before_any_hook_runs(lane):
    class NoGroup:
        pass

    torch_ext.run_in_lane(LaneExchange, group_of=lambda ctx: NoGroup())
    x = torch.randn(3, 3, requires_grad=True)
    y = exchange(x)
    hooked = []
    y.grad_fn.register_prehook(lambda grads: hooked.append(True))
    with pytest.raises(TypeError, match="must be a torch.distributed.ProcessGroup, got NoGroup"):
        torch_ext.backward(y.sum())
    assert hooked == []
    with pytest.raises(TypeError, match="group_of must be callable"):
        torch_ext.run_in_lane(LaneExchange, group_of=3)


@pytest.fixture
def world(tmp_path):
    """A one-rank default process group (gloo), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _lane_on_world_and(model: torch.nn.Module) -> torch.Tensor:
    """A loss whose backward runs a lane node declared on the default group, and ``model``."""
    torch_ext.run_in_lane(LaneExchange, group_of=lambda ctx: dist.group.WORLD)
    x = torch.randn(2, 4, requires_grad=True)
    return exchange(x).sum() + model(x).sum()


def test_ddp_reducing_on_the_lanes_group_is_refused(lane, world):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"also uses during backward: DistributedDataParallel reduces gradients"):
        torch_ext.backward(_lane_on_world_and(model))
    # Declared on a group of its own, the same program runs.
    torch_ext.run_in_lane(LaneExchange)
    del model
    x = torch.randn(2, 4, requires_grad=True)
    torch_ext.backward(exchange(x).sum())
    assert x.grad is not None


def test_ddp_wrapped_after_the_lanes_first_backward_is_refused(lane, world):
    linear = torch.nn.Linear(4, 4)
    # The group is checked and found free at the first backward ...
    torch_ext.backward(_lane_on_world_and(linear))
    torch_ext.backward(_lane_on_world_and(linear))
    # ... and checked again once a DDP module exists.
    model = torch.nn.parallel.DistributedDataParallel(linear)
    with pytest.raises(RuntimeError, match="DistributedDataParallel reduces gradients"):
        torch_ext.backward(_lane_on_world_and(model))
    del model


def test_a_ddp_communication_hook_on_the_lanes_group_is_refused(lane, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # DDP itself reduces on a group of its own; its hook communicates on the lane's.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=dist.new_group([0]))
    torch_ext.backward(_lane_on_world_and(model))
    model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="a DDP communication hook communicates"):
        torch_ext.backward(_lane_on_world_and(model))
    del model


def _fully_sharded(group) -> torch.nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    return fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))


def test_fsdp_on_the_lanes_group_is_refused(lane, world):
    model = _fully_sharded(dist.group.WORLD)
    with pytest.raises(RuntimeError, match=r"FSDP \(fully_shard\) communicates"):
        torch_ext.backward(_lane_on_world_and(model))
    del model


def test_fsdp_on_another_group_runs_with_stock_bits(lane, world):
    other = dist.new_group([0])
    grads = []
    for backward in (torch.autograd.backward, torch_ext.backward):
        model = _fully_sharded(other)
        torch.manual_seed(1)
        backward(_lane_on_world_and(model))
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        del model
    for ours, stock in zip(grads[1], grads[0], strict=True):
        assert torch.equal(ours, stock)


@pytest.mark.slow
def test_ctrl_c_while_the_engine_waits_for_a_lane_ends_the_call(lane):
    x = torch.randn(8, 8, requires_grad=True)
    loss = exchange(x, 1.0, "slow").sum()
    before = os_threads()
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        torch_ext.backward(loss)
    assert time.monotonic() - start < 0.9
    timer.join()
    # The lane was left inside its node, which ends by itself; then its thread is gone.
    deadline = time.monotonic() + 5
    while os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os_threads() == before
    loss = exchange(x, 0.0).sum()
    torch_ext.backward(loss)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_without_a_declaration_nothing_leaves_the_engine_thread():
    started.clear()
    x = torch.randn(8, 8, requires_grad=True)
    torch_ext.backward(exchange(x, 0.0).sum())
    assert started == [("lane", threading.get_ident())]


def test_the_ddp_scan_passes_over_dead_weak_proxies():
    # A proxy whose referent is gone raises ReferenceError when asked for its class; such proxies are among the
    # live objects of a real program (the full suite has them), and the scan met one there.
    import weakref

    import torch_ext.collectives.lanes

    class Referent:
        pass

    referent = Referent()
    proxy = weakref.proxy(referent)
    del referent
    assert torch_ext.collectives.lanes._data_parallel_on(GROUP) == []
    del proxy
