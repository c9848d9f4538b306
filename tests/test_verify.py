"""torch_ext.verify: a training step run on stock PyTorch and on torch_ext from one snapshot, compared bit for bit.

Real steps, no mocks: an MLP with SGD, a tiny GPT-2 (Hugging Face transformers) with AdamW, steps that
differ on purpose, dropout and the other random generators, and ``python -m torch_ext verify`` in a
subprocess. The distributed cases (an MoE layer and TorchRec's DLRM on two ranks, and the command
under torchrun) are in tests/distributed/test_verify_distributed.py.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import struct
import subprocess
import sys
import textwrap
import types

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.variable import Variable

import torch_ext
from torch_ext.__main__ import main as torch_ext_main
from torch_ext.testing import assert_identical, identity_difference
from torch_ext.verify import _verify
from torch_ext.verify._compare import _compare_values

# Graphs far too small to gain from intra-op threads (conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _mlp(dropout: float = 0.0) -> nn.Sequential:
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)]
    if dropout:
        layers.insert(2, nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _training_step(model: nn.Module, optimizer: torch.optim.Optimizer, scale_on_torch_ext: float = 1.0):
    inputs, targets = torch.randn(16, 4), torch.randn(16, 1)

    def step():
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        if torch_ext.is_enabled() and scale_on_torch_ext != 1.0:
            loss = loss * scale_on_torch_ext
        loss.backward()
        optimizer.step()
        return loss

    return step


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    tensors += [p.grad.clone() for p in model.parameters()]
    tensors += [value.clone() for state in optimizer.state.values() for value in state.values()]
    return tensors


def _parameter_count(model: nn.Module) -> int:
    return len(list(model.parameters()))


def test_mlp_with_sgd_is_identical_and_left_as_it_was():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = _training_step(model, optimizer)
    step()  # momentum buffers and gradients exist: the snapshot must restore them too
    before, generator_before = _state(model, optimizer), torch.get_rng_state()

    report = torch_ext.verify(step, steps=2, models=[model], optimizers=[optimizer])

    assert report.identical and report.first_difference is None, report.summary()
    # Per step: each parameter's gradient, value and momentum buffer, and the loss.
    assert report.compared == 2 * (3 * _parameter_count(model) + 1)
    for stock, ours in zip(report.backward["stock"], report.backward["torch_ext"], strict=True):
        assert stock.order == ours.order and len(ours.order) == 10
    assert str(report).startswith("torch_ext.verify: IDENTICAL")
    after = _state(model, optimizer)
    assert_identical(after, before, "restored state")
    assert_identical(torch.get_rng_state(), generator_before, "restored generator")


def test_stock_run_is_stock_even_when_torch_ext_is_enabled():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    on_torch_ext = []

    def step():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        with torch.profiler.profile() as profile:
            loss.backward()
        # torch_ext's host task runs its driver node on the stock engine; stock never does.
        on_torch_ext.append(any("torch_ext::BackwardDriver" in event.name for event in profile.events()))
        optimizer.step()

    with torch_ext.enable():
        report = torch_ext.verify(step, models=[model], optimizers=[optimizer])
    assert report.identical, report.summary()
    assert on_torch_ext == [False, True]


def test_a_step_that_raises_leaves_the_model_as_it_was():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = _training_step(model, optimizer)
    train()
    before = _state(model, optimizer)

    def step():
        train()
        if torch_ext.is_enabled():
            raise ValueError("a failing step")

    with pytest.raises(ValueError, match="a failing step") as raised:
        torch_ext.verify(step, models=[model], optimizers=[optimizer])
    assert "torch_ext.verify: raised in step 0 of the torch_ext run" in raised.value.__notes__
    assert_identical(_state(model, optimizer), before, "restored state")
    # The engine wrapper is gone, and torch_ext is off again.
    assert Variable._execution_engine is torch_ext.engine._router and not torch_ext.is_enabled()


def test_gpt2_with_adamw_is_identical():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    model.train()  # dropout on: the generators' snapshot matters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 100, (2, 8))

    def step():
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        return loss

    report = torch_ext.verify(step, steps=2, models=[model], optimizers=[optimizer])

    assert report.identical, report.summary()
    # Per step: gradient and value of each parameter, AdamW's step, exp_avg and exp_avg_sq, the loss.
    assert report.compared == 2 * (5 * _parameter_count(model) + 1)
    assert all(run.order is not None and len(run.order) > 100 for run in report.backward["torch_ext"])


def test_a_step_that_differs_on_torch_ext_names_the_first_differing_parameter():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = torch_ext.verify(_training_step(model, optimizer, 1.0001), models=[model], optimizers=[optimizer])

    assert not report.identical
    first = report.first_difference
    # Every gradient differs; stock accumulates the last layer's bias first (nearest the loss).
    assert (first.step, first.backward_call, first.what, first.name) == (0, 0, "gradient", "2.bias"), first
    assert len(first.produced_by) == 1 and first.produced_by[0].startswith("AddmmBackward0 (sequence_nr "), first
    assert report.summary().startswith("torch_ext.verify: DIFFERENT")
    assert "first: step 0, backward call 0: gradient of 2.bias" in report.summary()


def test_a_difference_in_one_gradient_is_named_with_the_node_that_produced_it():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].weight.register_hook(lambda grad: grad * 1.0001 if torch_ext.is_enabled() else grad)
    report = torch_ext.verify(_training_step(model, optimizer), models=[model], optimizers=[optimizer])

    assert {(d.what, d.name) for d in report.differences} == {("gradient", "0.weight"), ("state", "0.weight")}
    first = report.first_difference
    assert (first.what, first.name) == ("gradient", "0.weight")
    assert len(first.produced_by) == 1 and first.produced_by[0].startswith("TBackward0 (sequence_nr "), first


def test_an_extra_backward_call_on_torch_ext_is_a_difference():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = _training_step(model, optimizer)

    def step():
        train()
        if torch_ext.is_enabled():
            torch.autograd.grad(model(torch.ones(1, 4)).sum(), [model[0].weight])

    report = torch_ext.verify(step, models=[model], optimizers=[optimizer])
    assert [(d.what, d.detail) for d in report.differences] == [("backward calls", "stock made 1, torch_ext 2")]
    assert "step 0, backward call 1 (cold): stock (no such call); torch_ext 6 nodes" in report.summary()


def test_random_generators_are_snapshotted():
    model = _mlp(dropout=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(16, 4)

    def step():
        optimizer.zero_grad()
        # torch's generator (dropout), Python's and NumPy's each change the gradients.
        scale = (1 + random.random()) * (1 + numpy.random.rand())
        loss = model(inputs).square().mean() * scale
        loss.backward()
        optimizer.step()
        return loss

    python_before, numpy_before = random.getstate(), numpy.random.get_state()
    report = torch_ext.verify(step, models=[model], optimizers=[optimizer])
    assert report.identical, report.summary()
    assert random.getstate() == python_before
    assert all(numpy.array_equal(a, b) for a, b in zip(numpy.random.get_state(), numpy_before))

    # Without restoring the generators between the runs, torch_ext's run draws other numbers.
    unrestored = _verify(step, 1, [model], [optimizer], (), None, restore_rng=False)
    assert not unrestored.identical
    assert unrestored.first_difference.what == "gradient"


def test_models_and_optimizers_are_found_when_not_given():
    model = _mlp()
    extra = torch.randn(8, requires_grad=True)  # a leaf no module holds
    optimizer = torch.optim.Adam([*model.parameters(), extra], lr=0.1)
    inputs = torch.randn(16, 4)

    def step():
        optimizer.zero_grad()
        hidden = model[1](model[0](inputs)) * extra
        (weight_grad,) = torch.autograd.grad(hidden.sum(), [model[0].weight], create_graph=True)
        loss = model[2](hidden).square().mean() + weight_grad.square().sum()
        loss.backward()
        optimizer.step()
        return loss

    report = torch_ext.verify(step)

    assert report.identical, report.summary()
    assert "models found in the step's references: model" in report.notes
    assert "optimizers found in the step's references: optimizer" in report.notes
    assert any("1 leaf tensor(s)" in note for note in report.notes), report.notes
    # The grad() call's result, then the backward: gradients, values and Adam's three state tensors of
    # the 4 parameters and the extra leaf, the loss.
    assert report.compared == 1 + 5 * 5 + 1
    assert [len(run.order) > 0 for run in report.backward["torch_ext"]] == [True, True]


STEP_MODULE = """
import torch
import torch.nn.functional as F

