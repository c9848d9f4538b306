"""Split backward (torch_ext.backward_input, then torch_ext.backward_weight) against one full stock backward.

Each case builds a stage from a seed, runs two microbatches through it and compares, bit for bit:
stock runs forward and ``torch.autograd.backward`` per microbatch; torch_ext runs both forwards, both
input passes, then both weight passes (the order a zero-bubble schedule uses). The input gradients of
each microbatch and the weights' accumulated ``.grad`` must be equal.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical

SEED = 0
MICROBATCHES = 2


@dataclass
class Microbatch:
    outputs: tuple[torch.Tensor, ...]
    # None: ones for scalar outputs, as in torch.autograd.backward.
    grad_outputs: tuple[torch.Tensor | None, ...] | None
    inputs: list[torch.Tensor]
    weights: list[torch.Tensor]


# A case makes a stage's parameters and returns a function that runs one microbatch's forward.
Case = Callable[[], Callable[[], Microbatch]]


def _with_random_grads(outputs: tuple[torch.Tensor, ...], inputs, weights) -> Microbatch:
    return Microbatch(outputs, tuple(torch.randn_like(out) for out in outputs), inputs, weights)


def mlp() -> Callable[[], Microbatch]:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))

    def microbatch() -> Microbatch:
        x = torch.randn(6, 16, requires_grad=True)
        return _with_random_grads((model(x),), [x], list(model.parameters()))

    return microbatch


def transformer_block(norm_first: bool = False) -> Callable[[], Microbatch]:
    block = nn.TransformerEncoderLayer(
        d_model=24, nhead=4, dim_feedforward=40, dropout=0.0, batch_first=True, norm_first=norm_first
    )

    def microbatch() -> Microbatch:
        x = torch.randn(3, 5, 24, requires_grad=True)
        return _with_random_grads((block(x),), [x], list(block.parameters()))

    return microbatch


def shared_weight() -> Callable[[], Microbatch]:
    """pytorch#180952: one weight at two matmuls on one path; stock's split once counted it twice."""
    w = nn.Parameter(torch.randn(8, 8) / 3)

    def microbatch() -> Microbatch:
        x = torch.randn(4, 8, requires_grad=True)
        return Microbatch(((x @ w @ w).sum(),), None, [x], [w])

    return microbatch


def weight_at_several_depths() -> Callable[[], Microbatch]:
    """One Linear applied at three depths: its AccumulateGrad sums three gradients, in an order that
    shows in the bits."""
    shared = nn.Linear(12, 12)
    middle = nn.Linear(12, 12)

    def microbatch() -> Microbatch:
        x = torch.randn(5, 12, requires_grad=True)
        h = torch.tanh(shared(x))
        h = torch.tanh(shared(middle(h)))
        out = shared(h)
        return _with_random_grads((out,), [x], [*shared.parameters(), *middle.parameters()])

    return microbatch


def tied_embedding() -> Callable[[], Microbatch]:
    """A GPT-2-style tied embedding in a middle stage: the weight's gradient comes from the
    embedding lookup (a weight-side subgraph of its own) and from the output projection."""
    embed = nn.Embedding(10, 12)
    hidden = nn.Linear(12, 12)

    def microbatch() -> Microbatch:
        x = torch.randn(2, 4, 12, requires_grad=True)
        tokens = torch.randint(10, (2, 4))
        h = torch.tanh(hidden(x + embed(tokens)))
        logits = h @ embed.weight.t()
        return _with_random_grads((logits,), [x], [embed.weight, *hidden.parameters()])

    return microbatch


class MatmulHonouringMask(torch.autograd.Function):
    """Computes only the gradients ``ctx.needs_input_grad`` asks for. The scale, not a tensor, has an
    entry in needs_input_grad but no next edge."""

    calls = 0

    @staticmethod
    def forward(ctx, x, scale, w):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x @ w * scale

    @staticmethod
    def backward(ctx, grad):
        MatmulHonouringMask.calls += 1
        assert ctx.needs_input_grad[1] is False
        x, w = ctx.saved_tensors
        grad = grad * ctx.scale
        grad_x = grad @ w.t() if ctx.needs_input_grad[0] else None
        grad_w = x.t() @ grad if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_w


