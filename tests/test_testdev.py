"""The testdev accelerator itself: asynchronous streams, CUDA's event rule, the stream-ordered caching allocator,
autograd on it (stock engine) bit for bit equal to CPU, two devices, seeding."""

import copy
import time

import pytest
import testdev
import torch
import torch.utils.checkpoint

pytestmark = pytest.mark.testdev

HOLD_MS = 50


@pytest.fixture(scope="module", autouse=True)
def device():
    testdev.load()
    yield
    torch.testdev.synchronize()


@pytest.fixture(autouse=True)
def idle_device():
    # Every test starts and ends with every stream drained and the current streams the defaults.
    torch.testdev.synchronize()
    torch.testdev.set_device(0)
    yield
    torch.testdev.synchronize()
    for index in range(2):
        torch.accelerator.set_stream(torch.testdev.default_stream(index))
    torch.testdev.set_device(0)


def test_accelerator_api():
    assert testdev.is_available()
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 2
    assert torch.accelerator.current_accelerator() == torch.device("testdev")
    assert torch.get_device_module("testdev") is torch.testdev
    assert torch.testdev.device_count() == 2
    x = torch.ones(3).testdev()
    assert x.is_testdev and x.device == torch.device("testdev:0")
    s = torch.Stream(device="testdev:0")
    assert s != torch.accelerator.current_stream()
    with s:
        assert torch.accelerator.current_stream() == s
    assert torch.accelerator.current_stream() == torch.testdev.default_stream(0)
    torch.accelerator.set_stream(s)
    assert torch.testdev.current_stream() == s
    torch.accelerator.set_stream(torch.testdev.default_stream(0))
    with torch.testdev.device(1):
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(1, device="testdev").device == torch.device("testdev:1")
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.synchronize()


def test_op_runs_later_than_issued():
    x = torch.zeros(1000, device="testdev")
    y = torch.full((1000,), -1.0, device="testdev")
    other = torch.Stream(device="testdev:0")
    torch.testdev.synchronize()  # the fills have run: `other` reads x without waiting for them
    gate = testdev.Gate()  # holds the current stream until opened: no timing involved
    gate.block()
    x.add_(1)
    assert not torch.accelerator.current_stream().query()
    with other:
        y.copy_(x)  # no wait_stream: runs at once, before the add
        other.synchronize()
        seen = y.cpu()  # waits for `other` only
    gate.open()
    assert torch.equal(seen, torch.zeros(1000))
    assert torch.equal(x.cpu(), torch.ones(1000))  # waits for the add


def test_op_runs_later_than_hold():
    x = torch.zeros(1000, device="testdev")
    testdev.hold(HOLD_MS)
    x.add_(1)
    assert not torch.accelerator.current_stream().query()
    assert torch.equal(x.cpu(), torch.ones(1000))


def test_host_read_waits():
    x = torch.zeros(1000, device="testdev")
    testdev.hold(HOLD_MS)
    x.add_(1)
    assert torch.equal(x.cpu(), torch.ones(1000))
    testdev.hold(HOLD_MS)
    x.add_(1)
    assert x[3].item() == 2.0
    assert x.sum().item() == 2000.0


def test_wait_stream_orders():
    x = torch.zeros(1000, device="testdev")
    y = torch.empty(1000, device="testdev")
    main = torch.accelerator.current_stream()
    other = torch.Stream(device="testdev:0")
    testdev.hold(HOLD_MS)
    x.add_(1)
    with other:
        other.wait_stream(main)
        y.copy_(x)
    main.wait_stream(other)
    assert torch.equal(y.cpu(), torch.ones(1000))


def test_event_cuda_rule():
    x = torch.zeros(100, device="testdev")
    producer = torch.Stream(device="testdev:0")
    consumer = torch.Stream(device="testdev:0")
    event = torch.Event(device="testdev")
    assert event.query()  # never recorded
    torch.testdev.synchronize()  # x's fill has run: the producer does not wait for the default stream
    first, second = testdev.Gate(), testdev.Gate()
    with producer:
        first.block()
        x.add_(1)
        event.record()
    assert not event.query()
    with consumer:
        consumer.wait_event(event)  # waits for the record above...
    with producer:
        second.block()
        x.add_(1)
        event.record()  # ...not for this later one
    first.open()
    with consumer:
        seen = x.clone()
        consumer.synchronize()  # would wait for `second` (and time out) if the later record counted
    assert not event.query()
    second.open()
    event.synchronize()
    assert event.query()
    torch.testdev.synchronize()
    assert torch.equal(seen.cpu(), torch.ones(100))
    assert torch.equal(x.cpu(), torch.full((100,), 2.0))


