"""grad(), backward(inputs=), create_graph and checkpoint on torch_ext against stock PyTorch."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical


def mlp(seed=0, width=16, depth=3):
    torch.manual_seed(seed)
    weights = [torch.randn(width, width, requires_grad=True) for _ in range(depth)]
    x = torch.randn(4, width, requires_grad=True)
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
    return h.sum(), x, weights


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


GRAD = {"stock": torch.autograd.grad, "ext": torch_ext.grad}
BACKWARD = {"stock": torch.autograd.backward, "ext": torch_ext.backward}


def both(fn):
    """fn(engine) for the stock engine and torch_ext's, each on a freshly built graph."""
    return fn("stock"), fn("ext")


@pytest.mark.parametrize(
    "select",
    [
        pytest.param(lambda x, ws: x, id="input"),
        pytest.param(lambda x, ws: ws, id="weights"),
        pytest.param(lambda x, ws: [ws[1], x], id="mixed"),
        pytest.param(lambda x, ws: {"x": x, "w0": ws[0]}, id="dict"),
    ],
)
def test_grad_matches_stock_and_writes_no_grad(select):
    def run(engine):
        loss, x, ws = mlp()
        result = GRAD[engine](loss, select(x, ws))
        return result, [x.grad] + [w.grad for w in ws]

    (stock, stock_leaf_grads), (ext, ext_leaf_grads) = both(run)
    assert stock_leaf_grads == [None] * 4
    assert_identical(ext, stock)
    assert ext_leaf_grads == [None] * 4


def test_grad_of_input_only_prunes_weight_gradients():
    # Three mm in forward; grad(x) needs one mm per layer backward (dX), none for dW. Counted by the profiler: a
    # backward under a dispatch mode is traced, and goes to stock's engine (test_compile_tracing.py).
    counts = {}
    for engine in ("stock", "ext"):
        loss, x, _ = mlp()
        with torch.profiler.profile() as profile:
            GRAD[engine](loss, x)
        counts[engine] = sum(event.name == "aten::mm" for event in profile.events())
        driver_ran = any(event.name == "torch_ext::BackwardDriver" for event in profile.events())
        assert driver_ran == (engine == "ext")
    assert counts["ext"] == counts["stock"] == 3


def test_grad_under_a_dispatch_mode_runs_on_stocks_engine_and_the_mode_sees_every_op():
    counts = {}
    for engine in ("stock", "ext"):
        loss, x, _ = mlp()
        with CountMatmuls() as counter, torch.profiler.profile() as profile:
            GRAD[engine](loss, x)
        counts[engine] = counter.count
        assert not any(event.name == "torch_ext::BackwardDriver" for event in profile.events())
    assert counts["ext"] == counts["stock"] == 3


def test_grad_of_intermediate_and_gradient_edge():
    def run(engine):
        torch.manual_seed(0)
        a = torch.randn(5, requires_grad=True)
        mid = a.exp()
        out = (mid * mid.sin()).sum()
        edge = torch.autograd.graph.get_gradient_edge(mid)
        return GRAD[engine](out, (mid, edge, a), retain_graph=True)

    stock, ext = both(run)
    assert_identical(ext, stock)


@pytest.mark.parametrize("create_graph", [False, True])
def test_backward_inputs_accumulates_only_into_inputs(create_graph):
    def run(engine):
        loss, x, ws = mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # create_graph's reference-cycle warning, on both engines
            BACKWARD[engine](loss, inputs=[ws[1], x], create_graph=create_graph)
        return [w.grad for w in ws] + [x.grad]

    stock, ext = both(run)
    assert_identical(
        [g.detach() if g is not None else None for g in ext], [g.detach() if g is not None else None for g in stock]
    )
    assert ext[0] is None and ext[2] is None


def test_backward_inputs_non_leaf_retains_grad():
    def run(engine):
        torch.manual_seed(0)
        a = torch.randn(3, requires_grad=True)
        mid = a * 3
        BACKWARD[engine]((mid**2).sum(), inputs=[mid])
        return mid.grad, a.grad

    stock, ext = both(run)
    assert_identical(ext, stock)


