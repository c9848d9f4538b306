"""torch_ext's engine against stock torch.autograd on the same graphs: gradients, node order, hooks, errors.

Each case is a ``build()`` returning ``(roots, leaves)``; :func:`engine_helpers.assert_backward_matches_stock`
runs it on both engines. Hooks log through :func:`engine_helpers.hook`, so the hook call logs are
compared too, and each hook test also checks that the hooks it installs really fired (on stock).
"""

import contextlib
import functools
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_backward_matches_stock, assert_same_error, hook, record
from torch import nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook
from torch.autograd.variable import Variable
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical

# The stock C++ engine (torch.autograd's until torch_ext is first used).
STOCK_ENGINE = torch._C._ImperativeEngine()


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


# ---------------------------------------------------------------- entry points into torch_ext


def backward_under_enabled(roots, grad_tensors=None, retain_graph=None):
    """Plain ``torch.autograd.backward`` with torch_ext installed as torch.autograd's engine."""
    with torch_ext.enable():
        assert torch_ext.is_enabled()
        torch.autograd.backward(roots, grad_tensors=grad_tensors, retain_graph=retain_graph)


def backward_via_op(roots, grad_tensors=None, retain_graph=None):
    """``torch.ops.torch_ext.backward``: Tensor roots only, and every gradient given explicitly."""
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = [grad_tensors] * len(roots) if grad_tensors is None else [grad_tensors]
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grad_tensors)]
    torch.ops.torch_ext.backward(list(roots), grads, retain_graph=bool(retain_graph))


ENTRY_POINTS = {
    "torch_ext.backward": None,
    "enabled": backward_under_enabled,
    "torch.ops.torch_ext.backward": backward_via_op,
}


# ---------------------------------------------------------------- models and graphs


def mlp_shared_weights():
    shared = nn.Linear(8, 8)
    head = nn.Linear(8, 3)
    x = torch.randn(5, 8, requires_grad=True)
    h = torch.relu(shared(x))
    h = torch.tanh(shared(h))  # the same weight and bias a second time
    loss = F.cross_entropy(head(h), torch.tensor([0, 1, 2, 1, 0]))
    return loss, [x, *shared.parameters(), *head.parameters()]


def conv_bn_pool():
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 2),
    )
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    return net(x).logsumexp(1).mean(), [x, *net.parameters()]


def multihead_attention():
    attention = nn.MultiheadAttention(16, 4, batch_first=True)
    norm = nn.LayerNorm(16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    h = norm(x)
    out, weights = attention(h, h, h)
    return (norm(x + out).square().sum() + weights.sum()), [x, *attention.parameters(), *norm.parameters()]


def handwritten_attention():
    norm = nn.LayerNorm(8)
    wq, wk, wv = leaf(8, 8), leaf(8, 8), leaf(8, 8)
    x = torch.randn(3, 6, 8, requires_grad=True)
    h = norm(x)
    q, k, v = h @ wq, h @ wk, h @ wv
    attention = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)
    return (attention @ v).sum(), [x, wq, wk, wv, *norm.parameters()]


def several_roots():
    x, w = leaf(4, 3), leaf(3)
    a = x * w
    b = a.sin()  # `a` is a root and is also reachable from root `b`
    c = (x @ w).exp()
    return (b, a, c), [x, w]


def roots_with_leaf_and_duplicate():
    x, w = leaf(3), leaf(3)
    y = x * w
    return (y, x, y), [x, w]  # a leaf root and the same root twice


def leaf_reached_many_times():
    x, w = leaf(4), leaf(4)
    total = x * 0
    for i in range(12):
        total = total + (x * (i + 1)).sin() * w
    return (total * x).sum(), [x, w]


def gradient_edge_roots():
    x, w = leaf(3, 3), leaf(3)
    h = torch.tanh(x @ w)
    out = h.exp()
    return (get_gradient_edge(h), get_gradient_edge(out), get_gradient_edge(w)), [x, w]


def gradient_edge_of_second_output():
    x = leaf(4, 3)
    _, second = (x * 2).split(2)
    return get_gradient_edge(second), [x]


def gradient_edges_of_both_outputs():
    x = leaf(4, 3)
    first, second = x.exp().split(2)
    return (get_gradient_edge(second), get_gradient_edge(first)), [x]


def copy_slices():
    x, z, u = leaf(4, 3), leaf(2), leaf(3)
    y = x.clone()
    y[1:3].mul_(2)
    y.view(-1)[0] = z.sum()
    y[:, 1].add_(x[:, 0] * 3)
    y[3].copy_(u.exp())
    row = y[2]
    row.mul_(z[0])  # in place on a view of a view
    return (y.sin().sum()), [x, z, u]


def views_and_inplace_chain():
    x = leaf(2, 6)
    y = x.clone()
    y.t_()
    y.transpose(0, 1)[0].div_(3)
    y.unsqueeze(0).squeeze(0).narrow(0, 1, 2).sub_(1)
    return (y * y).sum(), [x]


