"""torch_ext.backward/grad are routes through torch.autograd.backward/grad onto torch_ext's engine.

Stock's own Python parses the call, so its errors, warnings and ``__torch_function__`` handling are
stock's; only the engine call lands on torch_ext, on the calling thread, with the route's priorities.
"""

import collections
import contextvars
import logging
import re
import sys
import threading
import types
import warnings
from typing import ClassVar

import pytest
import torch
from engine_helpers import assert_same_error
from torch.autograd.graph import get_gradient_edge

import torch_ext
from torch_ext.testing import assert_identical


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def backward_calls(traced) -> list[dict]:
    """The "backward" events of a torch_ext trace (one per engine call), in start order."""
    return [event for event in traced.events if event["kind"] == "backward"]


# ---------------------------------------------------------------- errors and warnings are stock's


ROUTE_ERROR_CASES = {
    "backward_grad_tensors_and_grad_variables": lambda bw, g: bw(
        leaf(1).sum(), grad_tensors=torch.ones(()), grad_variables=torch.ones(())
    ),
    "backward_empty_inputs": lambda bw, g: bw(leaf(2).sum(), inputs=[]),
    "backward_inputs_other_mapping": lambda bw, g: bw(leaf(2).sum(), inputs=types.MappingProxyType({})),
    "backward_inside_functorch_transform": lambda bw, g: torch.func.grad(lambda t: bw(t.sin().sum()) or t.sum())(
        torch.ones(2)
    ),
    "grad_inputs_ordered_dict": lambda bw, g: g(leaf(2).sum(), collections.OrderedDict(a=leaf(2))),
    "grad_materialize_unused_gradient_edge": lambda bw, g: g(
        leaf(2).sum(), get_gradient_edge(leaf(2) * 2), materialize_grads=True
    ),
    "grad_materialize_and_not_allow_unused": lambda bw, g: g(
        leaf(2).sum(), leaf(2), allow_unused=False, materialize_grads=True
    ),
    "grad_is_grads_batched_wrong_batch": lambda bw, g: g(
        leaf(2) * 2, leaf(2), grad_outputs=torch.ones(3, 4), is_grads_batched=True
    ),
}


@pytest.mark.parametrize("case", ROUTE_ERROR_CASES)
def test_route_errors_match_stock(case):
    def call(backward, grad):
        torch.manual_seed(0)
        return lambda: ROUTE_ERROR_CASES[case](backward, grad)

    assert_same_error(call(torch.autograd.backward, torch.autograd.grad), call(torch_ext.backward, torch_ext.grad))


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda bw, g: bw(leaf(2).sum(), grad_variables=torch.ones(())), id="grad_variables"),
        pytest.param(lambda bw, g: g(leaf(2).sum(), [leaf(2)], only_inputs=False, allow_unused=True), id="only_inputs"),
    ],
)
def test_route_warnings_match_stock(call):
    def warned(backward, grad):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(backward, grad)
        return [(w.category, str(w.message)) for w in caught]

    stock = warned(torch.autograd.backward, torch.autograd.grad)
    assert stock and warned(torch_ext.backward, torch_ext.grad) == stock


# ---------------------------------------------------------------- __torch_function__ sees stock's functions


class RecordsAutogradCalls(torch.Tensor):
    funcs: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.autograd.backward, torch.autograd.grad):
            cls.funcs.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_torch_function_receives_torch_autograd_functions(api):
    def run(module):
        torch.manual_seed(0)
        x = torch.randn(3).as_subclass(RecordsAutogradCalls).requires_grad_()
        loss = (x.sin() * x).sum()
        RecordsAutogradCalls.funcs = []
        with torch_ext.trace() as traced:
            if api == "backward":
                module.backward(loss)
                result = x.grad
            else:
                (result,) = module.grad(loss, [x])
        return RecordsAutogradCalls.funcs, len(backward_calls(traced)), result.as_subclass(torch.Tensor)

    stock_funcs, stock_calls, stock_result = run(torch.autograd)
    ext_funcs, ext_calls, ext_result = run(torch_ext)
    assert stock_funcs == ext_funcs == [getattr(torch.autograd, api)]
    # The subclass's handler called stock's function again, and that call still ran on torch_ext.
    assert (stock_calls, ext_calls) == (0, 1)
    assert_identical(ext_result, stock_result, "grad")


# ---------------------------------------------------------------- a route's priorities stay with its own call


class CallsGradInside(torch.autograd.Function):
    """Identity whose backward runs ``torch.autograd.grad`` on another graph, held in ``inner``."""

    @staticmethod
    def forward(ctx, x, inner):
        ctx.inner = inner
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        root, target = ctx.inner
        torch.autograd.grad(root, target, retain_graph=True)
        return grad, None


