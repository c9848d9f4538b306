"""torch_ext.overlap_microbatches in one process: its wait points, deferring(), Ctrl-C and bad input.

The collective order rule and stock's bits under real collectives are in
tests/distributed/test_microbatch_overlap.py.
"""

from __future__ import annotations

import _thread
import importlib
import threading
import time
from pathlib import Path
from typing import get_args

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils.checkpoint
from torch import nn
from torch.autograd.variable import Variable

import torch_ext
from torch_ext._loader import _C
from torch_ext.microbatch_overlap import ForwardCollectives


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))


def _batches() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 8) for _ in range(4)]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _stock_gradients() -> list[torch.Tensor]:
    """The gradients stock's plain accumulation loop leaves, from the seed the overlapped runs start at (2)."""
    stock = _model()
    torch.manual_seed(2)
    for x in _batches():
        stock(x).square().mean().backward()
    return _grads(stock)


@pytest.fixture
def group_of_this_process():
    """A process group of this process alone, whose collectives go through the c10d operators (a bare backend's
    do not)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_plain_loop_gives_stocks_bits():
    expected = _stock_gradients()
    overlapped = _model()
    torch.manual_seed(2)
    with torch_ext.overlap_microbatches() as overlap:
        for x in _batches():
            overlap.backward(overlapped(x).square().mean())
    for a, b in zip(_grads(overlapped), expected, strict=True):
        assert torch.equal(a, b)


def test_deferring_hands_over_library_backward_calls_and_optimizer_step_waits():
    expected = _stock_gradients()
    overlapped = _model()
    finished: list[int] = []
    hook = overlapped[0].weight.register_hook(lambda grad: time.sleep(0.05) or finished.append(1) or grad)
    optimizer = torch.optim.SGD(overlapped.parameters(), lr=0.0)
    torch.manual_seed(2)
    with torch_ext.overlap_microbatches() as overlap:
        batches = _batches()
        for i, x in enumerate(batches):
            loss = overlapped(x).square().mean()
            with overlap.deferring(i + 1 < len(batches)):
                loss.backward()  # what a library's engine.backward(loss) does
            if i == 1:
                assert len(finished) < 2  # handed over: microbatch 1's backward still runs
                optimizer.step()  # reads .grad: waits for it first
                assert len(finished) == 2
    hook.remove()
    for a, b in zip(_grads(overlapped), expected, strict=True):
        assert torch.equal(a, b)


def test_any_other_backward_on_the_thread_waits_for_the_one_in_flight():
    model = _model()
    order: list[str] = []
    model[0].weight.register_hook(lambda grad: time.sleep(0.05) or order.append("handed over") or grad)
    with torch_ext.overlap_microbatches() as overlap:
        x = torch.randn(4, 8)
        overlap.backward(model(x).sum())
        torch.autograd.grad(model(x).sum(), [model[3].weight])
        order.append("grad() returned")
    assert order[:2] == ["handed over", "grad() returned"], order


def test_ctrl_c_ends_the_wait_and_leaves_no_thread():
    model = _model()
    model[0].weight.register_hook(lambda grad: time.sleep(0.5) or grad)
    threading.Timer(0.1, _thread.interrupt_main).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), torch_ext.overlap_microbatches() as overlap:
        overlap.backward(model(torch.randn(4, 8)).sum())
        overlap.wait()
    # The block's end still joined the backward thread (the backward itself ran to its end).
    assert time.monotonic() - started < 5
    assert not any(t.name == "torch_ext-microbatch-backward" for t in threading.enumerate())
    with torch_ext.overlap_microbatches() as overlap:  # usable again
        overlap.backward(model(torch.randn(4, 8)).sum())


def test_an_error_is_raised_at_the_next_wait_point_naming_its_microbatch():
    model = _model()
    calls = []

    def failing(grad):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return grad

    model[0].weight.register_hook(failing)
    with pytest.raises(ValueError, match="boom") as raised, torch_ext.overlap_microbatches() as overlap:
        for _ in range(4):
            overlap.backward(model(torch.randn(4, 8)).sum())
    assert any("backward of microbatch 1" in note for note in raised.value.__notes__)
    assert len(calls) == 2  # no backward was handed over after the failure was seen


def test_a_forward_collective_stopped_by_the_failed_backward_raises_its_own_type(group_of_this_process):
    """The forward's collective is refused with _C.ForwardStoppedByBackward (a RuntimeError), told apart by type,
    not by its message: the block then raises the backward's error, from it."""
    model = _model()

    def failing(grad):
        raise ValueError("boom")

    model[0].weight.register_hook(failing)
    # after_backward: the forward's collective waits for the whole backward, so it always finds it failed.
    with (
        pytest.raises(ValueError, match="boom") as raised,
        torch_ext.overlap_microbatches(forward_collectives="after_backward") as overlap,
    ):
        overlap.backward(model(torch.randn(4, 8)).sum())
        dist.all_reduce(torch.ones(1))
    stopped = raised.value.__cause__
    assert isinstance(stopped, _C.ForwardStoppedByBackward) and isinstance(stopped, RuntimeError), repr(stopped)
    assert "c10d::allreduce_ was not started: the backward of microbatch 0, running beside this forward" in str(stopped)


