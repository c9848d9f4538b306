"""Stream semantics of backward on an accelerator, torch_ext's engine against stock PyTorch's.

Runs on CUDA where there is a GPU, and everywhere else on the test device (``tests/testdev``: PrivateUse1,
renamed ``testdev``), whose streams are worker threads that run each op later than it was issued, so a
missing wait reads memory not yet written, as on a GPU. Both are driven through the device-generic API
(``torch.accelerator``, ``torch.Stream``, ``torch.Event``); only the hold op differs.

Stock's rules ("Stream semantics of backward passes" in PyTorch's CUDA notes; Note [Streaming backwards]
in torch/csrc/autograd/engine.cpp), each checked here on both engines:

- every backward op runs on the stream its forward op ran on, and so do the hooks of its node;
- a node's stream waits for the streams that produced its incoming gradients (InputBuffer's events),
  the caller's stream included when it produced a root gradient;
- when backward()/grad() returns, the caller's current stream has waited for every leaf stream (where an
  AccumulateGrad ran or grad() captured a gradient), so ``.grad`` and grad()'s results are usable on it at
  once; final callbacks (``queue_callback``) run after that, on the caller's current stream;
- gradients crossing devices (host <-> device, device 1 -> device 0) follow the same rules.

torch_ext's own streams follow the same rules: a lane node runs on a side stream that waits for the node's
stream, with its inputs recorded on it for the caching allocator, and the backward thread of an overlap
takes the caller's current stream.

Modelled on PyTorch's test_cuda.py ``test_streaming_backwards_*`` tests, rewritten for two engines.
Races are made visible the way those tests do it: backward ops keep their stream busy (the hold op) before
writing, and results are read (cloned) on the stream a rule promises, before any device-wide synchronize;
a consumer that does not wait reads memory not yet written. A pass cannot prove there is no race; a
failure proves one (docs/testing.md lists the planted bugs these tests catch). Every scenario runs on
torch_ext first, with a scale no earlier run in the process used, so an early read finds another run's
values rather than the bits an identical run left in a recycled allocator block; then on stock with the
same scale and seed, which must pass the same checks, and the two engines' results (gradients, the
streams seen) must be bitwise equal. The graphs use elementwise ops and integer-valued gradients only: no
cuBLAS (not bitwise reproducible across streams without CUBLAS_WORKSPACE_CONFIG) and no sums whose
rounding depends on the order in which stock's device threads deliver gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable

import pytest
import torch
from engine_helpers import graph_nodes
from torch.autograd import Function
from torch.autograd.variable import Variable
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical

# CUDA where there is one; the test device otherwise. The two cannot share a process: torch.accelerator
# names one accelerator.
DEVICE = "cuda" if torch.cuda.is_available() else "testdev"
pytestmark = pytest.mark.testdev if DEVICE == "testdev" else []

SEED = 0
# How long a delayed backward op keeps its stream busy before writing. Launching the op a consumer would
# run too early, and a small kernel, take microseconds, so 10 ms leaves a missing wait no chance of
# being hidden by timing; the ~30 delays in this file add about 0.3 s per engine.
DELAY_MS = 10
SIZE = 1000


@pytest.fixture(scope="module", autouse=True)
def accelerator():
    """Loads the test device (built on first use, cached by ninja) where there is no CUDA."""
    if DEVICE == "testdev":
        import testdev

        testdev.load()
    if torch.accelerator.device_count() < 1:
        pytest.skip(f"no {DEVICE} device")


requires_two_devices = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs two CUDA devices (the test device has two)"
)


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    backward: Callable
    grad: Callable


STOCK = Engine("stock", torch.autograd.backward, torch.autograd.grad)
TORCH_EXT = Engine("torch_ext", torch_ext.backward, torch_ext.grad)
_scales = itertools.count(1)


@functools.cache
def _cuda_cycles_per_ms() -> float:
    # torch.cuda._sleep spins for a number of GPU clock cycles: measure the clock once.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def hold_current_stream(ms: float = DELAY_MS) -> None:
    """Keeps the current stream busy for ``ms`` before whatever is issued next on it."""
    if DEVICE == "cuda":
        torch.cuda._sleep(int(ms * _cuda_cycles_per_ms()))
    else:
        import testdev

        testdev.hold(ms)


def new_stream() -> torch.Stream:
    return torch.Stream(device=DEVICE)


def synchronize_all() -> None:
    for index in range(torch.accelerator.device_count()):
        torch.accelerator.synchronize(index)


class DelayedMultiply(Function):
    """``x * factor``. Its backward logs (forward stream, stream it runs on) to ``stream_log``, then keeps
    that stream busy for DELAY_MS before writing the gradient."""

    @staticmethod
    def forward(ctx, x, factor, stream_log):
        ctx.factor = factor
        ctx.stream_log = stream_log
        ctx.forward_stream = torch.accelerator.current_stream(x.device)
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        ctx.stream_log.append((ctx.forward_stream, torch.accelerator.current_stream(grad.device)))
        hold_current_stream()
        return grad * ctx.factor, None, None


def run_on_both(scenario: Callable[[Engine, float], dict]) -> dict[str, dict]:
    """``scenario(engine, scale)`` on torch_ext, then on stock, from the same seed with the same new scale;
    asserts the two results are identical and returns them by engine name.

    A scenario multiplies its root gradients by ``scale`` and returns what its checks need, scale included.
    """
    scale = float(next(_scales))
    results = {}
    for engine in (TORCH_EXT, STOCK):
        torch.manual_seed(SEED)
        synchronize_all()
        results[engine.name] = scenario(engine, scale)
        synchronize_all()
    assert_identical(results["torch_ext"], results["stock"], "torch_ext's result")
    return results


def full(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, value)


def stream_recorder(seen: dict, key: str) -> Callable:
    """A hook (of any kind) that records the current stream under ``key`` and changes nothing."""

    def record(*args) -> None:
        seen[key] = torch.accelerator.current_stream()

    return record


@contextlib.contextmanager
def current_streams(*streams: torch.Stream):
    """Makes each stream current on its device; the device of the last one becomes the current device."""
    with contextlib.ExitStack() as stack:
        for stream in streams:
            stack.enter_context(stream)
        yield


# ---------------------------------------------------------------- ops on their forward streams, leaf streams


@pytest.mark.parametrize("caller", ["op_stream", "other_stream"])
def test_backward_ops_run_on_forward_stream_and_leaf_grad_is_ready_on_caller_stream(caller):
    op_stream = new_stream()
    caller_stream = op_stream if caller == "op_stream" else new_stream()

    def scenario(engine, scale):
        log = []
        x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
        op_stream.wait_stream(torch.accelerator.current_stream())
        with op_stream:
            out = DelayedMultiply.apply(x, 2.0, log)
        caller_stream.wait_stream(op_stream)
        with caller_stream:
            engine.backward(out, full(scale, out))
            # x was first used on op_stream, so its AccumulateGrad ran there; the end of backward made
            # caller_stream wait for it.
            grad_on_caller = x.grad.clone()
            stream_after = torch.accelerator.current_stream()
        return {"scale": scale, "log": log, "grad_on_caller": grad_on_caller, "stream_after": stream_after}

    for engine, result in run_on_both(scenario).items():
        assert result["log"] == [(op_stream, op_stream)], engine
        assert torch.equal(result["grad_on_caller"], torch.full((5, 5), 2 * result["scale"], device=DEVICE)), engine
        assert result["stream_after"] == caller_stream, engine


@pytest.mark.parametrize("first_use", ["caller_stream", "side_stream"])
@pytest.mark.parametrize(("call", "iters"), [("backward", 1), ("backward", 3), ("grad", 1)])
def test_gradients_from_two_streams_accumulate_on_the_leaf_stream(first_use, call, iters):
    # x feeds ops on two side streams, so its AccumulateGrad's input buffer sums gradients produced on
    # two streams; with iters > 1, .grad already exists and is accumulated into in place.
    caller, stream0, stream1 = new_stream(), new_stream(), new_stream()
    leaf_stream = caller if first_use == "caller_stream" else stream0

    def scenario(engine, scale):
        log, hook_streams = [], []
        stream0_done = torch.Event(device=DEVICE)
        with caller:
            x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
            for i in range(iters):
                if first_use == "caller_stream":
                    x0 = x.clone()
                stream0.wait_stream(caller)
                stream1.wait_stream(caller)
                with stream0:
                    if first_use == "side_stream":
                        x0 = x.clone()
                    y0 = DelayedMultiply.apply(x0, 2.0, log)
                    stream0_done.record()
                with stream1:
                    y1 = DelayedMultiply.apply(x, 3.0, log)
                    stream1.wait_event(stream0_done)
                    out = y0 + y1
                if i == 0:
                    # After the first forward, so registering cannot be what creates x's AccumulateGrad.
                    x.register_hook(lambda grad: hook_streams.append(torch.accelerator.current_stream()))
                if call == "grad":
                    (x_grad,) = engine.grad(out, x, full(scale, out))
                else:
                    engine.backward(out, full(scale, out))
                    x_grad = x.grad
            grad_on_caller = x_grad.clone()
        return {"scale": scale, "log": log, "hook_streams": hook_streams, "grad_on_caller": grad_on_caller}

    for engine, result in run_on_both(scenario).items():
        assert len(result["log"]) == 2 * iters and all(fwd == bwd for fwd, bwd in result["log"]), engine
        assert result["hook_streams"] == [leaf_stream] * iters, engine
        expected = torch.full((5, 5), 5 * iters * result["scale"], device=DEVICE)
        assert torch.equal(result["grad_on_caller"], expected), engine


def test_node_hooks_and_post_accumulate_grad_hooks_see_the_node_stream():
    streams = [new_stream() for _ in range(3)]

    def scenario(engine, scale):
        seen = {}
        a = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        b = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        h = a
        for i, stream in enumerate(streams * 2):
            stream.wait_stream(torch.accelerator.current_stream())
            with stream:
                h = torch.tanh(h * b + float(i))
            torch.accelerator.current_stream().wait_stream(stream)
        out = h * 2.0
        for position, node in enumerate(graph_nodes([out])):
            node.register_prehook(stream_recorder(seen, f"{position}:{node.name()}"))
        for name, leaf in (("a", a), ("b", b)):
            leaf.register_post_accumulate_grad_hook(stream_recorder(seen, f"post-accumulate {name}"))
        engine.backward(out, full(scale, out))
        return {"seen": seen, "grads": [a.grad, b.grad]}

    # Which node ran on which stream is compared with stock by run_on_both; here, that the graph really
    # spread over the streams: the layers' nodes on theirs, out's MulBackward0 on the caller's.
    for engine, result in run_on_both(scenario).items():
        seen = result["seen"]
        assert set(seen.values()) == {*streams, torch.accelerator.current_stream()}, engine
        # a and b were first used on streams[0], where their AccumulateGrad nodes were made.
        assert seen["post-accumulate a"] == streams[0] and seen["post-accumulate b"] == streams[0], engine


# ---------------------------------------------------------------- root gradients and final callbacks


@pytest.mark.parametrize("roots", [1, 2])
def test_backward_ops_wait_for_root_gradients_made_on_caller_stream(roots):
    op_stream, caller = new_stream(), new_stream()

    def scenario(engine, scale):
        a = torch.full((SIZE,), 2.0, device=DEVICE, requires_grad=True)
        b = torch.full((SIZE,), 3.0, device=DEVICE, requires_grad=True)
        op_stream.wait_stream(torch.accelerator.current_stream())
        with op_stream:
            c = a * b
            d = a * 5.0
        synchronize_all()
        with caller:
            # The root gradients are written late on the caller's stream; MulBackward0 runs on op_stream
            # and must wait for them.
            hold_current_stream()
            grad_c = torch.full((SIZE,), scale, device=DEVICE)
            grad_d = torch.full((SIZE,), 2 * scale, device=DEVICE)
            if roots == 1:
                engine.backward(c, grad_c)
            else:
                engine.backward([c, d], [grad_c, grad_d])
        # Only the producer -> consumer waits are under test here, not the caller's wait at the end.
        synchronize_all()
        return {"scale": scale, "grads": [a.grad, b.grad]}

    for engine, result in run_on_both(scenario).items():
        scale = result["scale"]
        a_grad = 3 * scale + (10 * scale if roots == 2 else 0)
        assert torch.equal(result["grads"][0], torch.full((SIZE,), a_grad, device=DEVICE)), engine
        assert torch.equal(result["grads"][1], torch.full((SIZE,), 2 * scale, device=DEVICE)), engine


def test_final_callbacks_run_on_caller_stream_after_it_waited_for_leaf_streams():
    s0, s1, caller = new_stream(), new_stream(), new_stream()

    def scenario(engine, scale):
        log, seen = [], {}
        a = torch.ones(SIZE, device=DEVICE, requires_grad=True)
        b = torch.ones(SIZE, device=DEVICE, requires_grad=True)
        # a's AccumulateGrad runs on s0, b's on s1: two leaf streams.
        s0.wait_stream(torch.accelerator.current_stream())
        with s0:
            c = DelayedMultiply.apply(a, 2.0, log)
        s1.wait_stream(torch.accelerator.current_stream())
        with s1:
            d = DelayedMultiply.apply(b, 3.0, log)
            s1.wait_stream(s0)
            e = c * d

        def read_grads():
            seen["stream"] = torch.accelerator.current_stream()
            seen["grads"] = [a.grad.clone(), b.grad.clone()]

        e.register_hook(lambda grad: Variable._execution_engine.queue_callback(read_grads))
        caller.wait_stream(s1)
        with caller:
            loss = e.sum()
            engine.backward(loss, torch.full((), scale, device=DEVICE))
        return {"scale": scale, "log": log, "callback": seen}

    for engine, result in run_on_both(scenario).items():
        assert result["callback"], f"{engine}: the final callback did not run"
        assert result["callback"]["stream"] == caller, engine
        expected = torch.full((SIZE,), 6 * result["scale"], device=DEVICE)
        assert all(torch.equal(grad, expected) for grad in result["callback"]["grads"]), engine
        assert set(result["log"]) == {(s0, s0), (s1, s1)}, engine


# ---------------------------------------------------------------- grad() captures


def test_grad_results_are_ready_on_caller_stream():
    side, caller = new_stream(), new_stream()

    def scenario(engine, scale):
        log = []
        x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
        side.wait_stream(torch.accelerator.current_stream())
        with side:
            h = DelayedMultiply.apply(x, 2.0, log)
            out = DelayedMultiply.apply(h, 3.0, log)
        caller.wait_stream(side)
        with caller:
            # Captured on side: h's gradient at h's node, x's at x's AccumulateGrad (which does not run).
            grad_x, grad_h = engine.grad(out, (x, h), full(scale, out))
            on_caller = [grad_x.clone(), grad_h.clone()]
        return {"scale": scale, "on_caller": on_caller, "x.grad": x.grad, "log": log}

    for engine, result in run_on_both(scenario).items():
        scale = result["scale"]
        grad_x, grad_h = result["on_caller"]
        assert torch.equal(grad_x, torch.full((5, 5), 6 * scale, device=DEVICE)), engine
        assert torch.equal(grad_h, torch.full((5, 5), 3 * scale, device=DEVICE)), engine
        assert result["x.grad"] is None, engine
        assert result["log"] == [(side, side), (side, side)], engine


# ---------------------------------------------------------------- device transfers


def test_cpu_leaf_moved_to_the_device_on_side_stream():
    side, caller = new_stream(), new_stream()

    def scenario(engine, scale):
        log = []
        x = torch.randn(5, 5, requires_grad=True)
        side.wait_stream(torch.accelerator.current_stream())
        with side:
            # ToCopyBackward0 runs on side and copies the delayed gradient back to the host.
            out = DelayedMultiply.apply(x.to(DEVICE), 2.0, log)
        caller.wait_stream(side)
        with caller:
            engine.backward(out, full(scale, out))
        return {"scale": scale, "grad": x.grad, "log": log}

    for engine, result in run_on_both(scenario).items():
        assert torch.equal(result["grad"], torch.full((5, 5), 2 * result["scale"])), engine
        assert result["log"] == [(side, side)], engine


def test_device_leaf_moved_to_cpu_gets_its_gradient_back_on_caller_stream():
    side, caller = new_stream(), new_stream()

    def scenario(engine, scale):
        log = []
        x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
        side.wait_stream(torch.accelerator.current_stream())
        with side:
            y = DelayedMultiply.apply(x, 2.0, log).cpu()
        out = y * 3.0
        with caller:
            # .cpu()'s ToCopyBackward0 is a CPU node with no stream: it copies the gradient to the device on
            # the caller's current stream, which DelayedMultiply's backward (on side) must wait for.
            engine.backward(out, full(scale, out))
            grad_on_caller = x.grad.clone()
        return {"scale": scale, "grad_on_caller": grad_on_caller, "log": log}

    for engine, result in run_on_both(scenario).items():
        assert torch.equal(result["grad_on_caller"], torch.full((5, 5), 6 * result["scale"], device=DEVICE)), engine
        assert result["log"] == [(side, side)], engine


@pytest.mark.parametrize("calls", ["one_backward", "two_backwards"])
def test_gradients_copied_back_to_cpu_accumulate(calls):
    # After PyTorch's test_streaming_backwards_device_transfer, with the host as the second device: r is
    # used twice, so MulBackward0's input buffer sums two gradients copied back from the device.
    side, caller = new_stream(), new_stream()
    numel = 2**20

    def scenario(engine, scale):
        a = torch.ones(numel, dtype=torch.float64, requires_grad=True)
        b = torch.ones(numel, dtype=torch.float64, requires_grad=True)
        r = a * b
        side.wait_stream(torch.accelerator.current_stream())
        with side:
            s0 = r.to(DEVICE).sum() * 2.0
            s1 = r.to(DEVICE).sum() * 2.0
        caller.wait_stream(side)
        with caller:
            grads = [torch.full((), scale, dtype=torch.float64, device=DEVICE) for _ in range(2)]
            if calls == "one_backward":
                engine.backward([s0, s1], grads)
            else:
                engine.backward(s0, grads[0], retain_graph=True)
                engine.backward(s1, grads[1])
        return {"scale": scale, "grads": [a.grad, b.grad]}

    for engine, result in run_on_both(scenario).items():
        expected = torch.full((numel,), 4 * result["scale"], dtype=torch.float64)
        assert all(torch.equal(grad, expected) for grad in result["grads"]), engine


@requires_two_devices
@pytest.mark.parametrize("calls", ["one_use", "two_uses_one_backward", "two_uses_two_backwards"])
def test_device_to_device_transfer_with_non_default_streams_on_both_devices(calls):
    # PyTorch's test_streaming_backwards_device_transfer: to()'s backward on device 0 produces device 1
    # gradients for MulBackward0 on device 1. The caller's current device is 0 and its current streams are
    # side streams on both devices; torch_ext runs device 1's nodes on the caller's thread, which must leave
    # both as they were.
    dev0, dev1 = torch.device(DEVICE, 0), torch.device(DEVICE, 1)
    caller0, caller1 = torch.Stream(device=dev0), torch.Stream(device=dev1)
    numel = 2**22

    def scenario(engine, scale):
        with torch.accelerator.device_index(dev0.index), current_streams(caller1, caller0):
            a = torch.ones(numel, dtype=torch.float64, device=dev1, requires_grad=True)
            b = torch.ones(numel, dtype=torch.float64, device=dev1, requires_grad=True)
            r = a * b
            grads = [torch.full((), scale, dtype=torch.float64, device=dev0) for _ in range(2)]
            if calls == "one_use":
                engine.backward(r.to(dev0).sum(), grads[0])
            else:
                s0 = r.to(dev0).sum() * 2.0
                s1 = r.to(dev0).sum() * 2.0
                if calls == "two_uses_one_backward":
                    engine.backward([s0, s1], grads)
                else:
                    engine.backward(s0, grads[0], retain_graph=True)
                    engine.backward(s1, grads[1])
            state_after = {
                "device": torch.accelerator.current_device_index(),
                "streams": [torch.accelerator.current_stream(dev0), torch.accelerator.current_stream(dev1)],
            }
            with caller1:
                grads_on_caller1 = [a.grad.clone(), b.grad.clone()]
        return {"scale": scale, "state_after": state_after, "grads_on_caller1": grads_on_caller1}

    for engine, result in run_on_both(scenario).items():
        assert result["state_after"] == {"device": 0, "streams": [caller0, caller1]}, engine
        factor = 1 if calls == "one_use" else 4
        expected = torch.full((numel,), factor * result["scale"], dtype=torch.float64, device=dev1)
        assert all(torch.equal(grad, expected) for grad in result["grads_on_caller1"]), engine


# ---------------------------------------------------------------- whole graphs on several streams


@pytest.mark.parametrize("call", ["backward", "grad", "double_backward"])
def test_layers_on_alternating_streams_match_stock(call):
    # Elementwise layers alternating between two streams; w[0] is used again at the end on the other
    # stream, so its AccumulateGrad sums gradients from both. Results are read on the caller's stream
    # right after the call. Integer values in float64 (below 2**30 here), so sums are exact in any
    # order: the nodes create_graph makes take their sequence numbers from the thread that runs them
    # (stock: the device's thread; torch_ext: the caller's), which may order the second backward
    # differently.
    streams = [new_stream(), new_stream()]
    caller = new_stream()
    depth, width, batch = 5, 16, 2

    def scenario(engine, scale):
        options = {"dtype": torch.float64, "device": DEVICE}
        weights = [torch.randint(1, 3, (width,), **options).requires_grad_() for _ in range(depth)]
        h = torch.randint(-2, 3, (batch, width), **options)
        for i, w in enumerate([*weights, weights[0]]):
            stream = streams[i % 2]
            stream.wait_stream(torch.accelerator.current_stream())
            with stream:
                h = h * w + 1.0
            torch.accelerator.current_stream().wait_stream(stream)
        caller.wait_stream(torch.accelerator.current_stream())
        with caller:
            loss = h.sum() * scale
            if call == "backward":
                engine.backward(loss)
                grads = [w.grad for w in weights]
            elif call == "grad":
                grads = list(engine.grad(loss, weights))
            else:
                first = engine.grad(loss, weights, create_graph=True)
                penalty = sum(g.pow(2).sum() for g in first)
                engine.backward(penalty)
                grads = [g.detach() for g in first] + [w.grad for w in weights]
            on_caller = [g.clone() for g in grads]
        return {"on_caller": on_caller}

    results = run_on_both(scenario)
    assert all(grad.abs().max() > 0 for grad in results["stock"]["on_caller"])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_segment_on_side_stream(use_reentrant):
    # Reentrant checkpoint runs a nested backward inside its node (on torch_ext's engine too, since it is
    # enabled for the torch_ext run); non-reentrant recomputes inside saved-tensor unpacking. Both on
    # the node's stream.
    side, caller = new_stream(), new_stream()
    log_per_engine = {}

    def segment(h, w, log):
        return DelayedMultiply.apply(torch.tanh(h * w), 2.0, log)

    def scenario(engine, scale):
        log = log_per_engine.setdefault(engine.name, [])
        w = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        x = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        side.wait_stream(torch.accelerator.current_stream())
        with side:
            out = checkpoint(segment, x, w, log, use_reentrant=use_reentrant)
        caller.wait_stream(side)
        enabled = torch_ext.enable() if engine is TORCH_EXT else contextlib.nullcontext()
        with caller, enabled:
            engine.backward(out, full(scale, out))
            on_caller = [x.grad.clone(), w.grad.clone()]
        return {"on_caller": on_caller}

    run_on_both(scenario)
    for engine, log in log_per_engine.items():
        assert log and all(bwd == side for _, bwd in log), engine


# The streams _SideStreamExchange's backward ran on.
_side_stream_exchange_streams: list = []


class _SideStreamExchange(Function):
    """A synchronous collective's stand-in: backward reads its input as soon as its stream gets to it, keeps the
    stream busy (as NCCL's all_to_all makes the issuing stream wait for the transfer), reads the input again and
    writes; it records the stream it ran on. The early read finds an input not yet written where the stream did
    not wait for its producer; the late one, an input whose memory was handed out again where it was not
    recorded on the stream."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _side_stream_exchange_streams.append(torch.accelerator.current_stream())
        early = grad.clone()
        hold_current_stream()
        return early + grad, None


def test_lane_node_runs_on_a_side_stream_and_its_readers_wait_for_it():
    """The lane's side stream waits for the node's stream (its input is written late there), the lane's
    input is recorded on the side stream (the dense path allocates blocks of its size on the node's stream
    while the lane still reads it), and the lane's readers wait for the side stream."""
    import datetime

    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))

    def run(engine_backward, scale):
        torch.manual_seed(SEED)
        log: list = []
        x = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        w = torch.randn(SIZE, device=DEVICE, requires_grad=True)
        exchanged = _SideStreamExchange.apply(x * w, group)
        moe = DelayedMultiply.apply(exchanged, 3.0, log)  # writes the lane's input late
        dense = x
        for _ in range(4):
            dense = dense * w + 1
        engine_backward((moe.sum() + dense.sum()) * scale)
        return x.grad.clone(), w.grad.clone()

    caller_stream = torch.accelerator.current_stream()
    torch_ext.run_in_lane(_SideStreamExchange)
    try:
        # A lane's first use of a group checks it once, scanning live objects for data parallelism on it (tens of
        # milliseconds, on the host): long enough for the held producer to finish, hiding a missing wait. A first
        # call takes it; the runs compared come after, torch_ext's first, with a scale no run used before.
        run(torch_ext.backward, float(next(_scales)))
        scale = float(next(_scales))
        _side_stream_exchange_streams.clear()
        actual = run(torch_ext.backward, scale)
    finally:
        torch_ext.unregister_collective_backward(_SideStreamExchange)
    expected = run(torch.autograd.backward, scale)
    synchronize_all()
    assert_identical(actual, expected, "x.grad, w.grad")
    lane_stream, stock_stream = _side_stream_exchange_streams
    assert stock_stream == caller_stream  # stock runs the node on its forward's stream
    assert lane_stream not in (stock_stream, caller_stream)


