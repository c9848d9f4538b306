"""torch_ext's engine frees every graph it runs: no tensor, node or memory outlives a backward pass.

Three counts are taken before and after 1,000 training steps (each one forward and two backward
passes, the first retaining the graph):

- live Python tensors (``gc.get_objects()``). This includes tensors that only a graph still holds:
  PyTorch keeps a tensor's Python object alive with its C++ tensor.
- live nodes: custom Function contexts, and tokens held by hooks registered on C++ nodes, which
  live exactly as long as their node.
- bytes the C heap has handed out and not taken back (glibc's ``mallinfo2``), for C++ tensors that never
  had a Python object (gradient buffers, node outputs). Resident memory (RSS) was the first choice and
  proved flaky: after the earlier tests of a session freed memory, a leak of 15 MiB grew RSS by 1.3 MiB,
  because malloc reused pages that were already resident.

Each count is shown to fire on a deliberately retained graph. Weakrefs into one graph then check
that what a backward pass leaves alive is what stock leaves alive, and that nothing is left once
the loss is dropped, also when a hook or a node raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

import torch_ext

# Graphs far too small to gain from intra-op threads (conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ITERATIONS = 1000
WARMUP_ITERATIONS = 20  # lazily made state: .grad of the parameters, allocator pools
BATCH = FEATURES = 64
# One leaked [64, 64] fp32 tensor per step is 15.6 MiB over 1,000 steps.
HEAP_SLACK_BYTES = 4 * 2**20


def _backward_under_enable(tensors, retain_graph=None):
    with torch_ext.enable():
        torch.autograd.backward(tensors, retain_graph=retain_graph)


ENGINES: dict[str, Callable] = {
    "stock": torch.autograd.backward,
    "torch_ext": torch_ext.backward,
    # torch.autograd.backward through torch_ext.Engine, as loss.backward() runs under enable().
    "torch_ext_enabled": _backward_under_enable,
}
TORCH_EXT_ENGINES = [name for name in ENGINES if name != "stock"]


class InjectedError(Exception):
    pass


class NodeToken:
    """A hook that does nothing: registered on one node, it lives exactly as long as that node."""

    def __call__(self, *args):
        return None


class Square(torch.autograd.Function):
    """x * x as a custom Function (its node is a Python object); raises in backward when asked to."""

    @staticmethod
    def forward(ctx, inputs, fail):
        ctx.save_for_backward(inputs)
        ctx.fail = fail
        return inputs * inputs

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise InjectedError("raised in Square.backward")
        (inputs,) = ctx.saved_tensors
        return 2 * inputs * grad, None


def _raise(*args):
    raise InjectedError("raised in a hook")


def _make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, 1))


def _build_graph(model: nn.Sequential, fail_in: str | None = None) -> tuple[torch.Tensor, dict[str, weakref.ref]]:
    """An MLP loss and weakrefs to what its graph owns: saved tensors, nodes, gradients in flight."""
    inputs = torch.randn(BATCH, FEATURES)
    hidden = torch.tanh(model[0](inputs))  # saved by TanhBackward and by Square
    squared = Square.apply(hidden, fail_in == "custom Function backward")  # saved by the next addmm
    loss = model[1](squared).square().mean()

    refs = {"hidden": weakref.ref(hidden), "squared": weakref.ref(squared), "Square node": weakref.ref(squared.grad_fn)}
    token = NodeToken()
    loss.grad_fn.register_hook(token)
    refs["MeanBackward0 node"] = weakref.ref(token)

    def record_grad(grad):
        refs["gradient into Square"] = weakref.ref(grad)

    squared.register_hook(record_grad)
    if fail_in == "tensor hook":
        squared.register_hook(_raise)
    elif fail_in == "node pre-hook":
        hidden.grad_fn.register_prehook(_raise)
    elif fail_in == "node post-hook":
        hidden.grad_fn.register_hook(_raise)
    return loss, refs


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return sorted(name for name, ref in refs.items() if ref() is not None)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # The graph must be freed by reference counting, as on stock, not by a later cycle collection.
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True)
class Census:
    tensors: int
    nodes: int
    heap_bytes: int

    def __sub__(self, other: Census) -> Census:
        return Census(self.tensors - other.tensors, self.nodes - other.nodes, self.heap_bytes - other.heap_bytes)


def _census() -> Census:
    gc.collect()
    tensors = nodes = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which a dead weakproxy raises on.
        kind = type(obj)
        if issubclass(kind, torch.Tensor):
            tensors += 1
        elif issubclass(kind, (BackwardCFunction, NodeToken)):
            nodes += 1
    return Census(tensors, nodes, _heap_bytes_in_use())


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_bytes_in_use() -> int:
    """Bytes malloc has handed out and not taken back, over every arena: chunks in use plus mmapped ones."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _growth(step: Callable[[], None]) -> Census:
    for _ in range(WARMUP_ITERATIONS):
        step()
    before = _census()
    for _ in range(ITERATIONS):
        step()
    return _census() - before


