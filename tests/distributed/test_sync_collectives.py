"""Synchronous collectives that other libraries wrote: Megatron-core's and DeepSpeed's MoE ``_AllToAll``.

Both write their expert all_to_all as an autograd Function whose backward runs the gradient's
all_to_all synchronously, inside its own node. Undeclared, torch_ext runs them in stock's order (starting
them earlier gains nothing: the node blocks either way). Declared to a lane (``torch_ext.run_in_lane``),
the node is dispatched first and its apply() runs on its group's lane thread while the engine runs the
dense path. Every case trains a few SGD steps on both engines: gradients ``torch.equal`` to stock's.
(Megatron's unequal-split path allocates on ``torch.cuda.current_device()``, so on CPU the layer
dispatches a fixed capacity per expert: equal splits.)
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    WORLD_SIZE,
    assert_torch_ext_matches_stock,
    node_threads,
    profiled_backward,
    ran_on_torch_ext,
    run_ranks,
    train_on_both_engines,
)
from torch import nn

import torch_ext

pytestmark = pytest.mark.distributed


def _installed(package: str, module: str) -> bool:
    return importlib.util.find_spec(package) is not None and importlib.util.find_spec(module) is not None


HAS_MEGATRON = _installed("megatron", "megatron.core")
HAS_DEEPSPEED = _installed("deepspeed", "deepspeed.moe")
NEEDS_MEGATRON = pytest.mark.skipif(
    not HAS_MEGATRON, reason="Megatron-core is not installed (pip install torch==2.13.0 megatron-core==0.16.1)"
)
NEEDS_DEEPSPEED = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install torch==2.13.0 deepspeed==0.19.8)"
)

STEPS = 3
DIM = 8
# Tokens each rank sends each expert (a fixed capacity: equal splits).
CAPACITY = 6
DENSE_LAYERS = 3
LAUNCH = "_AllToAllBackward"


def _all_to_all(library: str):
    """``all_to_all(group, tokens)`` through the library's own ``_AllToAll`` Function, and that Function."""
    if library == "megatron":
        from megatron.core.tensor_parallel.mappings import _AllToAll, all_to_all

        return all_to_all, _AllToAll
    import deepspeed.comm
    from deepspeed.moe.sharded_moe import _AllToAll

    # DeepSpeed's collectives go through deepspeed.comm, which adopts the process group already made.
    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return _AllToAll.apply, _AllToAll


@dataclass(frozen=True)
class Case:
    library: str
    lane: bool
    # Wraps the dense path in DistributedDataParallel on a group of its own.
    ddp: bool = False


class SyncExpertParallel(nn.Module):
    """tokens -> gate scores; tokens dispatched to the 2 experts (one per rank) by the library's all_to_all, the
    expert, combined back by another; a dense path created after them (so stock runs it first in backward)."""

    def __init__(self, library: str, ddp_group=None) -> None:
        super().__init__()
        self.all_to_all, _ = _all_to_all(library)
        self.gate = nn.Linear(DIM, 1)
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(DENSE_LAYERS)])
        self.dense = dense if ddp_group is None else nn.parallel.DistributedDataParallel(dense, process_group=ddp_group)
        self.head = nn.Linear(DIM, 1)
        # The last forward's backward nodes whose order the test checks.
        self.nodes: dict = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        dispatched = self.all_to_all(group, tokens)  # CAPACITY tokens to each rank's expert
        returned = self.all_to_all(group, self.expert(dispatched))
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


@contextlib.contextmanager
def _declared(function, lane: bool):
    if not lane:
        yield
        return
    torch_ext.run_in_lane(function)
    try:
        yield
    finally:
        torch_ext.unregister_collective_backward(function)


