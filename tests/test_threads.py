"""torch_ext's engine called from several Python threads at once.

Each torch_ext call keeps its state to itself and runs with the GIL released, so threads really
run backward passes side by side. Gradients must equal stock's: bit for bit on independent graphs,
and on one graph shared by every thread, where the accumulation order into a leaf depends on
timing, with integer values that every order sums exactly. Also nested (reentrant) backward calls
inside a node, and an engine that keeps working after one thread's backward raised.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical

# Graphs far too small to gain from intra-op threads (conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

THREADS = 4
ITERATIONS = 25
JOIN_TIMEOUT_S = 60
RENDEZVOUS_TIMEOUT_S = 20


class InjectedError(Exception):
    pass


def _run_in_threads(work: Callable[[int], object], count: int = THREADS) -> list[object]:
    """Runs ``work(index)`` on ``count`` threads released together; returns each result, or the
    exception it raised."""
    start = threading.Barrier(count)
    outcomes: list[object] = [None] * count

    def run(index: int) -> None:
        try:
            start.wait()
            outcomes[index] = work(index)
        except Exception as error:  # noqa: BLE001 - handed to the test, which decides
            outcomes[index] = error

    threads = [
        threading.Thread(target=run, args=(index,), name=f"backward-{index}", daemon=True) for index in range(count)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    if hung:
        pytest.fail(f"threads {hung} did not finish within {JOIN_TIMEOUT_S} s")
    return outcomes


def _results(outcomes: list[object]) -> list[object]:
    """The results of _run_in_threads, failing with the first thread's exception if any raised."""
    failed = [(index, outcome) for index, outcome in enumerate(outcomes) if isinstance(outcome, Exception)]
    if failed:
        index, error = failed[0]
        raise AssertionError(f"thread {index} raised ({len(failed)} of {len(outcomes)} threads did)") from error
    return outcomes


class Square(torch.autograd.Function):
    """x * x as a custom Function: its backward runs Python, so it takes the GIL mid-backward."""

    @staticmethod
    def forward(ctx, inputs):
        ctx.save_for_backward(inputs)
        return inputs * inputs

    @staticmethod
    def backward(ctx, grad):
        (inputs,) = ctx.saved_tensors
        return 2 * inputs * grad


class Rendezvous(torch.autograd.Function):
    """The identity, whose backward waits at ``barrier`` for the backward passes of the other
    threads: they must all be inside the engine at once (an engine running one backward at a time
    breaks the barrier)."""

    @staticmethod
    def forward(ctx, inputs, barrier):
        ctx.barrier = barrier
        return inputs.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.barrier is not None:
            ctx.barrier.wait(timeout=RENDEZVOUS_TIMEOUT_S)
        return grad, None