@pytest.mark.parametrize("engine", list(ENGINES))
def test_training_steps_leave_nothing_alive(engine):
    backward = ENGINES[engine]
    model = _make_model()

    def step():
        loss, _ = _build_graph(model)
        backward(loss, retain_graph=True)
        backward(loss)

    growth = _growth(step)
    assert (growth.tensors, growth.nodes) == (0, 0), growth
    assert growth.heap_bytes < HEAP_SLACK_BYTES, growth


def test_census_sees_retained_graphs():
    # The detector itself: a loop that keeps its graphs must show up in every count.
    model = _make_model()
    kept = []

    def leaky_step():
        loss, _ = _build_graph(model)
        torch_ext.backward(loss, retain_graph=True)
        kept.append(loss)

    growth = _growth(leaky_step)
    assert growth.tensors >= ITERATIONS, growth
    assert growth.nodes >= ITERATIONS, growth
    assert growth.heap_bytes >= HEAP_SLACK_BYTES, growth


def _alive_after_backward(backward: Callable, retain_graph: bool) -> tuple[list[str], list[str]]:
    """What of one graph is alive after backward while the loss is held, and after it is dropped."""
    loss, refs = _build_graph(_make_model())
    with _gc_paused():
        backward(loss, retain_graph=retain_graph)
        while_held = _alive(refs)
        del loss
        return while_held, _alive(refs)


@pytest.mark.parametrize("retain_graph", [False, True], ids=["free_graph", "retain_graph"])
@pytest.mark.parametrize("engine", TORCH_EXT_ENGINES)
def test_graph_freed_as_on_stock(engine, retain_graph):
    stock_held, stock_after = _alive_after_backward(torch.autograd.backward, retain_graph)
    held, after = _alive_after_backward(ENGINES[engine], retain_graph)
    # The weakrefs see the graph: saved tensors outlive backward exactly when it is retained.
    assert ("hidden" in stock_held) == retain_graph and stock_after == []
    assert held == stock_held
    assert after == []


def _alive_after_error(backward: Callable, fail_in: str, anomaly: bool) -> tuple[str, list[str], list[str]]:
    # Anomaly mode keeps every node's forward stack, and on an error torch_ext copies the failing
    # node's onto its driver node.
    with torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext():
        loss, refs = _build_graph(_make_model(), fail_in)
    with _gc_paused(), torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext():
        try:
            backward(loss)
        except InjectedError as error:
            # Leaving the except block drops the traceback and with it the frames that saw the graph.
            message = str(error)
        else:
            raise AssertionError(f"backward did not raise from the {fail_in}")
        while_held = _alive(refs)
        del loss
        return message, while_held, _alive(refs)


# Anomaly mode warns that it is on, and reports the failing node's forward stack as a warning.
@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled", "ignore:Error detected in")
@pytest.mark.parametrize("anomaly", [False, True], ids=["no_anomaly", "anomaly_mode"])
@pytest.mark.parametrize(
    "fail_in",
    ["tensor hook", "node pre-hook", "node post-hook", "custom Function backward"],
    ids=lambda where: where.replace(" ", "_"),
)
@pytest.mark.parametrize("engine", TORCH_EXT_ENGINES)
def test_error_in_backward_does_not_leak_graph(engine, fail_in, anomaly):
    stock_message, stock_held, stock_after = _alive_after_error(torch.autograd.backward, fail_in, anomaly)
    message, held, after = _alive_after_error(ENGINES[engine], fail_in, anomaly)
    assert stock_held and stock_after == []
    assert (message, held) == (stock_message, stock_held)
    assert after == []