def _train(case: Case, rank: int, on_torch_ext: bool) -> dict:
    torch.manual_seed(rank)
    ddp_group = dist.new_group(list(range(WORLD_SIZE))) if case.ddp else None
    if case.ddp:
        torch.manual_seed(0)  # DDP starts from rank 0's parameters: the same dense path on both
    model = SyncExpertParallel(case.library, ddp_group)
    _, function = _all_to_all(case.library)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {"grads": [], "orders": [], "driver_ran": None, "threads": None}
    with (
        torch_ext.enable() if on_torch_ext else contextlib.nullcontext(),
        _declared(function, case.lane and on_torch_ext),
    ):
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * rank + step)
            tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM, generator=generator)
            target = torch.randn(WORLD_SIZE * CAPACITY, 1, generator=generator)
            optimizer.zero_grad()
            loss = F.mse_loss(model(tokens), target)
            assert model.nodes["all_to_all"].name() == LAUNCH, model.nodes["all_to_all"].name()
            order = _node_order(model.nodes)
            if result["driver_ran"] is None:
                events = profiled_backward(loss)
                result["driver_ran"] = ran_on_torch_ext(events)
                result["threads"] = node_threads(events, lambda name: name == LAUNCH)
            else:
                loss.backward()
            result["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
            result["orders"].append(order)
            optimizer.step()
    return result


CASES = {
    f"{library}_{'lane' if lane else 'no_lane'}": Case(library, lane)
    for library in ("megatron", "deepspeed")
    for lane in (False, True)
}
CASES["megatron_lane_ddp_other_group"] = Case("megatron", lane=True, ddp=True)


def _train_on_both(rank: int) -> dict:
    cases = {name: case for name, case in CASES.items() if (HAS_MEGATRON, HAS_DEEPSPEED)[case.library != "megatron"]}
    return train_on_both_engines(cases, _train, rank)


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory) -> list[dict]:
    if not (HAS_MEGATRON or HAS_DEEPSPEED):
        pytest.skip("neither Megatron-core nor DeepSpeed is installed")
    return run_ranks(_train_on_both, tmp_path_factory.mktemp("sync_collectives"))


def _check_case(sync_results: list[dict], case_name: str) -> None:
    case = CASES[case_name]
    for rank, result in enumerate(sync_results):
        runs = result[case_name]
        stock_orders, our_orders = runs["stock"].pop("orders"), runs["torch_ext"].pop("orders")
        stock_threads, our_threads = runs["stock"].pop("threads"), runs["torch_ext"].pop("threads")
        # Stock: the dense path (created later) runs before the all_to_all. Without a lane torch_ext keeps
        # that order; with one it dispatches the all_to_all first and runs it on another thread than the
        # dense path's.
        assert all(order == ["dense", "all_to_all"] for order in stock_orders), (rank, stock_orders)
        expected = ["all_to_all", "dense"] if case.lane else ["dense", "all_to_all"]
        assert all(order == expected for order in our_orders), (rank, our_orders)
        assert stock_threads["all_to_all"] == stock_threads["dense"], (rank, stock_threads)
        assert len(our_threads["dense"]) == 1 and len(our_threads["all_to_all"]) == 1, (rank, our_threads)
        assert (our_threads["all_to_all"] != our_threads["dense"]) == case.lane, (rank, our_threads)
    assert_torch_ext_matches_stock(sync_results, case_name)


@NEEDS_MEGATRON
@pytest.mark.parametrize("lane", [False, True], ids=["no_lane", "lane"])
def test_megatron_all_to_all_with_stock_bits(sync_results, lane):
    _check_case(sync_results, f"megatron_{'lane' if lane else 'no_lane'}")


@NEEDS_DEEPSPEED
@pytest.mark.parametrize("lane", [False, True], ids=["no_lane", "lane"])
def test_deepspeed_all_to_all_with_stock_bits(sync_results, lane):
    _check_case(sync_results, f"deepspeed_{'lane' if lane else 'no_lane'}")


@NEEDS_MEGATRON
def test_lane_beside_ddp_on_another_group(sync_results):
    _check_case(sync_results, "megatron_lane_ddp_other_group")