def _functional_all_reduce(group) -> None:
    funcol.all_reduce(torch.ones(1), "sum", group).wait()


def _with_autograd_excluded(group) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        _functional_all_reduce(group)


def _in_inference_mode(group) -> None:
    with torch.inference_mode():
        _functional_all_reduce(group)


def _legacy_all_reduce(group) -> None:
    # The legacy namespace's kernel calls _c10d_functional's op, which is refused under its own name.
    torch.ops.c10d_functional.wait_tensor(torch.ops.c10d_functional.all_reduce(torch.ones(1), "sum", "", [0], 1))


def _all_to_all_with_its_own_autograd(group) -> None:
    # Called from Python as _c10d_functional_autograd's op, whose kernel calls _c10d_functional's from C++.
    x = torch.ones(2, requires_grad=True)
    torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional_autograd.all_to_all_single(x, [2], [2], group.group_name)
    )


@pytest.mark.parametrize(
    ("issue", "refused"),
    [
        (_functional_all_reduce, "_c10d_functional::all_reduce"),
        (_with_autograd_excluded, "_c10d_functional::all_reduce"),
        (_in_inference_mode, "_c10d_functional::all_reduce"),
        (_legacy_all_reduce, "_c10d_functional::all_reduce"),
        (_all_to_all_with_its_own_autograd, "_c10d_functional_autograd::all_to_all_single"),
    ],
    ids=["plain", "autograd_excluded", "inference_mode", "legacy", "own_autograd"],
)
def test_a_functional_collective_a_hook_starts_is_refused_however_it_is_dispatched(
    group_of_this_process, issue, refused
):
    """Its kernel reaches c10d with the Autograd key excluded, past the c10d operators' gate: the functional
    collectives' own gate refuses it, before it is issued, whether the call dispatches through autograd or not."""
    model = _model()
    model[0].weight.register_hook(lambda grad: issue(group_of_this_process) or grad)
    with pytest.raises(RuntimeError) as raised, torch_ext.overlap_microbatches() as overlap:
        overlap.backward(model(torch.randn(4, 8)).sum())
    assert f"torch_ext: {refused} was started during the backward of microbatch 0" in str(raised.value), raised.value
    # Outside a window the gate lets it through.
    issue(group_of_this_process)


def _attributes_code_looks_up() -> dict[str, object]:
    """Every attribute, by its qualified name, of the modules and classes through which other code reaches what
    the overlap acts on: backward, the engine, torch.ops, the RNG state, checkpointing, the optimizer."""
    owners = {
        "torch": torch,
        "torch.autograd": torch.autograd,
        "torch.autograd.graph": torch.autograd.graph,
        "torch.autograd.Variable": Variable,
        "torch.Tensor": torch.Tensor,
        "torch._ops.OpOverload": torch._ops.OpOverload,
        "torch._ops.OpOverloadPacket": torch._ops.OpOverloadPacket,
        "torch.random": torch.random,
        "torch.cuda": torch.cuda,
        "torch.utils.checkpoint": torch.utils.checkpoint,
        "torch.optim.optimizer": importlib.import_module("torch.optim.optimizer"),
        "torch_ext.engine": torch_ext.engine,
    }
    return {f"{owner}.{name}": value for owner, scope in owners.items() for name, value in vars(scope).items()}


# What the window still replaces, and docs/guides/moe.md lists with its reason.
RNG_STATE_FUNCTIONS = {
    f"{module}.{function}"
    for module in ("torch", "torch.random", *(["torch.cuda"] if torch.cuda.is_available() else []))
    for function in ("get_rng_state", "set_rng_state")
}


