"""A backward that is traced, not run, goes to stock's engine: no lane, no overlap thread, no reordering.

AOTAutograd traces a compiled model's backward by calling ``torch.autograd.grad`` under fake, proxy and functional
dispatch modes; ``make_fx``, ``torch.func`` and ``torch.export`` reach the engine the same way. Those modes belong
to the calling thread and are not thread-safe: before the fix a lane-declared all_to_all's backward ran on its lane
during the trace, and about half of the compiles failed in ``fake_tensor.py``'s ``in_kernel_invocation_manager``.
Each test here compares with stock's engine doing the same trace: the same graphs, the calling thread, no failure.
"""

from __future__ import annotations

import contextlib
import threading
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx

import torch_ext

FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single
COMPILES = 20


class ThreadProbe(torch.autograd.Function):
    """An identity whose backward records the thread it ran on; declared to a lane by the tests."""

    threads: ClassVar[list[threading.Thread]] = []

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # torch.func transforms ask for it

    @staticmethod
    def backward(ctx, grad):
        ThreadProbe.threads.append(threading.current_thread())
        return grad * 1


@pytest.fixture
def probe_in_a_lane(one_rank_world):
    torch_ext.run_in_lane(ThreadProbe)
    ThreadProbe.threads.clear()
    try:
        yield ThreadProbe
    finally:
        torch_ext.unregister_collective_backward(ThreadProbe)


def two_branches(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A loss of two independent branches, the second through the probe: stock runs the first branch's backward
    first (higher sequence numbers), a priority on the second reverses that."""
    first = (x @ w).tanh()
    second = ThreadProbe.apply((x * 3) @ w).sin()
    return first.sum() + second.sum()


def grad_with_second_branch_first(x, w, engine_grad):
    first = (x @ w).tanh()
    second_input = (x * 3) @ w
    second = ThreadProbe.apply(second_input).sin()
    loss = first.sum() + second.sum()
    return engine_grad(loss, (x, w), priorities={second_input: torch_ext.LAUNCH_FIRST})


def _stock_grad(loss, inputs, priorities):
    return torch.autograd.grad(loss, inputs)


def test_make_fx_of_a_backward_traces_stocks_graph_on_the_calling_thread(probe_in_a_lane):
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    stock = make_fx(lambda x, w: grad_with_second_branch_first(x, w, _stock_grad))(x, w)
    stock_threads = list(ThreadProbe.threads)
    ThreadProbe.threads.clear()
    traced = make_fx(lambda x, w: grad_with_second_branch_first(x, w, torch_ext.grad))(x, w)
    # The priority would run the second branch's backward first; traced, the order is stock's.
    assert traced.code == stock.code
    assert ThreadProbe.threads == stock_threads == [threading.current_thread()]
    for fake_mode_tracing in ("fake", "symbolic"):
        ThreadProbe.threads.clear()
        with torch_ext.enable():
            graph = make_fx(
                lambda x, w: torch.autograd.grad(two_branches(x, w), (x, w)), tracing_mode=fake_mode_tracing
            )
            graph(x, w)
        assert ThreadProbe.threads == [threading.current_thread()]


def test_aot_autograd_traces_stocks_backward_graph(probe_in_a_lane):
    def traced_graphs(enabled: bool) -> tuple[str, str]:
        graphs = {}

        def keep(name):
            def compiler(gm, _):
                graphs[name] = gm.code
                return make_boxed_func(gm)

            return compiler

        compiled = aot_function(two_branches, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        with torch_ext.enable() if enabled else contextlib.nullcontext():
            compiled(x, w).backward()
        return graphs["forward"], graphs["backward"]

    stock = traced_graphs(False)
    stock_threads = list(ThreadProbe.threads)
    ThreadProbe.threads.clear()
    assert traced_graphs(True) == stock
    assert ThreadProbe.threads == stock_threads
    assert set(ThreadProbe.threads) == {threading.current_thread()}


class OrderTag(torch.autograd.Function):
    """An identity whose backward records its label, for the order nodes ran in."""

    order: ClassVar[list[str]] = []

    @staticmethod
    def forward(x, label):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.label = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        OrderTag.order.append(ctx.label)
        return grad * 1, None


def first_branch_prioritised(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Stock runs the second branch's backward first (made later); the priority asks for the first."""
    first_input = x @ w
    torch_ext.set_priority(first_input, torch_ext.LAUNCH_FIRST)
    first = OrderTag.apply(first_input.tanh(), "first")
    second = OrderTag.apply(((x * 3) @ w).sin(), "second")
    return first.sum() + second.sum()


def test_torch_func_grad_keeps_stocks_order_and_values():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    OrderTag.order.clear()
    expected = torch.func.grad(first_branch_prioritised, argnums=(0, 1))(x, w)
    stock_order = list(OrderTag.order)
    OrderTag.order.clear()
    with torch_ext.enable():
        got = torch.func.grad(first_branch_prioritised, argnums=(0, 1))(x, w)
    assert OrderTag.order == stock_order == ["second", "first"]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_user_dispatch_mode_sees_every_backward_op(probe_in_a_lane):
    """A mode the user holds (FlopCounterMode here) is the calling thread's: a lane would escape it."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(enabled: bool) -> int:
        x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        loss = two_branches(x, w)
        with FlopCounterMode(display=False) as counter, torch_ext.enable() if enabled else contextlib.nullcontext():
            loss.backward()
        return counter.get_total_flops()

    assert counted(True) == counted(False) > 0
    assert set(ThreadProbe.threads) == {threading.current_thread()}


class LanedExchange(nn.Module):
    """Tokens through PyTorch's functional all_to_all (declared to a lane), an expert, back, beside a dense path."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(8, 8)
        self.dense = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        exchanged = funcol.all_to_all_single_autograd(tokens, None, None, group)
        returned = funcol.all_to_all_single_autograd(self.expert(exchanged), None, None, group)
        return (returned + self.dense(tokens)).square().mean()


@pytest.mark.slow
def test_compiling_under_enable_with_a_lane_never_fails(one_rank_world, monkeypatch):
    """Twenty compiles in a row with caches off, each tracing the lane's all_to_all backward (aot_eager: the
    failure was in AOTAutograd's trace, which Inductor adds nothing to but time; one Inductor compile at the end)."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    try:
        for attempt in range(COMPILES + 1):
            torch._dynamo.reset()
            model = LanedExchange()
            compiled = torch.compile(model, backend="inductor" if attempt == COMPILES else "aot_eager")
            with torch_ext.enable():
                compiled(torch.randn(6, 8)).backward()
            assert all(parameter.grad is not None for parameter in model.parameters())
    finally:
        torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)
        torch._dynamo.reset()


def test_traced_split_pass_is_refused_by_name():
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)

    def input_pass(x, w):
        return torch_ext.backward_input((x @ w).sum(), None, [x], [w])[0]

    with pytest.raises(RuntimeError, match="torch_ext.backward_input cannot be traced"):
        make_fx(input_pass)(x, w)
    # The engine is still usable.
    (dx,), state = torch_ext.backward_input((x @ w).sum(), None, [x], [w])
    torch_ext.backward_weight(state)
    assert dx is not None and w.grad is not None
