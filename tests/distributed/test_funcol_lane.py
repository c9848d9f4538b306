"""PyTorch's functional all_to_all in a lane, on 2 gloo ranks: stock's bits, beside the dense path.

``all_to_all_single_autograd`` (what DTensor code and torchtitan call) is the op
``_c10d_functional::all_to_all_single``, whose ``torch.library`` autograd formula issues the gradient's
all_to_all and waits for it inside the node: on stock, and on torch_ext undeclared, the engine waits there.
Declared with ``torch_ext.run_in_lane(torch.ops._c10d_functional.all_to_all_single)``, the node runs on its
group's lane (the group its formula saved by name) while the dense path runs on the engine thread, and every
loss, gradient and parameter after several SGD steps is stock's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import assert_identical, node_threads, profiled_backward, ran_on_torch_ext, run_ranks
from torch import nn

import torch_ext

pytestmark = pytest.mark.distributed

STEPS = 3
DIM = 8
TOKENS = 6
FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single
NODE = "GeneratedBackwardFor__c10d_functional_all_to_all_single_defaultBackward"


class FunctionalExpertParallel(nn.Module):
    """tokens dispatched by funcol's all_to_all to the expert, combined back by another; a dense path made after
    them, so stock runs it first in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        dispatched = funcol.all_to_all_single_autograd(tokens, None, None, group)
        returned = funcol.all_to_all_single_autograd(self.expert(dispatched), None, None, group)
        return self.head(returned + self.dense(tokens))


def _train(rank: int, on_torch_ext: bool) -> dict:
    torch.manual_seed(rank)
    model = FunctionalExpertParallel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        tokens = torch.randn(2 * TOKENS, DIM)
        optimizer.zero_grad()
        loss = model(tokens).square().mean()
        with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
            if step == 0:
                events = profiled_backward(loss)
                result["driver_ran"], result["threads"] = (
                    ran_on_torch_ext(events),
                    node_threads(events, lambda name: name.endswith(NODE)),
                )
            else:
                loss.backward()
        result["losses"].append(loss.detach())
        result["grads"].append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result


def _run(rank: int) -> dict:
    results = {"role_before": torch_ext.collective_role(_funcol_node_class())}
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    results["role_declared"] = torch_ext.collective_role(_funcol_node_class())
    results["stock"] = _train(rank, on_torch_ext=False)
    results["lane"] = _train(rank, on_torch_ext=True)
    torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)
    results["role_undone"] = torch_ext.collective_role(_funcol_node_class())
    return results


def _funcol_node_class() -> type:
    from torch_ext.collectives.roles import _generated_function

    return _generated_function(FUNCOL_ALL_TO_ALL.default, "test")._backward_cls


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("funcol_lane"))


def test_the_functional_all_to_all_runs_in_a_lane_with_stock_bits(results):
    for rank, result in enumerate(results):
        stock, lane = result["stock"], result["lane"]
        assert not stock["driver_ran"] and lane["driver_ran"], rank
        assert_identical(lane["losses"], stock["losses"], f"rank {rank} losses")
        assert_identical(lane["grads"], stock["grads"], f"rank {rank} grads")
        assert_identical(lane["params"], stock["params"], f"rank {rank} params")


def test_the_all_to_alls_leave_the_engine_thread(results):
    for rank, result in enumerate(results):
        stock, lane = result["stock"]["threads"], result["lane"]["threads"]
        # Stock: every node on one thread. The lane: the all_to_alls on their lane, the matmuls on the engine's.
        assert stock["all_to_all"] == stock["dense"], (rank, stock)
        assert lane["all_to_all"] and lane["dense"] and not lane["all_to_all"] & lane["dense"], (rank, lane)


def test_the_declaration_is_undone_to_the_built_in_role(results):
    for result in results:
        assert (result["role_before"], result["role_declared"], result["role_undone"]) == ("launch", "lane", "launch")


def test_an_op_without_an_autograd_formula_is_refused():
    with pytest.raises(ValueError, match="has no autograd formula registered"):
        torch_ext.run_in_lane(torch.ops.aten.mm.default)
