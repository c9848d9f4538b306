"""torch.compile on 2 gloo ranks: repeated compiles with a lane never fail, and torch_ext.compile_backend keeps
each all_to_all a node of its own, run in its lane beside the compiled compute, with the stock engine's bits on
the same compiled model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import assert_identical, run_ranks
from torch import nn

import torch_ext
from torch_ext.compiler import compile_backend

pytestmark = pytest.mark.distributed

FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single
NODE = "GeneratedBackwardFor__c10d_functional_all_to_all_single_defaultBackward"
COMPILES = 20
STEPS = 2
DIM = 16
TOKENS = 8


class ExpertParallel(nn.Module):
    """Tokens dispatched by the functional all_to_all to an expert and combined back, a dense path beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, DIM)  # so that the dispatch's backward runs too
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        dispatched = funcol.all_to_all_single_autograd(self.gate(tokens), None, None, group)
        combined = funcol.all_to_all_single_autograd(self.expert(dispatched), None, None, group)
        return (combined + self.dense(tokens)).square().mean()


def _repeated_compiles() -> int:
    """Compiles of the laned model under enable(), caches off; returns how many ran a backward."""
    completed = 0
    with torch._inductor.config.patch(force_disable_caches=True):
        for _ in range(COMPILES):
            torch._dynamo.reset()
            compiled = torch.compile(ExpertParallel(), backend="aot_eager")
            with torch_ext.enable():
                compiled(torch.randn(TOKENS, DIM)).backward()
            completed += 1
    torch._dynamo.reset()
    return completed


def _train(compiled: nn.Module, model: nn.Module, rank: int, on_torch_ext: bool) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {"losses": [], "grads": [], "node_threads": None}
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        optimizer.zero_grad()
        loss = compiled(torch.randn(TOKENS, DIM))
        if on_torch_ext:
            with torch_ext.enable(), torch.profiler.profile() as profile:
                loss.backward()
            if step == 0:
                result["node_threads"] = _node_threads(profile.events())
        else:
            loss.backward()
        result["losses"].append(loss.detach())
        result["grads"].append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result


def _node_threads(events) -> dict[str, list[int]]:
    threads: dict[str, set[int]] = {"all_to_all": set(), "compiled": set(), "all_to_all_nodes": 0}
    for event in events:
        if event.name == NODE:
            threads["all_to_all"].add(event.thread)
            threads["all_to_all_nodes"] += 1
        elif event.name == "autograd::engine::evaluate_function: CompiledFunctionBackward":
            threads["compiled"].add(event.thread)
    return {key: sorted(value) if isinstance(value, set) else value for key, value in threads.items()}


def _run(rank: int) -> dict:
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    results = {"compiles": _repeated_compiles()}
    torch.manual_seed(0)
    model = ExpertParallel()
    initial = copy.deepcopy(model.state_dict())
    compiled = torch.compile(model, backend=compile_backend(), fullgraph=True)
    results["stock"] = _train(compiled, model, rank, on_torch_ext=False)
    model.load_state_dict(initial)
    results["torch_ext"] = _train(compiled, model, rank, on_torch_ext=True)
    torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("compile"), timeout_s=600)


def test_twenty_compiles_with_a_lane_complete_on_both_ranks(results):
    assert [result["compiles"] for result in results] == [COMPILES, COMPILES]


def test_the_compile_backend_keeps_stocks_bits(results):
    for rank, result in enumerate(results):
        stock, ours = result["stock"], result["torch_ext"]
        assert_identical(ours["losses"], stock["losses"], f"rank {rank} losses")
        assert_identical(ours["grads"], stock["grads"], f"rank {rank} grads")
        assert_identical(ours["params"], stock["params"], f"rank {rank} params")


def test_each_all_to_all_is_a_node_in_its_lane_beside_the_compiled_compute(results):
    for rank, result in enumerate(results):
        threads = result["torch_ext"]["node_threads"]
        assert threads["all_to_all_nodes"] == 2, (rank, threads)
        assert threads["all_to_all"] and threads["compiled"], (rank, threads)
        assert not set(threads["all_to_all"]) & set(threads["compiled"]), (rank, threads)