def test_double_backward_through_grad_create_graph():
    def run(engine):
        loss, x, ws = mlp()
        grads = GRAD[engine](loss, ws, create_graph=True)
        penalty = sum((g * g).sum() for g in grads)
        BACKWARD[engine](penalty)
        return [w.grad for w in ws] + [x.grad]

    stock, ext = both(run)
    assert_identical(ext, stock)


def test_third_order_gradient():
    def run(engine):
        x = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
        y = (x.sin() * x.exp()).sum()
        (g1,) = GRAD[engine](y, x, create_graph=True)
        (g2,) = GRAD[engine](g1.sum(), x, create_graph=True)
        (g3,) = GRAD[engine](g2.sum(), x)
        return g1.detach(), g2.detach(), g3

    stock, ext = both(run)
    assert_identical(ext, stock)


@pytest.mark.parametrize(
    "functional",
    [
        pytest.param(
            lambda: torch.autograd.functional.hessian(lambda v: (v.sin() * v).sum(), torch.arange(5.0)), id="hessian"
        ),
        pytest.param(
            lambda: torch.autograd.functional.jacobian(lambda v: v.exp() * v.sum(), torch.arange(4.0)), id="jacobian"
        ),
        pytest.param(
            lambda: torch.autograd.functional.jacobian(lambda v: v.exp() * v.sum(), torch.arange(4.0), vectorize=True),
            id="jacobian-vectorized",
        ),
        pytest.param(
            lambda: torch.autograd.functional.hvp(lambda v: (v**3).sum(), torch.arange(3.0), torch.ones(3)), id="hvp"
        ),
        pytest.param(
            lambda: torch.autograd.functional.vjp(lambda v: v.cos(), torch.arange(3.0), torch.ones(3)), id="vjp"
        ),
    ],
)
def test_autograd_functional_under_enabled(functional):
    stock = functional()
    with torch_ext.enable():
        ext = functional()
    assert_identical(ext, stock)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_nested(use_reentrant):
    def run(engine):
        torch.manual_seed(2)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        x = torch.randn(3, 8, requires_grad=True)
        y = checkpoint(net, x, use_reentrant=use_reentrant)
        y = checkpoint(lambda t: checkpoint(net, t, use_reentrant=use_reentrant).sin(), y, use_reentrant=use_reentrant)
        BACKWARD[engine](y.sum())
        return [p.grad for p in net.parameters()] + [x.grad]

    stock, ext = both(run)
    assert_identical(ext, stock)


def test_checkpoint_early_stop_recomputes_once_per_region():
    def run(engine):
        torch.manual_seed(3)
        recomputes = []

        def region(t):
            recomputes.append(1)
            return (t.sin() * t.cos()).exp()

        x = torch.randn(6, requires_grad=True)
        y = checkpoint(region, x, use_reentrant=False)
        BACKWARD[engine](y.sum())
        return x.grad, len(recomputes)

    (stock_grad, stock_calls), (ext_grad, ext_calls) = both(run)
    assert_identical(ext_grad, stock_grad)
    assert ext_calls == stock_calls == 2  # forward + one recompute


def test_reentrant_checkpoint_refuses_grad_like_stock():
    def run(engine):
        net = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        y = checkpoint(net, x, use_reentrant=True)
        with pytest.raises(RuntimeError) as info:
            GRAD[engine](y.sum(), x)
        return str(info.value)

    stock, ext = both(run)
    assert stock == ext


def test_multi_grad_hook_all_and_any():
    def run(engine):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        calls = []
        torch.autograd.graph.register_multi_grad_hook(
            (a, b), lambda gs: calls.append(("all", [g is not None for g in gs]))
        )
        torch.autograd.graph.register_multi_grad_hook((a, b), lambda g: calls.append(("any", g.shape)), mode="any")
        BACKWARD[engine]((a * 2).sum() + (b * 3).sum())
        BACKWARD[engine]((a * 2).sum())
        return calls

    stock, ext = both(run)
    assert stock == ext
    assert len(ext) == 4