class MaskedDouble(Function):
    """Returns a mask it marks non-differentiable beside the differentiable output."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(mask)
        return x * 2, mask

    @staticmethod
    def backward(ctx, grad, grad_mask):
        record("MaskedDouble.backward", grad, grad_mask)
        (mask,) = ctx.saved_tensors
        return grad * 2 * (1 + mask)


class FirstOnly(Function):
    """Returns None as the gradient of an input that requires grad."""

    @staticmethod
    def forward(ctx, x, y, scale):
        ctx.save_for_backward(y)
        ctx.scale = scale
        return x * y * scale

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y * ctx.scale, None, None


class Cube(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class LooseGrad(Function):
    """A backward whose gradient the engine must fix up: float64, and broadcast (expandable) in shape."""

    @staticmethod
    def forward(ctx, x):
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        return (grad * 3).double().expand(2, *grad.shape)


def custom_functions():
    x, y, z = leaf(5), leaf(5), leaf(5)
    doubled, mask = MaskedDouble.apply(x)
    product = FirstOnly.apply(doubled, y, 0.5)
    cubed = Cube.apply(product + z)
    loose = LooseGrad.apply(cubed)
    return (loose.sum() + mask.sum()), [x, y, z]


def retained_graph():
    x, w = leaf(3, 3), leaf(3)
    return torch.tanh(x @ w).pow(2).sum(), [x, w]


def checkpointed(use_reentrant):
    first, second = nn.Linear(6, 6), nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)
    h = checkpoint(lambda t: torch.tanh(second(torch.relu(first(t)))), x, use_reentrant=use_reentrant)
    return (h * x).sum(), [x, *first.parameters(), *second.parameters()]


CASES = {
    "mlp_shared_weights": (mlp_shared_weights, {}),
    "conv_bn_pool": (conv_bn_pool, {}),
    "multihead_attention": (multihead_attention, {}),
    "handwritten_attention": (handwritten_attention, {}),
    "several_roots": (several_roots, {"grad_tensors": (torch.ones(4, 3), torch.full((4, 3), 0.5), torch.arange(4.0))}),
    "roots_with_leaf_and_duplicate": (
        roots_with_leaf_and_duplicate,
        {"grad_tensors": [torch.ones(3), torch.full((3,), 2.0), torch.full((3,), -1.0)]},
    ),
    "leaf_reached_many_times": (leaf_reached_many_times, {}),
    "gradient_edge_of_second_output": (gradient_edge_of_second_output, {"grad_tensors": torch.ones(2, 3)}),
    "gradient_edges_of_both_outputs": (
        gradient_edges_of_both_outputs,
        {"grad_tensors": [torch.ones(2, 3), torch.full((2, 3), 3.0)]},
    ),
    "copy_slices": (copy_slices, {}),
    "views_and_inplace_chain": (views_and_inplace_chain, {}),
    "custom_functions": (custom_functions, {}),
    "retain_graph_twice_accumulates": (retained_graph, {"retain_graph": True, "runs": 2}),
    # validate_outputs casts a root gradient of another dtype to the root's.
    "root_grads_of_other_dtypes": (
        several_roots,
        {"grad_tensors": [torch.ones(4, 3, dtype=torch.int64), torch.ones(4, 3, dtype=torch.float64), torch.ones(4)]},
    ),
    "reentrant_checkpoint": (functools.partial(checkpointed, True), {}),
    "non_reentrant_checkpoint": (functools.partial(checkpointed, False), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_graph_matches_stock(case):
    build, options = CASES[case]
    assert_backward_matches_stock(build, **options)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", ["mlp_shared_weights", "several_roots", "copy_slices", "reentrant_checkpoint"])
def test_entry_points_match_stock(entry, case):
    build, options = CASES[case]
    assert_backward_matches_stock(build, ext_backward=ENTRY_POINTS[entry], **options)


def test_gradient_edge_roots_match_stock():
    result = assert_backward_matches_stock(
        gradient_edge_roots, grad_tensors=[torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 5.0)]
    )
    assert all(grad is not None for grad in result.grads)


# ---------------------------------------------------------------- hooks


def tensor_hooks():
    x, w = leaf(3), leaf(3)
    x.register_hook(hook("x: leaf hook"))
    w.register_hook(hook("w: leaf hook replacing", lambda g: g * 2))
    w.register_hook(hook("w: sees replaced"))
    h = x * w
    h.register_hook(hook("h: non-leaf hook"))
    h.register_hook(hook("h: replacing", lambda g: g + 1))
    h.register_hook(hook("h: sees replaced"))
    return h.sin().sum(), [x, w]


def root_hooks():
    x, w = leaf(3), leaf(3)
    h = x * w
    loss = h.sin().sum()
    loss.register_hook(hook("loss: root hook replacing", lambda g: g * 2))
    loss.retain_grad()
    h.register_hook(hook("h: root and non-leaf"))
    x.register_hook(hook("x: leaf root"))
    return (loss, h, x), [x, w, loss]


def retain_grad_after_replacing_hook():
    x = leaf(3)
    h = x.exp()
    h.retain_grad()
    h.register_hook(hook("h: replacing", lambda g: g * 10))  # runs before the retains-grad hook
    k = h * 2
    k.retain_grad()
    return k.sum(), [x, h, k]


def node_prehooks():
    x, w = leaf(3), leaf(3)
    h = x * w
    h.grad_fn.register_prehook(hook("MulBackward0 prehook: replaces input", lambda gos: (gos[0] * 3,)))
    h.grad_fn.register_prehook(hook("MulBackward0 prehook: sees replaced"))
    h.register_hook(hook("h: tensor hook"))  # tensor pre-hooks run before node pre-hooks
    return h.cos().sum(), [x, w]


def node_posthooks():
    x, w = leaf(3), leaf(3)
    h = x * w
    h.grad_fn.register_hook(hook("MulBackward0 post: replaces outputs", lambda gis, gos: (gis[0] * 2, None)))
    h.grad_fn.register_hook(hook("MulBackward0 post: sees replaced"))
    accumulate_x = get_gradient_edge(x).node
    accumulate_x.register_hook(hook("AccumulateGrad(x) post"))
    return h.tanh().sum(), [x, w]


def post_accumulate_grad_hooks():
    x, w = leaf(3), leaf(3)
    x.register_post_accumulate_grad_hook(lambda p: record("x: post-accumulate", p.grad))
    w.register_hook(hook("w: tensor hook"))
    w.register_post_accumulate_grad_hook(lambda p: record("w: post-accumulate", p.grad))
    return (x * w).sum() + (x * x).sum(), [x, w]


def module_full_backward_hooks():
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    net[0].register_full_backward_pre_hook(hook("linear0: pre"))
    net[0].register_full_backward_hook(hook("linear0: post"))
    net[2].register_full_backward_pre_hook(hook("linear2: pre, halves grad_output", lambda m, go: (go[0] * 0.5,)))
    net[2].register_full_backward_hook(hook("linear2: post"))
    net.register_full_backward_hook(hook("sequential: post, replaces grad_input", lambda m, gi, go: (gi[0] + 1,)))
    x = torch.randn(3, 4, requires_grad=True)
    return net(x).sum(), [x, *net.parameters()]


def module_hook_input_without_grad():
    linear = nn.Linear(4, 2)
    linear.register_full_backward_hook(hook("linear: post, grad_input None"))
    return linear(torch.randn(3, 4)).sum(), list(linear.parameters())


def hooks_queue_callback():
    x = leaf(3)
    h = x * 2

    def queue(grad):
        record("h: queues callback")
        Variable._execution_engine.queue_callback(lambda: record("final callback", x.grad))

    h.register_hook(queue)
    x.register_post_accumulate_grad_hook(lambda p: record("x: post-accumulate"))
    return h.sum(), [x]


def hooks_read_graph_task_id():
    x = leaf(3)
    h = x * 2
    ids = []

    def read_task_id(label):
        def read(grad):
            ids.append(torch._C._current_graph_task_id())
            record(label, ids[-1] != -1, ids[-1] == ids[0])

        return read

    h.register_hook(read_task_id("h: task id valid, same as first"))
    x.register_hook(read_task_id("x: task id valid, same as first"))
    return h.sum(), [x]


def hooks_read_engine_state():
    x, w, unrelated = leaf(3), leaf(3), leaf(3)
    h = x * w
    out = h.sin()
    nodes = [out.grad_fn, h.grad_fn, get_gradient_edge(x).node, (unrelated * 2).grad_fn]

    def read_state(grad):
        record(
            "h: will execute, checkpoint valid, grad mode",
            tuple(torch._C._will_engine_execute_node(node) for node in nodes),
            torch.autograd._is_checkpoint_valid(),
            torch.is_grad_enabled(),
        )

    h.register_hook(read_state)
    return out.sum(), [x, w]


def hooks_observe_gradient_stealing():
    # AccumulateGrad adopts the incoming gradient as .grad when nothing else holds it, and copies it otherwise.
    x, w, v = leaf(3), leaf(3), leaf(3)
    seen = {}
    h = x * 2
    h.grad_fn.register_hook(lambda gis, gos: seen.update(x=gis[0].data_ptr()))
    w.register_hook(lambda g: seen.update(w=g.data_ptr()))
    kept = []

    def keep(grad):
        kept.append(grad)
        seen.update(v=grad.data_ptr())

    v.register_hook(keep)
    for name, tensor in (("x", x), ("w", w), ("v", v)):
        tensor.register_post_accumulate_grad_hook(
            lambda p, name=name: record(f"{name}: .grad is the incoming gradient", p.grad.data_ptr() == seen[name])
        )
    return (h * 3).sum() + (w * 2).sum() + (v * 2).sum(), [x, w, v]


def prehook_registers_posthook():
    x, w = leaf(3), leaf(3)
    h = x * w

    def register_late(grad_outputs):
        record("prehook: registers a post hook")
        h.grad_fn.register_hook(hook("post hook registered while running"))

    h.grad_fn.register_prehook(register_late)
    return h.sum(), [x, w]


def nested_backward_in_hook():
    # Under enable() the inner torch.autograd.backward runs on torch_ext too (a nested host task); from
    # torch_ext.backward it is a stock backward reentrant in torch_ext's host task.
    x, inner_leaf = leaf(3), leaf(3)
    inner = (inner_leaf * 3).exp()
    inner.register_hook(hook("inner: tensor hook"))
    inner_leaf.register_post_accumulate_grad_hook(lambda p: record("inner leaf: accumulated", p.grad))
    inner_loss = inner.sum()
    h = x * 2

    def run_inner_backward(grad):
        record("outer: hook starts inner backward", torch._C._current_graph_task_id() != -1)
        torch.autograd.backward(inner_loss)
        record("outer: inner backward returned")

    h.register_hook(run_inner_backward)
    return (h * h).sum(), [x, inner_leaf]


def multi_grad_hooks(mode):
    a, b, unused = leaf(3), leaf(3), leaf(3)
    c = a * b
    register_multi_grad_hook((a, b, c, unused), hook(f"multi-grad hook ({mode})"), mode=mode)
    return c.sum(), [a, b]


HOOK_CASES = {
    "tensor_hooks": (
        tensor_hooks,
        [
            "h: non-leaf hook",
            "h: replacing",
            "h: sees replaced",
            "x: leaf hook",
            "w: leaf hook replacing",
            "w: sees replaced",
        ],
    ),
    "root_hooks": (root_hooks, ["loss: root hook replacing", "h: root and non-leaf", "x: leaf root"]),
    "retain_grad": (retain_grad_after_replacing_hook, ["h: replacing"]),
    "node_prehooks": (
        node_prehooks,
        ["h: tensor hook", "MulBackward0 prehook: replaces input", "MulBackward0 prehook: sees replaced"],
    ),
    "node_posthooks": (
        node_posthooks,
        ["MulBackward0 post: replaces outputs", "MulBackward0 post: sees replaced", "AccumulateGrad(x) post"],
    ),
    "post_accumulate_grad_hooks": (
        post_accumulate_grad_hooks,
        ["x: post-accumulate", "w: tensor hook", "w: post-accumulate"],
    ),
    "module_full_backward_hooks": (
        module_full_backward_hooks,
        [
            "linear2: pre, halves grad_output",
            "linear2: post",
            "linear0: pre",
            "linear0: post",
            "sequential: post, replaces grad_input",
        ],
    ),
    "module_hook_input_without_grad": (module_hook_input_without_grad, ["linear: post, grad_input None"]),
    "queue_callback": (hooks_queue_callback, ["h: queues callback", "x: post-accumulate", "final callback"]),
    "graph_task_id": (hooks_read_graph_task_id, ["h: task id valid, same as first", "x: task id valid, same as first"]),
    "engine_state": (hooks_read_engine_state, ["h: will execute, checkpoint valid, grad mode"]),
    "gradient_stealing": (
        hooks_observe_gradient_stealing,
        ["v: .grad is the incoming gradient", "w: .grad is the incoming gradient", "x: .grad is the incoming gradient"],
    ),
    "prehook_registers_posthook": (
        prehook_registers_posthook,
        ["prehook: registers a post hook", "post hook registered while running"],
    ),
    "nested_backward": (
        nested_backward_in_hook,
        [
            "outer: hook starts inner backward",
            "inner: tensor hook",
            "inner leaf: accumulated",
            "outer: inner backward returned",
        ],
    ),
    "multi_grad_hook_any": (functools.partial(multi_grad_hooks, "any"), ["multi-grad hook (any)"]),
    "multi_grad_hook_all": (functools.partial(multi_grad_hooks, "all"), ["multi-grad hook (all)"]),
}


# Root gradients for the cases with several roots; the rest have one scalar root.
HOOK_CASE_GRADS = {"root_hooks": [torch.ones(()), torch.full((3,), 2.0), torch.full((3,), 3.0)]}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed with respect to module")
@pytest.mark.parametrize("entry", ["torch_ext.backward", "enabled"])
@pytest.mark.parametrize("case", HOOK_CASES)
def test_hooks_match_stock(case, entry):
    build, fired = HOOK_CASES[case]
    result = assert_backward_matches_stock(
        build, grad_tensors=HOOK_CASE_GRADS.get(case), ext_backward=ENTRY_POINTS[entry]
    )
    assert result.hook_labels == fired


def test_hook_replacing_gradient_reaches_leaf():
    # Guards against a log that matches because neither engine used the replaced gradient.
    result = assert_backward_matches_stock(node_prehooks)
    torch.manual_seed(0)
    x, w = leaf(3), leaf(3)
    assert_identical(result.grads[0], -(x * w).sin() * 3 * w, "x.grad")


def test_graph_task_id_is_valid_and_new_per_backward():
    ids = []
    x = leaf(3)
    h = x * 2
    h.register_hook(lambda g: ids.append(torch._C._current_graph_task_id()))
    torch_ext.backward(h.sum(), retain_graph=True)
    torch_ext.backward(h.sum())
    assert len(ids) == 2 and -1 not in ids and ids[0] != ids[1]
    assert torch._C._current_graph_task_id() == -1


def test_queue_callback_outside_backward_raises_like_stock():
    assert_same_error(
        lambda: STOCK_ENGINE.queue_callback(lambda: None), lambda: torch_ext.Engine().queue_callback(lambda: None)
    )


def test_current_autograd_node_in_hook_matches_stock():
    def build():
        x = leaf(3)
        h = x * 2
        h.register_hook(lambda g: record("current node", torch._C._current_autograd_node().name()))
        return h.sum(), [x]

    result = assert_backward_matches_stock(build)
    assert [event[2] for event in result.log if event[0] == "hook"] == [("MulBackward0",)]


def test_current_graph_task_execution_order_matches_stock():
    def build():
        x, w = leaf(3), leaf(3)
        loss = (x * w).sin().sum()
        loss.grad_fn.register_prehook(
            lambda gos: record("order", tuple(n.name() for n in torch._C._current_graph_task_execution_order()))
        )
        return loss, [x, w]

    with torch.autograd.set_multithreading_enabled(False):
        result = assert_backward_matches_stock(build)
    assert result.hook_labels == ["order"]


def test_thread_local_state_restored_before_each_node():
    def build():
        x = leaf(3)
        a = x * 2
        b = a * 3
        b.register_hook(lambda g: torch.set_autocast_enabled("cpu", True))
        a.register_hook(lambda g: record("a: autocast enabled", torch.is_autocast_enabled("cpu")))
        return b.sum(), [x]

    try:
        result = assert_backward_matches_stock(build)
    finally:
        torch.set_autocast_enabled("cpu", False)
    assert result.hook_labels == ["a: autocast enabled"]


def _sequence_numbers_used_by(backward, make_roots):
    torch.manual_seed(0)
    x = leaf(2)
    before = (x * 2).grad_fn._sequence_nr()
    backward(make_roots(x))
    return (x * 2).grad_fn._sequence_nr() - before


# Stock gives zero or several roots a GraphRoot node, which takes a sequence number; forward ops recorded after a
# torch_ext backward must be numbered as after stock's (the profiler links backward to forward by them).
SEQUENCE_NR_CASES = {
    "one_root": lambda x: x.sum(),
    "two_roots": lambda x: [x.sum(), (x * 3).sum()],
    "gradient_edge_roots": lambda x: [get_gradient_edge(x.sum()), get_gradient_edge((x * 3).sum())],
    "no_roots": lambda x: [],
}


@pytest.mark.parametrize("make_roots", SEQUENCE_NR_CASES.values(), ids=SEQUENCE_NR_CASES.keys())
def test_sequence_numbers_taken_like_stock(make_roots):
    def backward(roots):
        torch_or_ext = torch.autograd if backward.engine == "stock" else torch_ext
        grads = None if isinstance(roots, torch.Tensor) else [torch.ones(())] * len(roots)
        torch_or_ext.backward(roots, grads)

    backward.engine = "stock"
    stock = _sequence_numbers_used_by(backward, make_roots)
    backward.engine = "ext"
    assert _sequence_numbers_used_by(backward, make_roots) == stock


CALLER_CONTEXTS = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast_bfloat16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("context", CALLER_CONTEXTS)
def test_caller_thread_local_state_reaches_nodes_like_stock(context):
    # Nodes run under the thread-local state of the caller of backward (grad mode aside): under autocast,
    # MmBackward computes in bfloat16.
    def run(backward):
        torch.manual_seed(0)
        x, w = leaf(4, 4), leaf(4, 4)
        loss = (x @ w).sin().sum()
        seen = []
        loss.grad_fn.register_prehook(
            lambda g: seen.append(
                (torch.is_autocast_enabled("cpu"), torch.is_inference_mode_enabled(), torch.is_grad_enabled())
            )
        )
        with CALLER_CONTEXTS[context]():
            backward(loss)
        return x.grad, w.grad, seen

    stock, ext = run(torch.autograd.backward), run(torch_ext.backward)
    assert_identical(ext, stock, "x.grad, w.grad, what the prehook saw")
    assert stock[2] == [(context == "autocast_bfloat16", context == "inference_mode", False)]


class WarnsInBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        warnings.warn("Python warning from a custom backward")
        _ = torch.zeros(2, 2, 2).T  # a C++ TORCH_WARN_ONCE, repeated under set_warn_always
        return grad


def test_warnings_during_backward_match_stock():
    def run(backward):
        torch.manual_seed(0)
        x = leaf(3)
        y = WarnsInBackward.apply(x * 2)
        y.register_hook(lambda g: warnings.warn("Python warning from a hook", DeprecationWarning))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backward(y.sum())
        return [(w.category, str(w.message)) for w in caught]

    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        stock = run(torch.autograd.backward)
        assert run(torch_ext.backward) == stock
    finally:
        torch.set_warn_always(warn_always)
    assert [category for category, _ in stock] == [DeprecationWarning, UserWarning, UserWarning]


def test_concurrent_backward_on_threads_matches_stock():
    # Not under enable(): it swaps torch.autograd's engine for every thread, stock comparisons included.
    cases = ["mlp_shared_weights", "several_roots", "copy_slices", "custom_functions"]
    entries = ["torch_ext.backward", "torch.ops.torch_ext.backward"]
    failures, done = [], []

    def run(case, entry):
        try:
            build, options = CASES[case]
            for _ in range(3):
                assert_backward_matches_stock(build, ext_backward=ENTRY_POINTS[entry], **options)
            done.append((case, entry))
        except BaseException as e:  # noqa: BLE001 - reported below, with the case that raised it
            failures.append((case, entry, e))

    threads = [threading.Thread(target=run, args=(case, entry)) for case in cases for entry in entries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert len(done) == len(threads)


def test_grad_create_graph_and_inputs_run_on_torch_ext_under_enabled():
    def grad_then_backward_inputs(loss):
        leaves = [t for t in _leaves_of(loss) if t.requires_grad]
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        sum(g.sum() for g in grads).backward(inputs=leaves[:1])
        return [t.grad for t in leaves]

    stock_nodes = _profiled_backward_nodes(grad_then_backward_inputs)
    with torch_ext.enable():
        ext_nodes = _profiled_backward_nodes(grad_then_backward_inputs)
    assert (DRIVER, None) not in stock_nodes
    assert [n for n in ext_nodes if n != (DRIVER, None)] == stock_nodes
    assert ext_nodes.count((DRIVER, None)) == 2


def _leaves_of(root):
    leaves, seen, stack = [], set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(n for n, _ in node.next_functions)
    return sorted(leaves, key=lambda t: t.numel())


# ---------------------------------------------------------------- errors


def seeded_calls(make_call, *backends):
    """A call of ``make_call(backend)`` per backend, each seeding torch first so that each builds the same graph."""

    def on(backend):
        def call():
            torch.manual_seed(0)
            make_call(backend)

        return call

    return [on(backend) for backend in backends]


def _run_backward_args(tensors, grads):
    return tensors, grads, False, False, (), True, True


def _raise_in_hook(backward):
    x = leaf(3)
    h = x * 2

    def fail(grad):
        raise ValueError("hook failed on purpose")

    h.register_hook(fail)
    backward((h * x).sum())


class _BackwardError(Exception):
    pass


class FailingBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise _BackwardError("custom backward failed on purpose")


class WrongShapeBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(4)


class ComplexGradBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.complex64)


class TooManyGradsBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def _second_backward(backward):
    x = leaf(3)
    y = (x * x).sin().sum()
    backward(y)
    backward(y)


def _posthook_wrong_count(backward):
    x, w = leaf(3), leaf(3)
    h = x * w
    h.grad_fn.register_hook(lambda gis, gos: (gis[0],))
    backward(h.sum())


def _prehook_wrong_shape(backward):
    x = leaf(3)
    h = x.exp()
    h.grad_fn.register_prehook(lambda gos: (torch.ones(2),))
    backward(h.sum())


def _tensor_hook_wrong_shape(backward):
    x = leaf(3)
    h = x.exp()
    h.register_hook(lambda g: torch.ones(5))
    backward(h.sum())


ERROR_CASES = {
    "wrong_grad_shape": lambda bw: bw(leaf(3) * 2, torch.ones(2)),
    "complex_grad_for_real_root": lambda bw: bw(leaf(3) * 2, torch.ones(3, dtype=torch.complex64)),
    "grad_on_meta_device": lambda bw: bw(leaf(3) * 2, torch.ones(3, device="meta")),
    "grad_with_sparse_csr_layout": lambda bw: bw(leaf(3, 1) * 2, torch.eye(3)[:, :1].to_sparse_csr()),
    "root_not_requiring_grad": lambda bw: bw(torch.ones(3).sum()),
    "non_scalar_root_without_grad": lambda bw: bw(leaf(3) * 2),
    "fewer_grad_tensors_than_roots": lambda bw: bw([leaf(3) * 2, leaf(3) * 3], [torch.ones(3)]),
    "non_tensor_root": lambda bw: bw([leaf(1).sum(), 3]),
    "non_tensor_grad": lambda bw: bw(leaf(1).sum(), grad_tensors=[1.0]),
    "string_roots": lambda bw: bw("abc"),
    "second_backward_without_retain_graph": _second_backward,
    "hook_raises": _raise_in_hook,
    "custom_function_backward_raises": lambda bw: bw(FailingBackward.apply(leaf(3)).sum()),
    "custom_function_wrong_grad_shape": lambda bw: bw(WrongShapeBackward.apply(leaf(3)).sum()),
    "custom_function_complex_grad_for_real_input": lambda bw: bw(ComplexGradBackward.apply(leaf(3)).sum()),
    "custom_function_too_many_grads": lambda bw: bw(TooManyGradsBackward.apply(leaf(3)).sum()),
    "node_posthook_wrong_count": _posthook_wrong_count,
    "node_prehook_wrong_shape": _prehook_wrong_shape,
    "tensor_hook_wrong_shape": _tensor_hook_wrong_shape,
}

ENGINE_ERROR_CASES = {
    "tensors_not_tuple": lambda run: run([leaf(1).sum()], (None,), False, False, (), True, True),
    "grad_tensors_not_tuple": lambda run: run((leaf(1).sum(),), [None], False, False, (), True, True),
    "count_mismatch": lambda run: run(*_run_backward_args((leaf(1).sum(),), ())),
    "non_tensor_root": lambda run: run(*_run_backward_args((leaf(1).sum(), "x"), (torch.ones(()), None))),
    "non_tensor_grad": lambda run: run(*_run_backward_args((leaf(1).sum(),), (1.0,))),
    "none_grad_for_root_requiring_grad": lambda run: run(*_run_backward_args((leaf(3).sum(),), (None,))),
    "none_grad_for_gradient_edge": lambda run: run(*_run_backward_args((get_gradient_edge(leaf(3) * 2),), (None,))),
    "wrong_grad_shape": lambda run: run(*_run_backward_args((leaf(3) * 2,), (torch.ones(2),))),
    "root_not_requiring_grad": lambda run: run(*_run_backward_args((torch.ones(3),), (torch.ones(3),))),
    "grad_on_meta_device": lambda run: run(*_run_backward_args((leaf(3) * 2,), (torch.ones(3, device="meta"),))),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_match_stock(case):
    assert_same_error(*seeded_calls(ERROR_CASES[case], torch.autograd.backward, torch_ext.backward))
    # The engine is usable after an error.
    assert_backward_matches_stock(retained_graph)


@pytest.mark.parametrize("case", ENGINE_ERROR_CASES)
def test_engine_argument_errors_match_stock(case):
    # The engine objects' run_backward, below torch.autograd.backward's Python argument processing.
    calls = seeded_calls(ENGINE_ERROR_CASES[case], STOCK_ENGINE.run_backward, torch_ext.Engine().run_backward)
    assert_same_error(*calls)


def _op_run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad):
    torch.ops.torch_ext.backward(list(tensors), list(grad_tensors), retain_graph=keep_graph)


# The cases the op's schema can express (Tensor roots, lists of Tensor or None).
OP_ERROR_CASES = [
    "count_mismatch",
    "none_grad_for_root_requiring_grad",
    "wrong_grad_shape",
    "root_not_requiring_grad",
    "grad_on_meta_device",
]


@pytest.mark.parametrize("case", OP_ERROR_CASES)
def test_op_argument_errors_match_stock(case):
    assert_same_error(*seeded_calls(ENGINE_ERROR_CASES[case], STOCK_ENGINE.run_backward, _op_run_backward))


def test_error_keeps_gradients_accumulated_before_it():
    def build_and_fail(backward, leaves):
        torch.manual_seed(0)
        x, w = leaf(3), leaf(3)
        leaves += [x, w]
        failing = FailingBackward.apply(w * 3)
        early = x * 2  # recorded later, so it runs first and accumulates into x before the failure
        backward([failing.sum(), early.sum()])

    stock_leaves, ext_leaves = [], []
    assert_same_error(
        lambda: build_and_fail(torch.autograd.backward, stock_leaves),
        lambda: build_and_fail(torch_ext.backward, ext_leaves),
    )
    assert stock_leaves[0].grad is not None and stock_leaves[1].grad is None
    assert_identical([leaf.grad for leaf in ext_leaves], [leaf.grad for leaf in stock_leaves], ".grad")


def test_saved_tensors_freed_after_backward_like_stock():
    def build_and_read_saved(backward, retain_graph):
        torch.manual_seed(0)
        x, w = leaf(3), leaf(3)
        y = x * w
        backward(y.sum(), retain_graph=retain_graph)
        return y.grad_fn._saved_other

    retained = [build_and_read_saved(bw, True) for bw in (torch.autograd.backward, torch_ext.backward)]
    assert_identical(retained[1], retained[0], "saved tensor")
    assert_same_error(
        lambda: build_and_read_saved(torch.autograd.backward, False),
        lambda: build_and_read_saved(torch_ext.backward, False),
    )


# ---------------------------------------------------------------- anomaly mode


class NaNBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _anomaly_report(caught):
    """Warning categories, and each 'Error detected in' report reduced to its headline and innermost frame.

    The outer frames of the forward traceback differ by call site (the two engines are called from two lines).
    """
    reports = []
    for warning in caught:
        text = str(warning.message)
        if "Error detected in" in text:
            frames = [line for line in text.splitlines() if line.startswith("  File ")]
            reports.append((text.split(". ")[0], frames[-1] if frames else text))
    return {w.category for w in caught}, reports


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(lambda x: NaNBackward.apply(x * 2).sum(), id="nan_in_custom_backward"),
        pytest.param(lambda x: (torch.sqrt(x - x) * 0).sum(), id="nan_in_builtin_backward"),
        pytest.param(lambda x: FailingBackward.apply(x * 2).sum(), id="exception_in_custom_backward"),
    ],
)
@pytest.mark.parametrize("forward_in_anomaly_mode", [True, False])
def test_anomaly_mode_matches_stock(failure, forward_in_anomaly_mode):
    def run(backward):
        torch.manual_seed(0)
        x = leaf(3)
        mode = torch.autograd.detect_anomaly
        with mode() if forward_in_anomaly_mode else contextlib.nullcontext():
            loss = failure(x) * x.sum()
        with mode():
            backward(loss)

    errors = assert_same_error(lambda: run(torch.autograd.backward), lambda: run(torch_ext.backward))
    stock_report = _anomaly_report(errors.stock_warnings)
    assert _anomaly_report(errors.ext_warnings) == stock_report
    [(headline, innermost_frame)] = stock_report[1]
    assert headline.startswith("Error detected in ")
    # A forward recorded in anomaly mode has a traceback; otherwise stock says none is available.
    assert innermost_frame.startswith("  File ") == forward_in_anomaly_mode


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_anomaly_mode_clean_backward_matches_stock():
    def build():
        with torch.autograd.detect_anomaly():
            return mlp_shared_weights()

    with torch.autograd.detect_anomaly():
        assert_backward_matches_stock(build)


# ---------------------------------------------------------------- enable() / disable()


EVALUATE = "autograd::engine::evaluate_function: "
DRIVER = "torch_ext::BackwardDriver"


def _profiled_backward_nodes(run_backward):
    """Each node's profiler event, in order: name and sequence_nr relative to the loss's (the forward link)."""
    torch.manual_seed(0)
    loss, _ = mlp_shared_weights()
    base = loss.grad_fn._sequence_nr()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_backward(loss)
    return [
        (event.name[len(EVALUATE) :], event.sequence_nr - base if event.sequence_nr >= 0 else None)
        for event in sorted(profile.events(), key=lambda e: e.time_range.start)
        if event.name.startswith(EVALUATE)
    ]


def test_enabled_runs_loss_backward_on_torch_ext():
    def backward_enabled(loss):
        with torch_ext.enable():
            assert torch_ext.is_enabled()
            loss.backward()

    stock_nodes = _profiled_backward_nodes(lambda loss: loss.backward())
    ext_nodes = _profiled_backward_nodes(backward_enabled)
    assert (DRIVER, None) not in stock_nodes
    assert ext_nodes[0] == (DRIVER, None) and (DRIVER, None) not in ext_nodes[1:]
    # The real nodes appear as on stock, in the same order and linked to the same forward ops.
    assert ext_nodes[1:] == stock_nodes
    assert not torch_ext.is_enabled()
    assert (DRIVER, None) not in _profiled_backward_nodes(lambda loss: loss.backward())


def _ran_on_torch_ext(run) -> bool:
    with torch_ext.trace() as traced:
        run()
    return any(event["kind"] == "backward" for event in traced.events)


def test_enable_nests_and_disable_returns_to_stock():
    def loss_backward():
        (torch.ones(2, requires_grad=True) * 2).sum().backward()

    assert not torch_ext.is_enabled() and not _ran_on_torch_ext(loss_backward)
    torch_ext.enable()
    torch_ext.enable()
    assert torch_ext.is_enabled() and _ran_on_torch_ext(loss_backward)
    torch_ext.disable()
    assert torch_ext.is_enabled() and _ran_on_torch_ext(loss_backward)
    torch_ext.disable()
    assert not torch_ext.is_enabled() and not _ran_on_torch_ext(loss_backward)
    # torch.autograd's engine stays torch_ext's router, which sends other calls to the engine it replaced.
    assert type(Variable._execution_engine.replaced) is type(STOCK_ENGINE)
    with pytest.raises(ValueError, match="inside"), torch_ext.enable():
        raise ValueError("raised inside enable()")
    assert not torch_ext.is_enabled()
    with pytest.raises(RuntimeError, match="without a matching"):
        torch_ext.disable()


def test_helper_detects_mismatches():
    """The comparison fails when gradients, node order or hook calls differ, or when the torch_ext run ran on
    stock's engine (it is not a tautology)."""

    def scaled_grads(roots, grad_tensors=None, retain_graph=None):
        torch.autograd.backward([r * 2 for r in roots], grad_tensors, retain_graph)

    def extra_hook_call(roots, grad_tensors=None, retain_graph=None):
        record("spurious")
        torch.autograd.backward(roots, grad_tensors, retain_graph)

    def one_root_at_a_time(roots, grad_tensors=None, retain_graph=None):
        for root, grad in zip(roots, grad_tensors):
            torch.autograd.backward(root, grad, retain_graph)

    with pytest.raises(AssertionError, match=r"leaf \.grad\[0\]: 40 of 40 elements differ"):
        assert_backward_matches_stock(mlp_shared_weights, ext_backward=scaled_grads)
    with pytest.raises(AssertionError, match="hook call logs differ"):
        assert_backward_matches_stock(tensor_hooks, ext_backward=extra_hook_call)
    two_roots = {"grad_tensors": [torch.ones(3), torch.ones(3)]}
    with pytest.raises(AssertionError, match="node execution order differs"):
        assert_backward_matches_stock(
            lambda: ((leaf(3) * 2, leaf(3) * 3), []), ext_backward=one_root_at_a_time, **two_roots
        )
    with pytest.raises(AssertionError, match="torch_ext's engine did not run the torch_ext run: it ran 0 of its"):
        assert_backward_matches_stock(mlp_shared_weights, ext_backward=torch.autograd.backward)
    with pytest.raises(AssertionError, match="messages differ"):
        assert_same_error(lambda: int("x"), lambda: int("y"))