def test_nothing_of_torchs_is_replaced_while_a_backward_is_in_flight_but_what_the_guide_lists():
    model = _model()
    started, release = threading.Event(), threading.Event()

    def held(grad):
        started.set()
        release.wait(30)
        return grad

    torch_ext.backward(model(torch.randn(4, 8)).sum())  # torch_ext's engine is torch.autograd's from here
    model[0].weight.register_hook(held)
    before = _attributes_code_looks_up()
    try:
        with torch_ext.overlap_microbatches() as overlap:
            overlap.backward(model(torch.randn(4, 8)).sum())
            assert started.wait(30)
            with overlap.deferring():
                inside = _attributes_code_looks_up()
            release.set()
    finally:
        release.set()
    replaced = {name for name, value in inside.items() if name in before and value is not before[name]}
    assert replaced == RNG_STATE_FUNCTIONS
    guide = (Path(__file__).resolve().parent.parent / "docs/guides/moe.md").read_text()
    assert all(f"`{name}`" in guide for name in replaced), replaced
    assert {
        name for name, value in _attributes_code_looks_up().items() if before.get(name, value) is not value
    } == set()


def test_deferring_hands_over_torch_ext_backward_and_raises_argument_errors_at_once():
    expected = _stock_gradients()
    overlapped = _model()
    torch.manual_seed(2)
    with torch_ext.overlap_microbatches() as overlap:
        for x in _batches():
            with overlap.deferring():
                torch_ext.backward(overlapped(x).square().mean())
                assert overlap._in_flight is not None  # handed over
                # Stock's errors, on this thread, now: checked by torch.autograd.backward, and by the engine.
                with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
                    (torch.ones(2, requires_grad=True) * 2).backward()
                with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
                    torch.ones(2).sum().backward()
    for a, b in zip(_grads(overlapped), expected, strict=True):
        assert torch.equal(a, b)


def test_the_forward_rules_typed_in_python_are_the_engines():
    # ForwardCollectives types the argument; the names, in order, are C++'s (csrc/engine/collective_progress.h).
    assert get_args(ForwardCollectives) == tuple(_C._overlap_forward_rules)


def _rules_handed_over(monkeypatch, window_rule: str | None, *rules: str | None) -> list[tuple[int, str]]:
    """The microbatch and rule each ``backward_by`` call ran under, as its engine call's context gave them to the
    engine, one call per entry of ``rules`` (its ``forward_collectives``, None for none) in a window opened with
    ``window_rule`` (None: the default)."""
    seen = []
    x = torch.ones(2, requires_grad=True)
    run_backward = _C.run_backward

    def recording_run_backward(*args, handed=None, **kwargs):
        seen.append((handed.microbatch, handed.forward_collectives))
        return run_backward(*args, handed=handed, **kwargs)

    def backward() -> None:
        (x * 2).sum().backward()

    opened = torch_ext.overlap_microbatches() if window_rule is None else torch_ext.overlap_microbatches(window_rule)
    with monkeypatch.context() as patched, opened as overlap:
        patched.setattr(_C, "run_backward", recording_run_backward)
        for rule in rules:
            overlap.backward_by(backward, **({} if rule is None else {"forward_collectives": rule}))
    assert torch.equal(x.grad, torch.full((2,), 2.0 * len(rules)))
    return seen


def test_backward_by_takes_the_windows_rule_unless_it_passes_its_own(monkeypatch):
    default, in_turns = "after_backward_collectives", "in_turns_with_backward_collectives"
    assert _rules_handed_over(monkeypatch, None, None, "after_backward") == [(0, default), (1, "after_backward")]
    assert _rules_handed_over(monkeypatch, in_turns, None, default) == [(0, in_turns), (1, default)]
    assert _rules_handed_over(monkeypatch, "after_backward", None) == [(0, "after_backward")]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="forward_collectives must be one of"):
        torch_ext.overlap_microbatches(forward_collectives="never")
    with torch_ext.overlap_microbatches() as overlap:
        with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
            overlap.backward(torch.ones(2).sum())
        with pytest.raises(RuntimeError, match="already open"):
            torch_ext.overlap_microbatches()
        with pytest.raises(ValueError, match="backward_by: forward_collectives must be one of"):
            overlap.backward_by(lambda: None, forward_collectives="whenever")
        errors = []
        thread = threading.Thread(target=lambda: errors.append(_try(lambda: overlap.backward(torch.ones(1)))))
        thread.start()
        thread.join()
        assert "must be called on the thread that opened the overlap" in errors[0]
    with pytest.raises(RuntimeError, match="after the overlap was closed"):
        overlap.backward(torch.ones(2, requires_grad=True).sum())


def _try(fn) -> str:
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("rule", torch_ext._C._overlap_forward_rules)
def test_the_order_checks_overlap_mismatch_names_every_rule(rule):
    from torch_ext.collectives.order_check import _overlap_mismatch_message

    message = _overlap_mismatch_message([0, 1], [(1, rule), None])
    assert "rank 0: the backward of microbatch 1, the next forward's collectives " in message
    assert "rank 1: a backward not run beside a forward" in message