@pytest.mark.parametrize("under_enabled", [False, True], ids=["nested_on_stock", "nested_on_torch_ext"])
def test_priorities_do_not_reach_a_backward_nested_in_a_node(under_enabled):
    inner_leaf = leaf(3)
    inner_exp = (inner_leaf * 3).exp()
    x = leaf(3)
    doubled = x * 2
    out = CallsGradInside.apply(doubled, [inner_exp.sum(), inner_leaf]).sum()
    with torch_ext.trace() as traced:
        if under_enabled:
            with torch_ext.enable():
                torch_ext.grad(out, x, priorities={doubled: 5, inner_exp: 7})
        else:
            torch_ext.grad(out, x, priorities={doubled: 5, inner_exp: 7})
    calls = backward_calls(traced)
    # Without enable() the nested grad is a plain stock call; with it, a torch_ext call of its own.
    assert len(calls) == (2 if under_enabled else 1)
    outer_nodes = [e for e in traced.events if e["kind"] == "node" and e["backward_id"] == calls[0]["backward_id"]]
    assert [(e["priority"], e["priority_from"]) for e in outer_nodes if e["name"] == "MulBackward0"] == [
        (5, "priorities")
    ]
    if under_enabled:
        inner_nodes = [e for e in traced.events if e["kind"] == "node" and e["backward_id"] == calls[1]["backward_id"]]
        assert "ExpBackward0" in [e["name"] for e in inner_nodes]
        assert all(e["priority_from"] is None for e in inner_nodes)


# ---------------------------------------------------------------- other threads stay on their engine


class Pause:
    """Lets the routed thread say where it is and wait there until the test lets it go on."""

    def __init__(self):
        self.reached, self.go_on = threading.Event(), threading.Event()

    def here(self):
        self.reached.set()
        assert self.go_on.wait(timeout=60)


class PausesInBackward(torch.autograd.Function):
    """Identity whose backward pauses: its thread is then inside torch_ext's engine."""

    @staticmethod
    def forward(ctx, x, pause):
        ctx.pause = pause
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.pause.here()
        return grad, None


class PausesInTorchFunction(torch.Tensor):
    """Pauses in stock's torch.autograd.backward before its engine call: inside the route, not yet the engine."""

    pause: ClassVar[Pause | None] = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.autograd.backward and cls.pause is not None:
            cls.pause.here()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", ["before_engine_call", "inside_engine"])
def test_stock_backward_on_another_thread_stays_on_stock(where):
    pause = Pause()
    x = leaf(4)
    if where == "before_engine_call":
        PausesInTorchFunction.pause = pause
        routed_loss = x.as_subclass(PausesInTorchFunction).tanh().sum()
    else:
        routed_loss = PausesInBackward.apply(x.tanh(), pause).sum()
    errors = []

    def routed():
        try:
            torch_ext.backward(routed_loss)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    def plain_loss():
        torch.manual_seed(1)
        w = leaf(4, 4)
        return (w @ w).sin().sum(), w

    stock_loss, stock_w = plain_loss()
    stock_loss.backward()
    try:
        with torch_ext.trace() as traced:
            thread = threading.Thread(target=routed)
            thread.start()
            assert pause.reached.wait(timeout=60)
            # The other thread is inside torch_ext.backward: this thread's backward goes to the stock engine.
            loss, w = plain_loss()
            loss.backward()
            pause.go_on.set()
            thread.join(timeout=60)
    finally:
        PausesInTorchFunction.pause = None
        pause.go_on.set()
    assert not errors and not thread.is_alive()
    assert [call["thread"] for call in backward_calls(traced)] == [thread.native_id]
    assert_identical(w.grad, stock_w.grad, "w.grad")
    assert_identical(x.grad, torch.autograd.grad(x.tanh().sum(), x)[0], "x.grad")


# ---------------------------------------------------------------- torch_ext.Engine takes stock's arguments as given


def test_engine_run_backward_without_inputs_like_stock():
    def run(engine):
        torch.manual_seed(0)
        x = leaf(3)
        engine.run_backward(((x * x).sum(),), (torch.ones(()),), False, False, accumulate_grad=True)  # no inputs=
        return x.grad

    stock = run(torch._C._ImperativeEngine())
    assert_identical(run(torch_ext.Engine()), stock, "x.grad")


def test_op_backward_with_empty_inputs_raises_like_stock():
    # torch.autograd.backward checks this in Python; the op, which has no Python, in C++.
    assert_same_error(
        lambda: torch.autograd.backward([leaf(2).sum()], [None], inputs=[]),
        lambda: torch.ops.torch_ext.backward([leaf(2).sum()], [None], inputs=[]),
    )


# ---------------------------------------------------------------- the plain call skips stock's Python


def python_functions_called(call) -> set[str]:
    """Names of the Python functions ``call()`` enters (its own frame's callees, at any depth)."""
    names = set()

    def profile(frame, event, arg):
        if event == "call":
            names.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return names


PLAIN_CALLS = {
    "backward": lambda x: torch_ext.backward((x.sin() * 2).sum()),
    "backward_retain_graph": lambda x: torch_ext.backward((x.sin() * 2).sum(), retain_graph=True),
    "grad_one_input": lambda x: torch_ext.grad((x.sin() * 2).sum(), x),
    "grad_list_create_graph": lambda x: torch_ext.grad((x.sin() * 2).sum(), [x], create_graph=True),
}