class MatmulIgnoringMask(torch.autograd.Function):
    """Computes every gradient whatever it is asked for (pytorch#174017)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        MatmulIgnoringMask.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def custom_functions() -> Callable[[], Microbatch]:
    w1 = nn.Parameter(torch.randn(10, 14) / 3)
    w2 = nn.Parameter(torch.randn(14, 6) / 3)

    def microbatch() -> Microbatch:
        x = torch.randn(4, 10, requires_grad=True)
        out = MatmulIgnoringMask.apply(torch.tanh(MatmulHonouringMask.apply(x, 0.5, w1)), w2)
        return _with_random_grads((out,), [x], [w1, w2])

    return microbatch


def checkpointed() -> Callable[[], Microbatch]:
    """Non-reentrant activation checkpointing: each pass recomputes the region in its own graph task."""
    block = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12))
    head = nn.Linear(12, 6)

    def microbatch() -> Microbatch:
        x = torch.randn(5, 12, requires_grad=True)
        out = head(checkpoint(block, torch.tanh(x), use_reentrant=False))
        return _with_random_grads((out,), [x], [*block.parameters(), *head.parameters()])

    return microbatch


def output_without_inputs() -> Callable[[], Microbatch]:
    """Two outputs, one of which depends on a weight only: its gradient enters the weight pass
    directly, from a root."""
    lin = nn.Linear(6, 6)
    scale = nn.Parameter(torch.randn(6))

    def microbatch() -> Microbatch:
        x = torch.randn(3, 6, requires_grad=True)
        return _with_random_grads((lin(x) * scale, scale.exp()), [x], [*lin.parameters(), scale])

    return microbatch


def input_upstream_of_a_weight() -> Callable[[], Microbatch]:
    """The stage input's own node leads to a weight: the input pass captures at it, the weight pass
    runs it. (Not in CASES: a non-leaf input has no .grad to compare with a full backward's.)"""
    lin0, lin1 = nn.Linear(5, 5), nn.Linear(5, 5)

    def microbatch() -> Microbatch:
        h = lin0(torch.randn(3, 5, requires_grad=True))
        return _with_random_grads((F.gelu(lin1(h)),), [h], [*lin0.parameters(), *lin1.parameters()])

    return microbatch


def first_stage() -> Callable[[], Microbatch]:
    """No input needs a gradient: the input pass runs nothing and the weight pass everything."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def microbatch() -> Microbatch:
        x = torch.randn(4, 8)
        return Microbatch((model(x).sum(),), None, [], list(model.parameters()))

    return microbatch


CASES: dict[str, Case] = {
    "mlp": mlp,
    "transformer_block": transformer_block,
    "transformer_block_norm_first": lambda: transformer_block(norm_first=True),
    "shared_weight": shared_weight,
    "weight_at_several_depths": weight_at_several_depths,
    "tied_embedding": tied_embedding,
    "custom_functions": custom_functions,
    "checkpointed": checkpointed,
    "output_without_inputs": output_without_inputs,
    "first_stage": first_stage,
}


@dataclass
class Gradients:
    # Per microbatch, the gradient of each input.
    inputs: list[list[torch.Tensor | None]]
    # Each weight's .grad after all microbatches.
    weights: list[torch.Tensor | None]


def train_stock(case: Case) -> Gradients:
    torch.manual_seed(SEED)
    forward = case()
    input_grads = []
    for _ in range(MICROBATCHES):
        mb = forward()
        torch.autograd.backward(mb.outputs, mb.grad_outputs)
        input_grads.append([x.grad for x in mb.inputs])
    return Gradients(input_grads, [w.grad for w in mb.weights])


def train_split(case: Case) -> Gradients:
    torch.manual_seed(SEED)
    forward = case()
    microbatches = [forward() for _ in range(MICROBATCHES)]
    input_grads, states = [], []
    for mb in microbatches:
        dinputs, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)
        input_grads.append(list(dinputs))
        states.append(state)
        assert all(x.grad is None for x in mb.inputs), "backward_input accumulated into an input's .grad"
    for state in states:
        returned = torch_ext.backward_weight(state)
    weights = microbatches[-1].weights
    assert all(r is w.grad for r, w in zip(returned, weights, strict=True))
    return Gradients(input_grads, [w.grad for w in weights])


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_split_matches_full_stock_backward(case: Case) -> None:
    stock = train_stock(case)
    split = train_split(case)
    assert_identical(split.inputs, stock.inputs, "input gradients of [microbatch]")
    assert_identical(split.weights, stock.weights, "weight .grad")


@pytest.fixture
def batched_accumulation_everywhere():
    """Weight-pass accumulation batched on CPU too (the default batches on accelerators only)."""
    before = torch_ext.get_weight_accumulation_batching()
    torch_ext.set_weight_accumulation_batching("always")
    yield
    torch_ext.set_weight_accumulation_batching(before)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_batched_accumulation_matches_full_stock_backward(case: Case, batched_accumulation_everywhere) -> None:
    # The second microbatch's weight pass accumulates into .grad that the first one made: batched.
    stock = train_stock(case)
    split = train_split(case)
    assert_identical(split.weights, stock.weights, "weight .grad")


class AccumulateCalls(TorchDispatchMode):
    """Records how many tensors each torch_ext::multi_tensor_accumulate_ call accumulates."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.torch_ext.multi_tensor_accumulate_.default:
            self.batch_sizes.append(len(args[0]))
        return func(*args, **(kwargs or {}))


def test_batched_accumulation_is_one_call_and_leaves_observed_weights_to_their_node(
    batched_accumulation_everywhere,
) -> None:
    torch.manual_seed(SEED)
    forward = mlp()
    microbatches = [forward() for _ in range(MICROBATCHES)]
    weights = microbatches[0].weights
    hooked = weights[0]
    hook_calls = []
    hooked.register_post_accumulate_grad_hook(lambda param: hook_calls.append(param.grad.clone()))
    states = [torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)[1] for mb in microbatches]
    with AccumulateCalls() as first:
        torch_ext.backward_weight(states[0])
    # No .grad yet: AccumulateGrad takes the gradient as it is, nothing to batch.
    assert first.batch_sizes == []
    with AccumulateCalls() as second:
        torch_ext.backward_weight(states[1])
    # Every weight but the hooked one, in one call; the hooked one ran its AccumulateGrad and hook.
    assert second.batch_sizes == [len(weights) - 1]
    assert len(hook_calls) == 2
    assert_identical(hook_calls[1], hooked.grad, "what the hook saw")
    torch_ext.set_weight_accumulation_batching("off")
    with pytest.raises(ValueError, match="mode must be 'off', 'accelerator' or 'always'"):
        torch_ext.set_weight_accumulation_batching("sometimes")
    assert torch_ext.get_weight_accumulation_batching() == "off"