def test_will_engine_execute_node_during_grad():
    def run(engine):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        mid_a, mid_b = a.exp(), b.exp()
        seen = []

        def hook(grad):
            seen.append(
                (
                    torch._C._will_engine_execute_node(mid_a.grad_fn),
                    torch._C._will_engine_execute_node(mid_b.grad_fn),
                    torch._C._current_graph_task_id() != -1,
                    torch.autograd._is_checkpoint_valid(),
                )
            )

        out = mid_a * 2 + mid_b
        out.register_hook(hook)
        GRAD[engine](out.sum(), a, retain_graph=True)
        BACKWARD[engine](out.sum())
        return seen

    stock, ext = both(run)
    assert stock == ext
    assert ext[0] == (True, False, True, False)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda g, a, b: g((a * 2).sum(), [a, b]), id="unused-input"),
        pytest.param(lambda g, a, b: g((a * 2).sum(), []), id="empty-inputs"),
        pytest.param(lambda g, a, b: g((a * 2).sum(), [a.detach()]), id="input-not-requiring-grad"),
        pytest.param(
            lambda g, a, b: g((a * 2).sum(), [a], allow_unused=False, materialize_grads=True), id="materialize"
        ),
        pytest.param(lambda g, a, b: g((a * 2), [a]), id="non-scalar-without-grad-outputs"),
        pytest.param(lambda g, a, b: g((a * 2).sum(), [a], grad_outputs=[torch.ones(2)]), id="grad-output-shape"),
    ],
)
def test_grad_errors_match_stock(call):
    def run(engine):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        with pytest.raises(Exception) as info:
            call(GRAD[engine], a, b)
        return type(info.value), str(info.value)

    stock, ext = both(run)
    assert stock == ext


def test_allow_unused_and_materialize_grads():
    def run(engine):
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        return (
            GRAD[engine]((a * 2).sum(), [a, b], allow_unused=True),
            GRAD[engine]((a * 2).sum(), [a, b], materialize_grads=True),
        )

    stock, ext = both(run)
    assert_identical(ext, stock)


def test_grad_tensor_hooks_fire_on_captured_inputs():
    def run(engine):
        a = torch.ones(3, requires_grad=True)
        mid = a * 2
        log = []
        mid.register_hook(lambda g: log.append(("mid", g.sum().item())) or g * 10)
        a.register_hook(lambda g: log.append(("a", g.sum().item())))
        result = GRAD[engine]((mid * mid).sum(), [mid, a])
        return log, result

    (stock_log, stock), (ext_log, ext) = both(run)
    assert stock_log == ext_log
    assert_identical(ext, stock)


def test_grad_is_grads_batched():
    def run(engine):
        x = torch.arange(3.0, requires_grad=True)
        y = x.exp()
        return GRAD[engine](y, x, torch.eye(3), is_grads_batched=True)

    stock, ext = both(run)
    assert_identical(ext, stock)


def _func_transforms():
    def f(x):
        return (x.sin() * x.exp()).sum()

    x = torch.tensor([0.5, -1.0, 2.0])
    return {
        "grad": torch.func.grad(f)(x),
        "grad_and_value": torch.func.grad_and_value(f)(x),
        "vjp": torch.func.vjp(lambda t: t.cos() * t, x)[1](torch.ones(3)),
        "jacrev": torch.func.jacrev(lambda t: t.sin() * t.sum())(x),
        "hessian": torch.func.hessian(f)(x),
        "vmap_grad": torch.func.vmap(torch.func.grad(f))(torch.stack([x, x * 2])),
    }


def test_torch_func_transforms_under_enabled():
    # torch.func's reverse-mode transforms call torch.autograd.grad inside functorch levels: traced calls,
    # which torch_ext hands to stock's engine (test_compile_tracing.py), with stock's bits whatever the route.
    stock = _func_transforms()
    with torch_ext.enable():
        ext = _func_transforms()
    assert_identical(ext, stock)


