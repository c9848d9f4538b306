"""A synchronous collective that another library wrote: Megatron-core's ``_AllToAll`` in an expert-parallel layer.

Megatron-core (``megatron.core.tensor_parallel.mappings._AllToAll``) and DeepSpeed
(``deepspeed.moe.sharded_moe._AllToAll``) write their MoE all_to_all as an autograd Function whose
backward runs the gradient's all_to_all synchronously, inside its own node. torch_ext recognises both
classes as launches (``torch_ext.collectives``) and drives to them first, but cannot defer their wait:
the node returns only once the bytes have arrived. What priority alone gives: the collective runs before
the dense layers instead of after them, the gradients stay stock's bits. (Megatron's unequal-split path
allocates on ``torch.cuda.current_device()``, so on CPU the layer dispatches a fixed capacity per expert:
equal splits.)
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    WORLD_SIZE,
    assert_torch_ext_matches_stock,
    profiled_backward,
    ran_on_torch_ext,
    run_ranks,
    train_on_both_engines,
)
from torch import nn

import torch_ext

pytestmark = pytest.mark.distributed

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.core") is not None
)
NEEDS_MEGATRON = pytest.mark.skipif(
    not HAS_MEGATRON, reason="Megatron-core is not installed (pip install torch==2.13.0 megatron-core==0.16.1)"
)

STEPS = 2
DIM = 8
# Tokens each rank sends each expert (a fixed capacity: equal splits).
CAPACITY = 6
DENSE_LAYERS = 3
LAUNCH = "_AllToAllBackward"


class SyncExpertParallel(nn.Module):
    """tokens -> gate scores; tokens dispatched to the 2 experts (one per rank) by Megatron's all_to_all, the
    expert, combined back by another; a dense path created after them (so stock runs it first in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, 1)
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(DENSE_LAYERS)])
        self.head = nn.Linear(DIM, 1)
        # The last forward's backward nodes whose order the test checks.
        self.nodes: dict = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import all_to_all

        group = dist.group.WORLD
        dispatched = all_to_all(group, tokens)  # CAPACITY tokens to each rank's expert
        returned = all_to_all(group, self.expert(dispatched))
        moe = returned * torch.sigmoid(self.gate(tokens))
        dense = self.dense(tokens)
        self.nodes = {"all_to_all": returned.grad_fn, "dense": dense.grad_fn}
        return self.head(moe + dense)


def _node_order(labels: dict) -> list[str]:
    """Pre-hooks on the labelled nodes; the list they fill, in the order the engine runs them."""
    order: list[str] = []
    for label, node in labels.items():
        node.register_prehook(lambda grads, label=label: order.append(label))
    return order


def _train(case: None, rank: int, on_torch_ext: bool) -> dict:
    torch.manual_seed(rank)
    model = SyncExpertParallel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {"grads": [], "orders": [], "driver_ran": None}
    with torch_ext.enabled() if on_torch_ext else contextlib.nullcontext():
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * rank + step)
            tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM, generator=generator)
            target = torch.randn(WORLD_SIZE * CAPACITY, 1, generator=generator)
            optimizer.zero_grad()
            output = model(tokens)
            loss = F.mse_loss(output, target)
            assert model.nodes["all_to_all"].name() == LAUNCH, model.nodes["all_to_all"].name()
            order = _node_order(model.nodes)
            if result["driver_ran"] is None:
                result["driver_ran"] = ran_on_torch_ext(profiled_backward(loss))
            else:
                loss.backward()
            result["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
            result["orders"].append(order)
            optimizer.step()
    return result


def _train_on_both(rank: int) -> dict:
    return train_on_both_engines({"megatron_all_to_all": None}, _train, rank)


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_train_on_both, tmp_path_factory.mktemp("sync_collectives"))


@NEEDS_MEGATRON
def test_megatron_all_to_all_runs_first_with_stock_bits(sync_results):
    for rank, result in enumerate(sync_results):
        runs = result["megatron_all_to_all"]
        stock_orders, our_orders = runs["stock"].pop("orders"), runs["torch_ext"].pop("orders")
        # Stock: the dense path (created later) runs before the all_to_all; torch_ext drives to it first.
        assert all(order == ["dense", "all_to_all"] for order in stock_orders), (rank, stock_orders)
        assert all(order == ["all_to_all", "dense"] for order in our_orders), (rank, our_orders)
    assert_torch_ext_matches_stock(sync_results, "megatron_all_to_all")