def _mlp_graph(
    seed: int, fail: bool = False, rendezvous: threading.Barrier | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A loss over a small MLP with custom Functions and a tensor hook, from its own generator
    (the global one is shared by the threads), and the leaves it accumulates into."""
    generator = torch.Generator().manual_seed(seed)
    w1, b1, w2 = (torch.randn(*shape, generator=generator, requires_grad=True) for shape in ((16, 32), (32,), (32, 8)))
    inputs = torch.randn(8, 16, generator=generator)
    hidden = Square.apply(Rendezvous.apply(torch.tanh(inputs @ w1 + b1), rendezvous))
    hidden.register_hook(lambda grad: grad * 0.5)
    if fail:
        hidden.register_hook(_raise)
    loss = (hidden @ w2).logsumexp(dim=1).mean()
    return loss, [w1, b1, w2]


def _raise(grad):
    raise InjectedError("raised in a hook")


def _backward_under_enable(loss: torch.Tensor) -> None:
    # enable() is process-wide: the test turns it on around its threads.
    assert torch_ext.is_enabled()
    loss.backward()


def _mlp_grads(
    seed: int, backward: Callable[[torch.Tensor], None], rendezvous: threading.Barrier | None = None
) -> list[torch.Tensor]:
    loss, leaves = _mlp_graph(seed, rendezvous=rendezvous)
    backward(loss)
    return [leaf.grad for leaf in leaves]


ENTRY_POINTS = {
    "torch_ext_backward": torch_ext.backward,
    "loss_backward_under_enable": _backward_under_enable,
}


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_independent_graphs_in_threads_match_stock(entry_point):
    seeds = [[1000 * thread + iteration for iteration in range(ITERATIONS)] for thread in range(THREADS)]
    expected = [[_mlp_grads(seed, torch.autograd.backward) for seed in thread_seeds] for thread_seeds in seeds]
    backward = ENTRY_POINTS[entry_point]
    # The first backward pass of every thread meets the others' inside the engine.
    rendezvous = threading.Barrier(THREADS)

    def work(thread: int) -> list[list[torch.Tensor]]:
        return [
            _mlp_grads(seed, backward, rendezvous if iteration == 0 else None)
            for iteration, seed in enumerate(seeds[thread])
        ]

    with torch_ext.enable() if backward is _backward_under_enable else contextlib.nullcontext():
        grads = _results(_run_in_threads(work))
    assert_identical(grads, expected, "gradients of [thread][iteration]")


def _integer_graph(rendezvous: threading.Barrier | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A loss whose gradients are small integers, so that any number of them sums exactly in fp32
    whatever the order (every partial sum stays far below 2**24)."""
    x = torch.arange(-6.0, 6.0).reshape(3, 4).requires_grad_()
    w = torch.tensor([[1.0, -2.0], [0.0, 3.0], [2.0, 1.0], [-1.0, -1.0]], requires_grad=True)
    hidden = Square.apply(Rendezvous.apply(x @ w, rendezvous)) - x.sum()  # x reaches the loss along two paths
    loss = (hidden * torch.tensor([1.0, -1.0])).sum()
    return loss, [x, w]


def test_shared_graph_accumulates_from_threads_like_stock():
    calls_per_thread = 20
    loss, leaves = _integer_graph()
    for _ in range(THREADS * calls_per_thread):
        torch.autograd.backward(loss, retain_graph=True)
    expected = [leaf.grad for leaf in leaves]

    # Every call of every thread meets the others' calls inside the engine.
    loss, leaves = _integer_graph(threading.Barrier(THREADS))

    def work(thread: int) -> None:
        for _ in range(calls_per_thread):
            torch_ext.backward(loss, retain_graph=True)

    _results(_run_in_threads(work))
    assert_identical([leaf.grad for leaf in leaves], expected, "gradients accumulated from every thread")


class Recompute(torch.autograd.Function):
    """Runs ``fn`` without a graph in forward; backward recomputes it and differentiates it with a
    nested backward call made by ``inner_backward`` (torch.utils.checkpoint's reentrant pattern)."""

    @staticmethod
    def forward(ctx, inner_backward, fn, inputs):
        ctx.inner_backward, ctx.fn = inner_backward, fn
        ctx.save_for_backward(inputs)
        with torch.no_grad():
            return fn(inputs)

    @staticmethod
    def backward(ctx, grad):
        (inputs,) = ctx.saved_tensors
        inputs = inputs.detach().requires_grad_()
        with torch.enable_grad():
            outputs = ctx.fn(inputs)
        ctx.inner_backward(outputs, grad)
        return None, None, inputs.grad


def _nested_block(inputs: torch.Tensor, inner_backward: Callable, depth: int) -> torch.Tensor:
    # Each level's backward makes a nested backward call, which runs the next level's Recompute
    # node and so makes one more: `depth` nested engine calls in all.
    if depth == 0:
        return torch.sin(inputs) * inputs
    inner = functools.partial(_nested_block, inner_backward=inner_backward, depth=depth - 1)
    return Recompute.apply(inner_backward, inner, torch.tanh(inputs)) * 2


def _reentrant_grad(seed: int, outer_backward: Callable, inner_backward: Callable, depth: int = 3) -> torch.Tensor:
    inputs = torch.randn(5, 7, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    loss = _nested_block(inputs, inner_backward, depth).square().sum()
    outer_backward(loss)
    return inputs.grad


NESTED_ENGINES = {
    "torch_ext_in_torch_ext": (torch_ext.backward, torch_ext.backward),
    # A stock backward inside a torch_ext node is a reentrant task of the stock host.
    "stock_in_torch_ext": (torch_ext.backward, torch.autograd.backward),
}


# Past 60 nested calls (MAX_DEPTH in torch/csrc/autograd/engine.h) stock runs the next reentrant
# task on a pool thread instead of recursing.
@pytest.mark.parametrize("depth", [3, 70])
@pytest.mark.parametrize("engines", list(NESTED_ENGINES))
def test_nested_backward_inside_custom_function(engines, depth):
    outer, inner = NESTED_ENGINES[engines]
    stock = _reentrant_grad(0, torch.autograd.backward, torch.autograd.backward, depth)
    assert_identical(_reentrant_grad(0, outer, inner, depth), stock)


def _failing_in_call(inner_backward: Callable, failing_call: int) -> Callable:
    """``inner_backward``, whose ``failing_call``-th call (1 is the outermost) raises in a hook."""
    calls = itertools.count(1)

    def run(outputs, grad):
        if next(calls) == failing_call:
            outputs.register_hook(_raise)
        inner_backward(outputs, grad)

    return run


@pytest.mark.parametrize("depth", [3, 70])
@pytest.mark.parametrize("engines", list(NESTED_ENGINES))
def test_error_in_innermost_nested_backward_reaches_the_caller(engines, depth):
    # Through every level, and at depth 70 from stock's pool thread back to this one.
    outer, inner = NESTED_ENGINES[engines]
    with pytest.raises(InjectedError, match="^raised in a hook$"):
        _reentrant_grad(0, outer, _failing_in_call(inner, depth), depth)
    stock = _reentrant_grad(0, torch.autograd.backward, torch.autograd.backward, depth)
    assert_identical(_reentrant_grad(0, outer, inner, depth), stock)


@pytest.mark.parametrize("engines", list(NESTED_ENGINES))
def test_nested_backward_from_threads(engines):
    outer, inner = NESTED_ENGINES[engines]
    expected = [_reentrant_grad(seed, torch.autograd.backward, torch.autograd.backward) for seed in range(THREADS)]
    grads = _results(_run_in_threads(lambda seed: _reentrant_grad(seed, outer, inner)))
    assert_identical(grads, expected, "gradient of [thread]")


def _checkpointed_grads(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(12, 12, generator=generator, requires_grad=True) for _ in range(2))
    inputs = torch.randn(6, 12, generator=generator, requires_grad=True)

    def block(hidden):
        return torch.tanh(hidden @ w1) @ w2

    loss = checkpoint(block, torch.relu(inputs), use_reentrant=True).square().mean()
    loss.backward()
    return [inputs.grad, w1.grad, w2.grad]


def test_reentrant_checkpoint_from_threads_under_enable():
    # Reentrant checkpoint calls torch.autograd.backward from its node: under enable() that is a
    # nested torch_ext call, made from several threads at once.
    expected = [_checkpointed_grads(seed) for seed in range(THREADS)]
    with torch_ext.enable():
        grads = _results(_run_in_threads(_checkpointed_grads))
    assert_identical(grads, expected, "gradients of [thread]")


def test_engine_keeps_working_after_an_error_in_one_thread():
    expected = [_mlp_grads(seed, torch.autograd.backward) for seed in range(THREADS)]
    stock_loss, _ = _mlp_graph(0, fail=True)
    with pytest.raises(InjectedError) as stock_error:
        torch.autograd.backward(stock_loss)

    # A round per failing thread, then one in which no thread fails.
    for failing in [*range(THREADS), None]:

        def work(thread: int, failing: int | None = failing) -> list[torch.Tensor]:
            loss, leaves = _mlp_graph(thread, fail=thread == failing)
            torch_ext.backward(loss)
            return [leaf.grad for leaf in leaves]

        outcomes = _run_in_threads(work)
        for thread, outcome in enumerate(outcomes):
            if thread == failing:
                assert isinstance(outcome, InjectedError), f"thread {thread}: {outcome!r}"
                assert str(outcome) == str(stock_error.value)
            else:
                assert not isinstance(outcome, Exception), f"thread {thread} raised {outcome!r}"
                assert_identical(outcome, expected[thread], f"round with thread {failing} failing, thread {thread}")