# ---------------------------------------------------------------- overlap across microbatches


def test_an_overlapped_backward_runs_on_the_callers_stream():
    """The backward thread takes the caller's current stream: the root gradient made late on it is waited
    for, final callbacks run on it, and the end of backward makes it wait for the leaf stream, as stock's
    does for a backward called on that stream."""
    op_stream, caller_stream = new_stream(), new_stream()

    def scenario(engine, scale):
        log: list = []
        seen: dict = {}
        x = torch.randn(5, 5, device=DEVICE, requires_grad=True)
        op_stream.wait_stream(torch.accelerator.current_stream())
        with op_stream:
            out = DelayedMultiply.apply(x, 2.0, log)
        out.register_hook(lambda grad: Variable._execution_engine.queue_callback(stream_recorder(seen, "callback")))
        caller_stream.wait_stream(op_stream)
        with caller_stream:
            hold_current_stream()
            root_grad = full(scale, out)  # written late on the caller's stream
            if engine is STOCK:
                engine.backward(out, root_grad)
            else:
                with torch_ext.overlap_microbatches() as overlap:
                    overlap.backward(out, root_grad)
                    overlap.wait()
            grad_on_caller = x.grad.clone()
        return {"scale": scale, "log": log, "seen": seen, "grad_on_caller": grad_on_caller}

    for engine, result in run_on_both(scenario).items():
        assert result["log"] == [(op_stream, op_stream)], engine
        assert result["seen"] == {"callback": caller_stream}, engine
        assert torch.equal(result["grad_on_caller"], torch.full((5, 5), 2 * result["scale"], device=DEVICE)), engine