import torch_ext

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs, targets = torch.randn(16, 4), torch.randn(16, 1)


def step():
    optimizer.zero_grad()
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


def differing():
    def scaled_step():
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets) * (1.0001 if torch_ext.is_enabled() else 1.0)
        loss.backward()
        optimizer.step()

    return scaled_step, [model], [optimizer]
"""


@pytest.mark.slow
def test_command_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "train_step.py").write_text(textwrap.dedent(STEP_MODULE))

    # In a subprocess, as a user runs it: a .py file's factory, whose step differs on torch_ext.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch_ext", "verify", "--factory", f"{tmp_path / 'train_step.py'}:differing"]
    different = subprocess.run(command, cwd=tmp_path.parent, env=env, capture_output=True, text=True, check=False)
    assert different.returncode == 1, different.stdout + different.stderr
    assert different.stdout.startswith("torch_ext.verify: DIFFERENT"), different.stdout
    assert "first: step 0, backward call 0: gradient of 2.bias" in different.stdout, different.stdout

    # In this process (a subprocess costs 5 s here): a module's step, found from the working directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "train_step", raising=False)
    assert torch_ext_main(["verify", "train_step:step", "--steps", "2"]) == 0
    # Per step: 4 gradients, 4 parameters (SGD without momentum keeps no state), the loss.
    assert capsys.readouterr().out.startswith("torch_ext.verify: IDENTICAL: 18 values bit for bit, 2 steps")
    sys.modules.pop("train_step")


@pytest.mark.parametrize(
    "target, error",
    [
        ("train_step", "expected module:function, got 'train_step'"),
        ("nosuchmodule:fn", "no module named 'nosuchmodule'"),
        ("nosuchpackage.module:fn", "no module named 'nosuchpackage'"),
        ("train_step:nosuch", "train_step has no function 'nosuch'"),
        ("nosuchfile.py:step", "no such file: 'nosuchfile.py'"),
    ],
)
def test_command_line_names_a_bad_target_in_one_line(target, error, tmp_path, monkeypatch, capsys):
    (tmp_path / "train_step.py").write_text(textwrap.dedent(STEP_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "train_step", raising=False)
    # Exit status 2, as argparse gives for a bad argument: 1 means "different".
    with pytest.raises(SystemExit) as exit_info:
        torch_ext_main(["verify", target])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"python -m torch_ext verify: error: {error}"), stderr
    assert stderr.count("\n") == 1, stderr
    sys.modules.pop("train_step", None)


def test_command_line_keeps_the_traceback_of_an_import_inside_the_module(tmp_path, monkeypatch):
    (tmp_path / "broken_step.py").write_text("import nosuchdependency\n\ndef step():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="nosuchdependency"):
        torch_ext_main(["verify", "broken_step:step"])


def test_verify_is_the_function_and_the_module():
    assert isinstance(torch_ext.verify, types.ModuleType) and callable(torch_ext.verify)
    assert torch_ext.verify.VerifyReport is torch_ext.VerifyReport
    assert torch_ext.verify.Difference.__name__ == "Difference"  # documented in docs/api.rst
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = torch_ext.verify(_training_step(model, optimizer), models=[model], optimizers=[optimizer])
    assert isinstance(report, torch_ext.verify.VerifyReport) and report.identical


@pytest.mark.parametrize(
    "step, error",
    [
        (None, "step must be the training step, a callable that takes no arguments; got None"),
        ("train_step:step", "step must be the training step, a callable that takes no arguments; got a str"),
        (lambda batch: None, "step must take no arguments, but '<lambda>' has the signature (batch)"),
    ],
)
def test_verify_names_what_it_expects_of_step(step, error):
    with pytest.raises(TypeError, match=re.escape(f"torch_ext.verify: {error}")):
        torch_ext.verify(step)


def test_report_says_which_times_are_cold():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _training_step(model, optimizer)
    report = torch_ext.verify(step, steps=3, models=[model], optimizers=[optimizer])
    for engine in ("stock", "torch_ext"):
        assert [run.cold for run in report.backward[engine]] == [True, False, False]
    lines = report.summary().splitlines()
    assert [line.startswith("  step 0, backward call 0 (cold): stock 10 nodes in ") for line in lines].count(True) == 1
    assert "  step 1, backward call 0: stock 10 nodes in " in "\n".join(lines)
    (warm,) = [line for line in lines if "warm" in line]
    stock_ms = statistics.median(run.duration_ms for run in report.backward["stock"][1:])
    ours_ms = statistics.median(run.duration_ms for run in report.backward["torch_ext"][1:])
    assert warm.startswith(
        f"  warm backward time per step (median of steps 1-2): stock {stock_ms:.2f} ms, torch_ext {ours_ms:.2f} ms; "
        "step 0's times are cold (first calls"
    ), warm

    one_step = torch_ext.verify(step, models=[model], optimizers=[optimizer]).summary()
    assert "warm backward time" not in one_step
    assert "steps=2 or more (--steps 2) reports warm ones too" in one_step


def _float32_nan(payload_flip: int = 0) -> torch.Tensor:
    """torch's NaN as a float32[1], the bits ``payload_flip`` sets flipped in its payload (the low mantissa bits)."""
    return (torch.tensor([float("nan")]).view(torch.int32) ^ payload_flip).view(torch.float32)