class MatmulShapes(TorchDispatchMode):
    """Records the output shape of every matrix multiplication."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS:
            self.shapes.append(tuple(out.shape))
        return out


def weight_gradient_shapes(weights: list[torch.Tensor]) -> set[tuple[int, ...]]:
    # A weight's gradient leaves a matmul as the weight's shape or its transpose.
    return {tuple(w.shape) for w in weights if w.dim() == 2} | {tuple(w.t().shape) for w in weights if w.dim() == 2}


@pytest.mark.parametrize(
    "case",
    [mlp, transformer_block, custom_functions, input_upstream_of_a_weight],
    ids=["mlp", "transformer", "custom", "input_upstream_of_a_weight"],
)
def test_passes_split_the_matmuls(case: Case) -> None:
    torch.manual_seed(SEED)
    mb = case()()
    with MatmulShapes() as full:
        torch.autograd.grad(mb.outputs, mb.inputs + mb.weights, mb.grad_outputs, retain_graph=True)
    with MatmulShapes() as input_pass:
        _, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)
    with MatmulShapes() as weight_pass:
        torch_ext.backward_weight(state)

    weight_shapes = weight_gradient_shapes(mb.weights)
    if case is custom_functions:
        # MatmulIgnoringMask computes its weight gradient in the input pass, once.
        expected_in_input_pass = {(14, 6)}
    else:
        expected_in_input_pass = set()
    assert {s for s in input_pass.shapes if s in weight_shapes} == expected_in_input_pass
    assert input_pass.shapes, "the input pass ran no matmul"
    assert weight_pass.shapes and all(s in weight_shapes for s in weight_pass.shapes), weight_pass.shapes
    assert sorted(input_pass.shapes + weight_pass.shapes) == sorted(full.shapes), "a matmul ran twice or not at all"


def test_custom_functions_run_once_per_pass_they_are_needed_in() -> None:
    torch.manual_seed(SEED)
    mb = custom_functions()()
    MatmulHonouringMask.calls = MatmulIgnoringMask.calls = 0
    _, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)
    assert (MatmulHonouringMask.calls, MatmulIgnoringMask.calls) == (1, 1)
    torch_ext.backward_weight(state)
    # The one that honours ctx.needs_input_grad runs again for its weight gradient; the other one
    # already produced it.
    assert (MatmulHonouringMask.calls, MatmulIgnoringMask.calls) == (2, 1)


class SavedTensorTracker(torch.autograd.graph.saved_tensors_hooks):
    """Wraps every saved tensor in a holder whose weakref dies when the graph lets go of it."""

    class Holder:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def __init__(self) -> None:
        self.holders: list[tuple[int, weakref.ref]] = []

        def pack(tensor: torch.Tensor):
            holder = self.Holder(tensor)
            self.holders.append((tensor.data_ptr(), weakref.ref(holder)))
            return holder

        super().__init__(pack, lambda holder: holder.tensor)

    def alive(self) -> list[int]:
        """data_ptr of each saved tensor still held by the graph."""
        return sorted(ptr for ptr, ref in self.holders if ref() is not None)


def _two_layer_stage(tracker: SavedTensorTracker):
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with tracker:
        e = lin1(x).exp()  # saved by ExpBackward only: the input pass is its last user
        m = e * 0.5  # saved by lin2's AddmmBackward, a frontier node: the weight pass needs it
        out = torch.tanh(lin2(m))  # saved by TanhBackward only
    tensors = {"x": x, "e": e, "m": m, "out": out, "w1": lin1.weight, "w2": lin2.weight}
    ptrs = {name: t.data_ptr() for name, t in tensors.items()}
    return out, x, [*lin1.parameters(), *lin2.parameters()], ptrs


def test_input_pass_frees_what_the_weight_pass_does_not_need() -> None:
    tracker = SavedTensorTracker()
    out, x, weights, ptrs = _two_layer_stage(tracker)
    assert tracker.alive() == sorted(ptrs[k] for k in ("x", "w1", "e", "m", "w2", "out"))
    _, state = torch_ext.backward_input(out, torch.ones_like(out), [x], weights)
    # Frontier nodes (the two AddmmBackward) keep their saved tensors; the rest is released.
    assert tracker.alive() == sorted(ptrs[k] for k in ("x", "w1", "m", "w2"))
    torch_ext.backward_weight(state)
    assert tracker.alive() == []


def test_dropping_the_state_frees_everything_without_the_cyclic_gc() -> None:
    gc.collect()
    gc.disable()
    try:
        tracker = SavedTensorTracker()
        out, x, weights, _ = _two_layer_stage(tracker)
        _, state = torch_ext.backward_input(out, torch.ones_like(out), [x], weights)
        assert not gc.is_tracked(state)
        del out
        assert tracker.alive(), "the state must keep the frontier's saved tensors"
        del state
        assert tracker.alive() == [], "saved tensors outlived the state: a reference cycle?"
    finally:
        gc.enable()
    assert gc.collect() == 0


def test_a_split_backward_leaves_no_garbage_for_the_cyclic_gc() -> None:
    gc.collect()
    torch.manual_seed(SEED)
    mb = mlp()()
    _, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)
    torch_ext.backward_weight(state)
    del mb, state
    assert gc.collect() == 0


def test_hooks_fire_as_in_a_full_backward() -> None:
    def run(split: bool) -> tuple[list[str], list[torch.Tensor]]:
        torch.manual_seed(SEED)
        lin1, lin2 = nn.Linear(6, 6), nn.Linear(6, 3)
        events: list[str] = []
        for name, p in [("w1", lin1.weight), ("b1", lin1.bias), ("w2", lin2.weight), ("b2", lin2.bias)]:
            p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"accumulated {name}"))
        x = torch.randn(4, 6, requires_grad=True)
        h = lin1(x)  # h's grad_fn is a frontier node
        h.register_hook(lambda grad: (events.append("tensor hook"), grad * 2)[1])
        h.grad_fn.register_prehook(lambda grads: events.append("node pre-hook"))
        out = lin2(torch.tanh(h))
        grad = torch.randn_like(out)
        if split:
            _, state = torch_ext.backward_input(out, grad, [x], [*lin1.parameters(), *lin2.parameters()])
            events.append("input pass done")
            torch_ext.backward_weight(state)
        else:
            torch.autograd.backward(out, grad)
        return events, [p.grad for p in (*lin1.parameters(), *lin2.parameters())]

    stock_events, stock_grads = run(split=False)
    split_events, split_grads = run(split=True)
    boundary = split_events.index("input pass done")
    assert not any(e.startswith("accumulated") for e in split_events[:boundary])
    split_events.remove("input pass done")
    assert sorted(split_events) == sorted(stock_events)
    assert split_events.count("tensor hook") == split_events.count("node pre-hook") == 1
    assert_identical(split_grads, stock_grads, "weight .grad")


def test_retain_graph_keeps_the_graph_for_another_backward() -> None:
    torch.manual_seed(SEED)
    mb = mlp()()
    dinputs, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights, retain_graph=True)
    split_grads = list(torch_ext.backward_weight(state, retain_graph=True))
    stock = torch.autograd.grad(mb.outputs, mb.inputs + mb.weights, mb.grad_outputs)
    assert_identical(list(dinputs) + split_grads, list(stock), "gradient")


def test_unused_weights_and_inputs() -> None:
    lin, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward_input: weight 2 is not used to compute the outputs"):
        torch_ext.backward_input(lin(x).sum(), None, [x], [*lin.parameters(), unused.weight])
    with pytest.raises(RuntimeError, match="backward_input: input 1 is not used to compute the outputs"):
        torch_ext.backward_input(lin(x).sum(), None, [x, y], list(lin.parameters()))
    dinputs, state = torch_ext.backward_input(
        lin(x).sum(), None, [x, y], [*lin.parameters(), unused.weight], allow_unused=True
    )
    assert dinputs[1] is None
    grads = torch_ext.backward_weight(state)
    assert grads[2] is None and unused.weight.grad is None
    assert grads[0] is not None and grads[1] is not None


def test_misuse_raises() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x).sum()
    _, state = torch_ext.backward_input(out, None, [x], list(lin.parameters()))
    torch_ext.backward_weight(state)
    with pytest.raises(RuntimeError, match="backward_weight: this state was already resumed"):
        torch_ext.backward_weight(state)
    # The input pass freed the graph's saved tensors: stock's error, as for a second backward.
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        torch_ext.backward_input(out, None, [x], list(lin.parameters()))

    with pytest.raises(TypeError, match="backward_weight expects the state that torch_ext.backward_input returned"):
        torch_ext.backward_weight([{"params": set()}])
    with pytest.raises(TypeError, match="cannot create 'torch_ext._C.SplitState' instances"):
        torch_ext.SplitState()

    with pytest.raises(RuntimeError, match="backward_input: weight 0 is not a leaf tensor"):
        torch_ext.backward_input(lin(x).sum(), None, [x], [lin.weight * 2])
    with pytest.raises(RuntimeError, match="backward_input: weight 0 does not require grad"):
        torch_ext.backward_input(lin(x).sum(), None, [x], [torch.ones(4)])


def test_a_full_backward_between_the_passes_frees_the_weight_pass_graph() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x).sum()  # SumBackward0 saves no tensor: a second backward through it succeeds
    _, state = torch_ext.backward_input(out, None, [x], list(lin.parameters()))
    torch.autograd.backward(out)  # runs and releases lin's AddmmBackward, the frontier node
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        torch_ext.backward_weight(state)


def test_state_repr() -> None:
    torch.manual_seed(SEED)
    mb = mlp()()
    _, state = torch_ext.backward_input(mb.outputs, mb.grad_outputs, mb.inputs, mb.weights)
    assert repr(state) == "<torch_ext SplitState: 3 frontier nodes, 9 weight-side nodes, 6 weights>"
    torch_ext.backward_weight(state)
    assert repr(state) == "<torch_ext SplitState: weight pass done>"


def test_input_grad_of_an_input_upstream_of_a_weight() -> None:
    """An input whose own node leads to a weight: captured by the input pass, run by the weight pass."""

    def run(split: bool):
        torch.manual_seed(SEED)
        lin0, lin1 = nn.Linear(5, 5), nn.Linear(5, 5)
        a = torch.randn(3, 5, requires_grad=True)
        h = lin0(a)  # the input of the "stage"; lin0 is upstream of it
        out = F.gelu(lin1(h))
        grad = torch.randn_like(out)
        weights = [*lin0.parameters(), *lin1.parameters()]
        if not split:
            return list(torch.autograd.grad(out, [h, *weights], grad))
        (dh,), state = torch_ext.backward_input(out, grad, [h], weights)
        torch_ext.backward_weight(state)
        return [dh] + [w.grad for w in weights]

    assert_identical(run(split=True), run(split=False), "gradient")


def test_hooks_of_an_input_upstream_of_a_weight_run_once() -> None:
    """The input's node is captured at in the input pass (tensor hooks, retain_grad) and run in the
    weight pass (apply): each of its hooks runs once, as in one full backward."""

    def run(how: str):
        torch.manual_seed(SEED)
        lin0, lin1 = nn.Linear(5, 5), nn.Linear(5, 5)
        a = torch.randn(3, 5, requires_grad=True)
        h = lin0(a)
        h.retain_grad()
        calls = {"tensor hook": 0, "node pre-hook": 0, "node post-hook": 0}

        def tensor_hook(grad):
            calls["tensor hook"] += 1
            return grad * 2  # what the weight pass must see, once

        h.register_hook(tensor_hook)
        h.grad_fn.register_prehook(lambda grads: calls.__setitem__("node pre-hook", calls["node pre-hook"] + 1))
        h.grad_fn.register_hook(lambda gi, go: calls.__setitem__("node post-hook", calls["node post-hook"] + 1))
        out = F.gelu(lin1(h))
        grad = torch.randn_like(out)
        weights = [*lin0.parameters(), *lin1.parameters()]
        if how == "stock grad of the input":
            return torch.autograd.grad(out, [h], grad)[0]
        if how == "stock grad of the input and weights":
            return torch.autograd.grad(out, [h, *weights], grad)[0]
        if how == "stock backward":
            torch.autograd.backward(out, grad)
            dh = None
        else:
            (dh,), state = torch_ext.backward_input(out, grad, [h], weights)
            torch_ext.backward_weight(state)
        return dh, h.grad, [w.grad for w in weights], calls

    _, stock_h_grad, stock_weight_grads, stock_calls = run("stock backward")
    dh, h_grad, weight_grads, calls = run("split")
    assert calls == stock_calls == {"tensor hook": 1, "node pre-hook": 1, "node post-hook": 1}
    assert_identical([h_grad, *weight_grads], [stock_h_grad, *stock_weight_grads], "retained or weight .grad")
    # The returned input gradient is grad(outputs, inputs)'s: after the tensor hooks. Stock's
    # grad(outputs, [h, *weights]) returns the one before them, since there h's node also runs.
    assert_identical(dh, run("stock grad of the input"), "input gradient")
    assert_identical(dh, run("stock grad of the input and weights") * 2, "input gradient")


def test_batched_accumulation_skips_a_weight_frozen_between_the_passes(batched_accumulation_everywhere) -> None:
    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(SEED)
        w = torch.randn(4, 4, requires_grad=True)
        w.grad = torch.ones(4, 4)  # accumulated into in place: batched
        x = torch.randn(2, 4, requires_grad=True)
        out = (x @ w).tanh()
        grad = torch.randn_like(out)
        if split:
            _, state = torch_ext.backward_input(out, grad, [x], [w])
            w.requires_grad_(False)  # AccumulateGrad then leaves .grad alone
            torch_ext.backward_weight(state)
        else:
            w.requires_grad_(False)
            torch.autograd.backward(out, grad)
        return w.grad

    assert_identical(run(split=True), run(split=False), "w.grad")


@pytest.mark.parametrize("hooked_runs_first", [False, True], ids=["hooked_after_batched", "hooked_before_batched"])
def test_batched_accumulation_is_done_before_anything_observes_it(hooked_runs_first: bool) -> None:
    """Another weight's post-accumulate-grad hook, and a final callback it queues, see the .grad that
    one full backward shows them, whether or not the weight pass batches the unhooked weight."""

    def run(how: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(SEED)
        hooked = torch.randn(4, 4, requires_grad=True)
        plain = torch.randn(4, 4, requires_grad=True)  # no hook: batched in mode "always"
        hooked.grad, plain.grad = torch.zeros(4, 4), torch.ones(4, 4)
        seen: dict[str, torch.Tensor] = {}

        def hook(param: torch.Tensor) -> None:
            seen["hook"] = plain.grad.clone()
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: seen.__setitem__("final callback", plain.grad.clone())
            )

        hooked.register_post_accumulate_grad_hook(hook)
        x = torch.randn(3, 4, requires_grad=True)
        # A full backward accumulates the weight used last in the forward first.
        first, second = (plain, hooked) if hooked_runs_first else (hooked, plain)
        out = ((x @ first) @ second).tanh()
        grad = torch.randn_like(out)
        if how == "stock":
            torch.autograd.backward(out, grad)
        else:
            before = torch_ext.get_weight_accumulation_batching()
            torch_ext.set_weight_accumulation_batching(how)
            try:
                _, state = torch_ext.backward_input(out, grad, [x], [hooked, plain])
                torch_ext.backward_weight(state)
            finally:
                torch_ext.set_weight_accumulation_batching(before)
        seen["after"] = plain.grad
        return seen

    stock = run("stock")
    for mode in ("off", "always"):
        split = run(mode)
        assert_identical(split, stock, mode)


def _weight_pass_peak_bytes(state) -> int:
    """Peak CPU bytes allocated and not yet freed while the weight pass runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch_ext.backward_weight(state)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("max_batched", [None, 2], ids=["default_bound", "bound_of_two_gradients"])