def test_event_elapsed_time():
    start = torch.Event(device="testdev", enable_timing=True)
    end = torch.Event(device="testdev", enable_timing=True)
    start.record()
    testdev.hold(30)
    end.record()
    end.synchronize()
    assert 25 <= start.elapsed_time(end) < 1000


def test_allocator_reuses_on_same_stream():
    torch.testdev.empty_cache()
    x = torch.empty(12345, device="testdev")
    ptr = x.data_ptr()
    before = torch.testdev.memory_stats()["num_reuses"]
    del x  # its work may still be queued: the same stream's later work runs after it
    y = torch.empty(12345, device="testdev")
    assert y.data_ptr() == ptr
    assert torch.testdev.memory_stats()["num_reuses"] == before + 1
    other = torch.Stream(device="testdev:0")
    del y
    with other:
        z = torch.empty(12345, device="testdev")
    assert z.data_ptr() != ptr  # a block freed on one stream is not handed to another


def test_record_stream_delays_reuse():
    torch.testdev.empty_cache()
    side = torch.Stream(device="testdev:0")
    x = torch.empty(4321, device="testdev")
    ptr = x.data_ptr()
    gate = testdev.Gate()
    with side:
        gate.block()
    x.record_stream(side)
    del x
    assert torch.testdev.memory_stats()["num_pending"] == 1
    y = torch.empty(4321, device="testdev")
    assert y.data_ptr() != ptr  # the side stream may still use it
    gate.open()
    side.synchronize()
    z = torch.empty(4321, device="testdev")
    assert z.data_ptr() == ptr
    assert torch.testdev.memory_stats()["num_pending"] == 0


@pytest.mark.parametrize("record", [False, True])
def test_missing_record_stream_is_visible(record):
    """A side stream reads a tensor after the main stream freed it: without record_stream the block is reused at once
    and the side stream reads the new owner's data, as on CUDA."""
    torch.testdev.empty_cache()
    main = torch.accelerator.current_stream()
    side = torch.Stream(device="testdev:0")
    x = torch.ones(2048, device="testdev")
    ptr = x.data_ptr()
    gate = testdev.Gate()
    with side:
        side.wait_stream(main)
        gate.block()
        doubled = x * 2
    if record:
        x.record_stream(side)
    del x
    reuse = torch.full((2048,), 5.0, device="testdev")
    assert (reuse.data_ptr() == ptr) != record
    main.synchronize()  # the main stream has written 5.0 ...
    gate.open()  # ... before the side stream reads
    torch.testdev.synchronize()
    assert torch.equal(doubled.cpu(), torch.full((2048,), 2.0 if record else 10.0))


def test_two_devices_and_cross_device_copy():
    a = torch.arange(6.0, device="testdev:1")
    assert a.device == torch.device("testdev:1")
    with torch.testdev.device(1):
        testdev.hold(HOLD_MS)
    b = (a * 2).to("testdev:0")  # waits for device 1's current stream
    assert b.device == torch.device("testdev:0")
    assert torch.equal(b.cpu(), torch.arange(6.0) * 2)
    c = b.to("testdev:1") + a
    assert torch.equal(c.cpu(), torch.arange(6.0) * 3)
    with pytest.raises(RuntimeError, match="same device"):
        a + b


def test_hold_is_asynchronous():
    start = time.perf_counter()
    testdev.hold(200)
    assert time.perf_counter() - start < 0.1
    torch.testdev.synchronize()
    assert time.perf_counter() - start >= 0.19


def test_views_alias_at_issue():
    x = torch.zeros(2, 3, device="testdev")
    testdev.hold(HOLD_MS)
    v = x.view(3, 2)
    t = x.t()
    u = x.unfold(1, 2, 1)  # a view op that goes through the fallback
    assert v.data_ptr() == t.data_ptr() == u.data_ptr() == x.data_ptr()
    v[1].fill_(5.0)
    z = torch.zeros(4, dtype=torch.complex64, device="testdev")
    torch.view_as_real(z)[:, 1].fill_(1.0)
    expected = torch.zeros(2, 3)
    expected.view(3, 2)[1] = 5.0
    assert torch.equal(x.cpu(), expected)
    assert torch.equal(z.cpu(), torch.full((4,), 1j, dtype=torch.complex64))


def test_data_dependent_ops_and_resize():
    x = torch.tensor([0.0, 2.0, 0.0, 3.0], device="testdev")
    testdev.hold(HOLD_MS)
    x.add_(1)
    assert torch.equal(torch.nonzero(x > 2).cpu(), torch.tensor([[1], [3]]))  # runs after the add
    assert torch.equal(x[x > 2].cpu(), torch.tensor([3.0, 4.0]))
    assert torch.equal(x, x.clone())
    testdev.hold(HOLD_MS)
    x.mul_(2)
    x.resize_(1000)  # new memory: the old contents are copied after the queued mul
    assert torch.equal(x[:4].cpu(), torch.tensor([2.0, 6.0, 2.0, 8.0]))