def _float64_nan(payload: int) -> float:
    """A Python float NaN with ``payload`` in its mantissa's low bits."""
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0000 | payload))[0]


def test_nans_are_equal_whatever_their_payload_in_testing_and_in_verify():
    # One rule for both (torch_ext.testing._elements_differ): a NaN equals any NaN, every number is compared by its
    # bits. Both sides of each pair are checked through testing's identity_difference and verify's comparison.
    nan, flipped = _float32_nan(), _float32_nan(1)
    assert flipped.isnan().all() and not torch.equal(nan.view(torch.int32), flipped.view(torch.int32))
    equal = [
        (nan, nan.clone()),  # the same payload
        (nan, flipped),  # different payloads
        (-nan, nan),  # the sign bit flipped
        (torch.complex(nan, torch.ones(1)), torch.complex(flipped, torch.ones(1))),
        (_float64_nan(0), _float64_nan(1)),  # Python floats, as a step returns them
        (complex(_float64_nan(1), 0.0), complex(_float64_nan(2), 0.0)),
    ]
    for stock, ours in equal:
        assert identity_difference(ours, stock) is None, (stock, ours)
        assert _compare_values(stock, ours) is None, (stock, ours)
    different = [(nan, torch.ones(1)), (torch.zeros(1), -torch.zeros(1)), (0.0, -0.0), (_float64_nan(1), 1.0)]
    for stock, ours in different:
        assert identity_difference(ours, stock) is not None, (stock, ours)
        assert _compare_values(stock, ours) is not None, (stock, ours)
    assert _compare_values(nan, torch.ones(1)) == "1 of 1 elements differ"
    assert _compare_values(0.0, -0.0) == "stock 0.0, torch_ext -0.0"

    # Through verify itself: a step whose returned NaN has another payload on torch_ext is identical.
    def step():
        return _float32_nan(1 if torch_ext.is_enabled() else 0)

    report = torch_ext.verify(step)
    assert report.identical and report.compared == 1, report.summary()
