"""A backward plan compiled once per graph structure and replayed on later calls (csrc/engine/plan/plan_cache.h).

A training loop builds a graph of the same structure from new nodes every step; torch_ext keeps the plan
of a structure seen twice and rebinds it to the next call's nodes after checking that they have its shape.
Everything here compares with stock PyTorch, bit for bit, on the replayed calls, and checks from the cache's
own counters that a replay did happen (or, where the structure changed, did not).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import fuzz_settings, programs
from hypothesis import given
from hypothesis import strategies as st
from test_bit_stability import PRIORITIES, _assert_same_bits, _run_backward, _run_grad
from torch import nn

import torch_ext
from torch_ext import _C
from torch_ext.testing import assert_identical

# A structure is kept from its second call on: the third is the first replay.
FIRST_REPLAY = 3


@pytest.fixture(autouse=True)
def fresh_cache():
    previous = _C._set_plan_cache(True)
    _C._clear_plan_cache()
    _C._plan_cache_stats(True)
    yield
    _C._set_plan_cache(previous)


def _hits() -> int:
    return _C._plan_cache_stats(False)["hits"]


def _mlp_pair():
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ours = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def test_a_training_loop_replays_its_plan_with_stock_bits():
    stock, ours = _mlp_pair()
    stock_opt = torch.optim.SGD(stock.parameters(), lr=0.1)
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    steps = 6
    for _ in range(steps):
        x = torch.randn(5, 8)
        for model, opt, on_torch_ext in ((stock, stock_opt, False), (ours, our_opt, True)):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if on_torch_ext:
                torch_ext.backward(loss)
            else:
                loss.backward()
            opt.step()
        assert_identical(
            [(p.grad, p) for p in ours.parameters()], [(p.grad, p) for p in stock.parameters()], "(.grad, value)"
        )
    stats = _C._plan_cache_stats(False)
    assert stats["hits"] == steps - FIRST_REPLAY + 1 and stats["misses"] == FIRST_REPLAY - 1, stats
    assert stats["templates"] == 1 and stats["template_bytes"] > 0, stats


def test_grad_and_backward_inputs_replay_separately():
    stock, ours = _mlp_pair()
    for _ in range(FIRST_REPLAY):
        x = torch.randn(5, 8, requires_grad=True)
        expected = torch.autograd.grad(stock(x).sum(), x)
        assert_identical(torch_ext.grad(ours(x).sum(), x), expected, "grad()")
    assert _hits() == 1
    for _ in range(FIRST_REPLAY):
        x = torch.randn(5, 8, requires_grad=True)
        stock(x).sum().backward(inputs=[x])
        torch_ext.backward(ours(x).sum(), inputs=[x])
    assert _hits() == 2  # grad() and backward(inputs=) are two kinds of call: neither replays the other


def _shared_or_not(shared: bool, x: torch.Tensor) -> torch.Tensor:
    """The same node types and edges either way, except that one sin node feeds both exps, or each its own."""
    first = x.sin()
    second = first if shared else x.sin()
    return first.exp().sum() * 2 + second.exp().sum()


def _one_leaf_or_two(shared: bool, x: torch.Tensor) -> torch.Tensor:
    """Two multiplications into two leaves' AccumulateGrad nodes, or twice into x's: the same node types and
    edges, and every AccumulateGrad has the same sequence_nr, so only the nodes' identity tells them apart."""
    other = x if shared else torch.randn(4, requires_grad=True)
    return (x * 2).sum() + (other * 3).sum()


@pytest.mark.parametrize("build", [_shared_or_not, _one_leaf_or_two], ids=["inner node", "leaf"])
def test_a_node_reused_where_the_plan_had_two_is_a_new_plan(build):
    for _ in range(FIRST_REPLAY):
        x = torch.randn(4, requires_grad=True)
        torch_ext.backward(build(False, x))
    assert _hits() == 1
    x = torch.randn(4, requires_grad=True)
    torch_ext.backward(build(True, x))
    expected = x.grad.clone()
    x.grad = None
    build(True, x).backward()
    assert_identical(x.grad, expected, "x.grad")
    assert _hits() == 1, "the shared node was run as two nodes of the old plan"