def test_kernel_error_surfaces_at_synchronize():
    weight = torch.zeros(3, 2, device="testdev")
    torch.nn.functional.embedding(torch.tensor([5], device="testdev"), weight)  # raises on the stream's thread
    with pytest.raises((IndexError, RuntimeError), match="index out of range|out of range"):
        weight.cpu()
    weight.cpu()  # reported once


@pytest.mark.parametrize("wait", [True, False])
def test_missing_wait_in_backward_is_visible(wait):
    """A backward that computes on a side stream without waiting for its gradient reads it before it is written."""
    sides = []

    class SideStreamDouble(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            current = torch.accelerator.current_stream()
            side = torch.Stream(device=grad.device)
            sides.append(side)
            if wait:
                side.wait_stream(current)
            with side:
                out = grad * 2
            current.wait_stream(side)
            grad.record_stream(side)
            return out

    x = torch.ones(1000, device="testdev", requires_grad=True)
    y = SideStreamDouble.apply(x)
    grad = torch.zeros(1000, device="testdev")
    torch.testdev.synchronize()  # the zeros are written before the side stream's early read
    gate = testdev.Gate()
    gate.block()
    grad.fill_(1.0)
    torch.autograd.backward(y, grad)
    if not wait:
        sides[0].synchronize()  # its read has run, without waiting for the gated fill
    gate.open()
    assert torch.equal(x.grad.cpu(), torch.full((1000,), 2.0 if wait else 0.0))


def test_backward_of_side_stream_forward():
    """The stock engine runs each backward op on its forward op's stream and syncs the caller's stream with it."""
    side = torch.Stream(device="testdev:0")
    x = torch.arange(1000.0, device="testdev", requires_grad=True)
    with side:
        side.wait_stream(torch.accelerator.current_stream())
        testdev.hold(HOLD_MS)
        loss = (x * 3).sum()
    torch.autograd.backward(loss)  # from the default stream, no synchronize
    assert torch.equal(x.grad.cpu(), torch.full((1000,), 3.0))


def _mlp_grads(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    inputs = torch.randn(6, 8)
    target = torch.randn(6, 4)
    index = torch.tensor([0, 2, 5])
    model = copy.deepcopy(model).to(device)
    inputs, target, index = inputs.to(device), target.to(device), index.to(device)
    out = model(inputs)
    hidden = torch.cat([out, out[index].sum(0, keepdim=True)]) @ torch.ones(4, 3, device=device)
    loss = torch.nn.functional.mse_loss(out, target) + hidden.pow(2).mean()
    torch.autograd.backward(loss)
    return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("index", [0, 1])
def test_autograd_matches_cpu_bitwise(index):
    cpu_loss, cpu_grads = _mlp_grads("cpu")
    loss, grads = _mlp_grads(f"testdev:{index}")
    assert torch.equal(loss, cpu_loss)
    for grad, cpu_grad in zip(grads, cpu_grads, strict=True):
        assert torch.equal(grad, cpu_grad)
    torch.testing.assert_close(loss, cpu_loss)


def test_rng_seeding_is_reproducible():
    def draw():
        x = torch.ones(1000, device="testdev")
        return torch.nn.functional.dropout(x, 0.5, training=True).cpu(), torch.rand(10, device="testdev").cpu()

    torch.testdev.manual_seed(3)
    first = draw()
    torch.testdev.manual_seed(3)
    second = draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    torch.manual_seed(4)  # seeds the device too
    third = draw()
    assert not torch.equal(first[1], third[1])
    state = torch.testdev.get_rng_state()
    fourth = draw()
    torch.testdev.set_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(fourth, draw()))
    assert torch.testdev.initial_seed() == 4


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_replays_dropout(use_reentrant):
    """torch.utils.checkpoint saves and restores the device's RNG state through torch.testdev."""
    linear = torch.nn.Linear(16, 16).to("testdev")
    x = torch.randn(4, 16, device="testdev", requires_grad=True)

    def f(x):
        return torch.nn.functional.dropout(linear(x), 0.5).sum()

    torch.manual_seed(1)
    f(x).backward()
    plain = linear.weight.grad.cpu()
    linear.zero_grad()
    torch.manual_seed(1)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=use_reentrant).backward()
    assert torch.equal(linear.weight.grad.cpu(), plain)