def test_batched_accumulation_holds_a_bounded_number_of_gradients(
    max_batched: int | None, batched_accumulation_everywhere
) -> None:
    """Stock frees each weight's gradient after its AccumulateGrad; the batch holds gradients until it
    flushes, and flushes once they reach a byte bound."""
    # Registers the op the batch calls, outside the profiled pass.
    import torch_ext.kernels

    num_weights, width = 8, 256
    grad_bytes = width * width * 4

    def run(split: bool):
        torch.manual_seed(SEED)
        weights = [torch.randn(width, width, requires_grad=True) for _ in range(num_weights)]
        for w in weights:
            w.grad = torch.randn(width, width)  # accumulated into in place: batched
        x = torch.randn(4, width, requires_grad=True)
        out = x
        for w in weights:
            out = out @ w
        grad = torch.randn_like(out)
        if not split:
            torch.autograd.backward(out, grad)
            return [w.grad for w in weights], None, None
        _, state = torch_ext.backward_input(out, grad, [x], weights)
        with AccumulateCalls() as calls:
            peak = _weight_pass_peak_bytes(state)
        return [w.grad for w in weights], peak, calls.batch_sizes

    previous = None if max_batched is None else torch_ext._C._set_max_batched_gradient_bytes(max_batched * grad_bytes)
    try:
        grads, peak, batch_sizes = run(split=True)
    finally:
        if previous is not None:
            torch_ext._C._set_max_batched_gradient_bytes(previous)
    stock_grads, _, _ = run(split=False)
    assert_identical(grads, stock_grads, "weight .grad")
    if max_batched is None:
        # 2 MiB of gradients, under the default bound of 32 MiB: one batch, held to the end.
        assert batch_sizes == [num_weights]
        assert peak >= num_weights * grad_bytes
    else:
        assert batch_sizes == [max_batched] * (num_weights // max_batched)
        # The held gradients plus the small activation gradients the pass computes on the way.
        assert max_batched * grad_bytes <= peak < (max_batched + 1) * grad_bytes


def _bias_added_to_the_input():
    """AddBackward passes its gradient through: the input's gradient is the frontier node's input."""
    b, w = torch.randn(4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    return (x + b) @ w, x, [b, w]


def _input_upstream_of_a_weight():
    """The input's node is in the weight subgraph: the state keeps the gradient captured at it."""
    lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 4)
    h = lin0(torch.randn(3, 4, requires_grad=True))
    return F.gelu(lin1(h)), h, [*lin0.parameters(), *lin1.parameters()]


@pytest.mark.parametrize("graph", [_bias_added_to_the_input, _input_upstream_of_a_weight], ids=["bias", "upstream"])
def test_modifying_an_input_gradient_between_the_passes_leaves_the_weights_alone(graph) -> None:
    def run(split: bool):
        torch.manual_seed(SEED)
        out, x, weights = graph()
        grad = torch.randn_like(out)
        if not split:
            x.retain_grad()
            torch.autograd.backward(out, grad)
            return [x.grad], [w.grad for w in weights]
        (dx,), state = torch_ext.backward_input(out, grad, [x], weights)
        returned = dx.clone()
        dx.mul_(0.5)  # e.g. scaled in place before it is sent to the previous stage
        torch_ext.backward_weight(state)
        return [returned], [w.grad for w in weights]

    (stock_dx, stock_weights), (dx, weight_grads) = run(split=False), run(split=True)
    assert_identical(dx, stock_dx, "input gradient")
    assert_identical(weight_grads, stock_weights, "weight .grad")


def test_two_threads_resuming_one_state_run_its_weight_pass_once() -> None:
    """backward_weight releases the GIL: of two threads resuming one state, exactly one runs it."""
    import threading

    def resume(state, start: threading.Barrier, outcomes: list[str]) -> None:
        start.wait()
        try:
            torch_ext.backward_weight(state)
            outcomes.append("ran")
        except RuntimeError as error:
            outcomes.append(str(error))

    for _ in range(50):
        torch.manual_seed(SEED)
        lin = nn.Linear(16, 16)
        x = torch.randn(4, 16, requires_grad=True)
        out = torch.tanh(lin(x))
        _, state = torch_ext.backward_input(out, torch.ones_like(out), [x], list(lin.parameters()))
        start = threading.Barrier(2)
        outcomes: list[str] = []
        threads = [threading.Thread(target=resume, args=(state, start, outcomes)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(outcomes) == 2 and outcomes.count("ran") == 1, outcomes
        assert "this state was already resumed" in next(o for o in outcomes if o != "ran")
        stock = torch.autograd.grad(torch.tanh(lin(x)), list(lin.parameters()), torch.ones_like(out))
        assert_identical([p.grad for p in lin.parameters()], list(stock), "weight .grad")


def test_an_output_that_is_an_input_upstream_of_a_weight() -> None:
    """The single root is the input's node, in the weight subgraph: the input pass still delivers the
    root gradient to it, for the capture."""

    def run(split: bool):
        torch.manual_seed(SEED)
        lin0 = nn.Linear(5, 5)
        h = lin0(torch.randn(3, 5, requires_grad=True))
        h.register_hook(lambda grad: grad * 2)
        grad = torch.randn_like(h)
        if not split:
            h.retain_grad()
            torch.autograd.backward(h, grad)
            return [h.grad] + [p.grad for p in lin0.parameters()]
        (dh,), state = torch_ext.backward_input(h, grad, [h], list(lin0.parameters()))
        torch_ext.backward_weight(state)
        return [dh] + [p.grad for p in lin0.parameters()]

    assert_identical(run(split=True), run(split=False), "gradient")