def test_traced_calls_plan_afresh_and_follow_their_priorities():
    def run(priority: int) -> list[str]:
        x = torch.randn(3, requires_grad=True)
        a, b = x.sin(), x.cos()
        loss = a.sum() + b.sum()
        with torch_ext.trace() as trace:
            torch_ext.backward(loss, priorities={b.grad_fn: priority})
        return [event["name"] for event in trace.events if event["kind"] == "node"]

    for _ in range(FIRST_REPLAY):
        high = run(10)
    # A trace records where each priority came from, which a template does not keep: traced calls plan afresh.
    assert _hits() == 0
    assert high.index("CosBackward0") < high.index("SinBackward0")
    low = run(-10)
    assert low.index("SinBackward0") < low.index("CosBackward0")


def test_changed_priorities_are_not_replayed_untraced():
    x = torch.randn(3, requires_grad=True)
    for _ in range(FIRST_REPLAY):
        a, b = x.sin(), x.cos()
        torch_ext.backward(a.sum() + b.sum(), priorities={b.grad_fn: 10})
    hits = _hits()
    assert hits == 1
    a, b = x.sin(), x.cos()
    torch_ext.backward(a.sum() + b.sum(), priorities={b.grad_fn: -10})
    assert _hits() == hits, "a call with other priorities replayed the old plan"


REPLAY_SETTINGS = fuzz_settings(60)
FAN_IN_PROGRAMS = programs(dtype=torch.float64, max_ops=24, fan_in=True, retain_grad=True)


@pytest.mark.parametrize("entry", ["backward", "grad"])
@pytest.mark.parametrize("drawn_priorities", [None, *PRIORITIES.values()], ids=["none", *PRIORITIES])
@REPLAY_SETTINGS
@given(program=FAN_IN_PROGRAMS, data=st.data())
def test_replayed_random_graphs_keep_stock_bits(entry, drawn_priorities, program, data):
    """Each example builds its graph anew for every call, as a training step does; the replays (from the third
    call) must give stock's gradients, retained values, hook values and grad() results."""
    priorities = None if drawn_priorities is None else data.draw(drawn_priorities)
    _C._clear_plan_cache()
    hits_before = _hits()
    if entry == "backward":
        stock = _run_backward(program, None)
        for _ in range(FIRST_REPLAY):
            _assert_same_bits(stock, _run_backward(program, priorities or []))
    else:
        stock_results, stock = _run_grad(program, None)
        for _ in range(FIRST_REPLAY):
            results, record = _run_grad(program, priorities or [])
            _assert_same_bits(stock, record)
            assert_identical(results, stock_results, "grad() results of each run")
    assert _hits() > hits_before, "the third call of the same structure did not replay its plan"


def test_disabled_cache_plans_every_call():
    _C._set_plan_cache(False)
    try:
        _, ours = _mlp_pair()
        for _ in range(FIRST_REPLAY + 1):
            x = torch.randn(5, 8)
            torch_ext.backward(ours(x).sum())
        assert _hits() == 0 and _C._plan_cache_stats(False)["templates"] == 0
        _C._set_plan_cache(True)
        torch_ext.backward(ours(torch.randn(5, 8)).sum())
        assert _hits() == 0, "calls while off were remembered"
    finally:
        _C._set_plan_cache(True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["on", "off"])
def test_environment_switch(mode):
    code = "import torch_ext; print(torch_ext._C._plan_cache_stats(False)['enabled'])"
    env = dict(os.environ, TORCH_EXT_PLAN_CACHE=mode)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(mode == "on")


@pytest.mark.slow
def test_environment_switch_rejects_other_values():
    env = dict(os.environ, TORCH_EXT_PLAN_CACHE="maybe")
    result = subprocess.run(
        [sys.executable, "-c", "import torch_ext"], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "TORCH_EXT_PLAN_CACHE must be one of ('on', 'off', '1', '0'), got 'maybe'" in result.stderr


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed")
def test_hugging_face_training_loop_replays_with_stock_bits():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    stock, ours = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    ours.load_state_dict(stock.state_dict())
    stock.eval(), ours.eval()  # no dropout: the two models draw no random numbers in training
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in (stock, ours)]
    steps = 5
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 16))
        for model, optimizer, on_torch_ext in ((stock, optimizers[0], False), (ours, optimizers[1], True)):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
                loss.backward()
            optimizer.step()
        assert_identical(list(ours.parameters()), list(stock.parameters()), "parameters")
    assert _hits() == steps - FIRST_REPLAY + 1