def test_compiled_autograd_falls_back_to_stock_engine_and_warns_once(monkeypatch):
    import warnings

    from torch._dynamo import compiled_autograd

    monkeypatch.setattr(torch_ext.engine, "_warned_of_compiled_autograd", False)

    def run(use_torch_ext):
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        for _ in range(2):
            loss = linear(torch.randn(2, 4)).tanh().sum()
            with compiled_autograd._enable(torch.compile(backend="eager")):
                if use_torch_ext:
                    with torch_ext.enable():
                        loss.backward()
                else:
                    loss.backward()
        return [p.grad for p in linear.parameters()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock = run(False)
        assert not [w for w in caught if "torch_ext" in str(w.message)]
        assert_identical(run(True), stock)
    warned = [str(w.message) for w in caught if "torch_ext" in str(w.message)]
    assert len(warned) == 1 and "compiled autograd is on" in warned[0] and "compile_backend" in warned[0]


FIRST_BACKWARD_UNDER_DISPATCH_MODE = """
import torch, torch_ext
from torch.utils._python_dispatch import TorchDispatchMode

class EmptyOnMeta(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten.empty.memory_format:
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)

x = torch.ones(2, requires_grad=True)
with EmptyOnMeta():
    torch_ext.backward((x * 2).sum())
y = torch.ones(3, requires_grad=True)
torch_ext.backward((y * 3).sum())
print(x.grad.tolist(), y.grad.tolist())
"""


@pytest.mark.slow
def test_first_backward_under_a_dispatch_mode_does_not_poison_the_engine():
    # The process's first backward call, under a TorchDispatchMode (which sends it to stock's engine), must
    # leave torch_ext's engine usable for the next one. Needs a fresh interpreter.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(
        [sys.executable, "-c", FIRST_BACKWARD_UNDER_DISPATCH_MODE],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[2.0, 2.0] [3.0, 3.0, 3.0]"


def test_hook_registered_on_current_node_from_unpack_hook():
    # torch._C._current_autograd_node() inside backward is the node being evaluated, as with stock's NodeGuard.
    def run(engine):
        torch.manual_seed(0)
        a = torch.rand(3, 3, requires_grad=True)

        def unpack(saved):
            node = torch._C._current_autograd_node()
            node.register_hook(lambda outs, ins: tuple(o / 2 if o is not None else None for o in outs))
            return saved

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            var, mean = torch.var_mean(a, dim=0)
        BACKWARD[engine]((var + mean).sum())
        return a.grad

    stock, ext = both(run)
    assert_identical(ext, stock)


class _SavesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _ReturnsNan.apply(grad * x)


class _ReturnsNan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + float("nan")


def test_anomaly_mode_reports_the_parent_of_double_backward_nodes():
    def run(engine):
        with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
            warnings.simplefilter("always")
            x = torch.rand(3, requires_grad=True)
            (grad,) = GRAD[engine](_SavesInput.apply(x).sum(), (x,), create_graph=True)
            with pytest.raises(RuntimeError) as info:
                BACKWARD[engine](grad.sum())
        parents = [str(w.message).strip().splitlines()[0] for w in caught if "Previous calculation" in str(w.message)]
        return str(info.value).splitlines()[0], parents

    stock, ext = both(run)
    assert stock == ext
    assert ext[1] == [
        "Previous calculation was induced by _SavesInputBackward. Traceback of forward call that induced the previous calculation:"
    ]


def test_torch_logs_autograd_records_each_node_like_stock():
    import logging
    import re

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(re.sub(r" at 0x[0-9a-f]+", "", record.getMessage()))
    logger = logging.getLogger("torch.autograd.graph")
    torch._logging.set_logs(autograd=logging.DEBUG)
    logger.addHandler(handler)
    try:
        logged = {}
        for engine in ("stock", "ext"):
            records.clear()
            loss, _, _ = mlp()
            BACKWARD[engine](loss)
            loss, x, _ = mlp()
            GRAD[engine](loss, x)
            logged[engine] = list(records)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert logged["ext"] == logged["stock"]
    assert any("MmBackward0" in message for message in logged["ext"])