@pytest.mark.parametrize("call", PLAIN_CALLS)
def test_plain_calls_skip_stock_python_and_keep_its_bits(call):
    def run(direct: bool):
        torch.manual_seed(0)
        x = leaf(3)
        names = python_functions_called(lambda: results.append(PLAIN_CALLS[call](x)))
        return names, x.grad, results.pop()

    results = []
    names, ext_grad, ext_result = run(direct=True)
    assert "_make_grads" not in names and "_engine_run_backward" not in names
    torch.manual_seed(0)
    x = leaf(3)
    loss = (x.sin() * 2).sum()
    if call.startswith("backward"):
        torch.autograd.backward(loss)
        assert_identical(ext_grad, x.grad, "x.grad")
    else:
        (stock,) = torch.autograd.grad(loss, x)
        assert_identical(ext_result[0], stock, "grad()")


GIVEN_MORE = {
    "grad_tensors": lambda x: torch_ext.backward(x.sin() * 2, grad_tensors=torch.ones(3)),
    "inputs": lambda x: torch_ext.backward((x.sin() * 2).sum(), inputs=[x]),
    "grad_outputs": lambda x: torch_ext.grad(x.sin() * 2, x, grad_outputs=torch.ones(3)),
    "materialize_grads": lambda x: torch_ext.grad((x.sin() * 2).sum(), [x, leaf(1)], materialize_grads=True),
    "inputs_dict": lambda x: torch_ext.grad((x.sin() * 2).sum(), {"x": x}),
}


@pytest.mark.parametrize("call", GIVEN_MORE)
def test_other_calls_go_through_stock_python(call):
    assert "_make_grads" in python_functions_called(lambda: GIVEN_MORE[call](leaf(3)))


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_a_patched_torch_autograd_function_is_called(api, monkeypatch):
    calls = []
    stock = getattr(torch.autograd, api)

    def patched(*args, **kwargs):
        calls.append(api)
        return stock(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, api, patched)
    x = leaf(3)
    with torch_ext.trace() as traced:
        getattr(torch_ext, api)(*(((x * 2).sum(),) if api == "backward" else ((x * 2).sum(), x)))
    assert calls == [api] and len(backward_calls(traced)) == 1


class RecordsAutogradFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.autograd.backward, torch.autograd.grad):
            self.funcs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_a_torch_function_mode_sees_the_plain_call(api):
    def run(module):
        x = leaf(3)
        loss = (x * 2).sum()
        with RecordsAutogradFunctions() as mode:
            getattr(module, api)(*((loss,) if api == "backward" else (loss, x)))
        return mode.funcs

    assert run(torch_ext) == run(torch.autograd) == [getattr(torch.autograd, api)]


class RecordsMessages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        # Node addresses differ between the two runs.
        self.messages.append(re.sub(r" at 0x[0-9a-f]+", "", record.getMessage()))


def test_autograd_debug_logging_is_stock():
    def logged(backward):
        torch.manual_seed(0)
        x = leaf(3)
        log = logging.getLogger("torch.autograd.graph")
        handler, level = RecordsMessages(), log.level
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        try:
            backward((x.sin() * 2).sum())
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
        return handler.messages

    stock = logged(torch.autograd.backward)
    assert len(stock) == 4 and logged(torch_ext.backward) == stock


CALLER_VARIABLE = contextvars.ContextVar("caller_variable", default="unset")


class ReportsStashedContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        stashed = torch._C._is_key_in_tls("context")
        ReportsStashedContext.seen.append(stashed)
        if stashed:
            ReportsStashedContext.seen.append(torch._C._get_obj_in_tls("context").get(CALLER_VARIABLE))
        if ReportsStashedContext.fail:
            raise ValueError("backward failed on purpose")
        return grad * 2


@pytest.mark.parametrize("api", ["backward", "grad"])
@pytest.mark.parametrize("fail", [False, True])
def test_nodes_see_the_stashed_context_variables_as_on_stock(api, fail):
    # The caller's context variables, stashed for the call and gone after it, an error included.
    def run(module):
        ReportsStashedContext.seen = []
        ReportsStashedContext.fail = fail
        x = leaf(3)
        loss = ReportsStashedContext.apply(x).sum()
        token = CALLER_VARIABLE.set(f"set by the caller of {module.__name__}")
        try:
            getattr(module, api)(*((loss,) if api == "backward" else (loss, x)))
        except ValueError as error:
            ReportsStashedContext.seen.append(str(error))
        finally:
            CALLER_VARIABLE.reset(token)
        return ReportsStashedContext.seen + [torch._C._is_key_in_tls("context")]

    ours, stock = run(torch_ext), run(torch.autograd)
    assert ours[1] == "set by the caller of torch_ext" and stock[1] == "set by the caller of torch.autograd"
    ours[1] = stock[1] = "caller"
    assert ours == stock == [True, "caller", *(["backward failed on purpose"] if fail else []), False]
