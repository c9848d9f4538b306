"""Collectives other libraries wrote, on two gloo ranks: TorchRec's DLRM and a hand-written Req/Wait pair.

TorchRec (torchrec/distributed/comm_ops.py) writes its all_to_all as a Req/Wait pair of autograd
Functions; in backward the Wait's node launches the gradient all_to_all and the Req's node waits for
it. torch_ext knows them: it drives to the launch first and runs the wait as late as its readers
allow. Gradients, and the tables after TorchRec's fused update, are stock's bits.

One spawn runs every case on both engines (spawning is most of the time).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
from _harness import WORLD_SIZE, run_ranks, train_on_both_engines
from engine_helpers import graph_nodes

import torch_ext
from torch_ext.testing import assert_identical, dlrm_batch, sharded_dlrm

pytestmark = pytest.mark.distributed

HAS_TORCHREC = all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))
NEEDS_TORCHREC = pytest.mark.skipif(
    not HAS_TORCHREC,
    reason="TorchRec is not installed (README, 'TorchRec': pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 ...)",
)

STEPS = 3
BATCH = 4
DENSE_FEATURES = 4
TABLES = 2
ROWS = 50
DIM = 8
LEARNING_RATE = 0.1
LAUNCH, WAIT = "All2All_Pooled_WaitBackward", "All2All_Pooled_ReqBackward"


def _dlrm(rank: int):
    """DLRM whose EmbeddingBagCollection is sharded table-wise over the ranks, with the fused CPU kernel."""
    return sharded_dlrm(
        tables=TABLES,
        rows=ROWS,
        dim=DIM,
        dense_features=DENSE_FEATURES,
        dense_layer_sizes=[16, DIM],
        over_layer_sizes=[16, 1],
        learning_rate=LEARNING_RATE,
        world_size=WORLD_SIZE,
    )


def _batch(rank: int, step: int):
    return dlrm_batch(
        seed=100 * step + rank,
        batch=BATCH,
        dense_features=DENSE_FEATURES,
        tables=TABLES,
        rows=ROWS,
        ids_per_bag=(0, 3),
    )


def _local_tables(model) -> dict:
    return {
        name: [shard.tensor.clone() for shard in value.local_shards()]
        for name, value in model.state_dict().items()
        if hasattr(value, "local_shards")
    }


def _engine(on_torch_ext: bool):
    return torch_ext.enable() if on_torch_ext else contextlib.nullcontext()


def _record_order(roots) -> list:
    """Pre-hooks on every node of the graph; returns the list they fill with nodes in the order they run."""
    order = []
    for node in graph_nodes(roots):
        node.register_prehook(lambda grads, node=node: order.append(node))
    return order


def _train_dlrm(case, rank: int, on_torch_ext: bool) -> dict:
    model = _dlrm(rank)
    dense_arch_outputs = []
    model.module.dense_arch.register_forward_hook(lambda module, args, out: dense_arch_outputs.append(out))
    dense_params = {name: p for name, p in model.named_parameters() if "embedding_bags" not in name}
    result = {"tables_before": _local_tables(model), "losses": [], "dense_grads": []}
    for step in range(STEPS):
        dense, sparse, labels = _batch(rank, step)
        logits = model(dense, sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        order = _record_order([loss])
        dense_arch_nodes = set(graph_nodes([dense_arch_outputs[-1]])) - set(graph_nodes(list(dense_params.values())))
        with _engine(on_torch_ext), torch_ext.trace() as trace:
            loss.backward()
        names = [node.name() for node in order]
        positions = [i for i, node in enumerate(order) if node in dense_arch_nodes]
        result["losses"].append(loss.detach())
        result["dense_grads"].append({name: p.grad.clone() for name, p in dense_params.items()})
        with torch.no_grad():
            for p in dense_params.values():
                p.add_(p.grad, alpha=-LEARNING_RATE)
                p.grad = None
    result["tables_after"] = _local_tables(model)
    # The last step's order: where the launch and the wait ran against the dense arch's nodes.
    result["order"] = {
        "launch": names.index(LAUNCH),
        "wait": names.index(WAIT),
        "dense_arch": (min(positions), max(positions)),
        "launch_priority_from": [e["priority_from"] for e in trace.events if e["name"] == LAUNCH],
    }
    return result


# A hand-written Req/Wait pair, as a library would write one: Req launches an all_to_all in forward
# and Wait waits for it; in backward Wait's node launches the gradient's and Req's node waits.
class _Request:
    def __init__(self):
        self.work = None
        self.tensor = None


class HandReq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, request, x):
        request.tensor = torch.empty_like(x)
        request.work = dist.all_to_all_single(request.tensor, x.contiguous(), async_op=True)
        ctx.request = request
        return x.new_zeros(1)  # links Req to Wait in the graph

    @staticmethod
    def backward(ctx, _):
        request = ctx.request
        request.work.wait()
        request.work = None
        return None, request.tensor


class HandWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, request, link):
        request.work.wait()
        request.work = None
        ctx.request = request
        return request.tensor

    @staticmethod
    def backward(ctx, grad):
        request = ctx.request
        request.tensor = torch.empty_like(grad)
        request.work = dist.all_to_all_single(request.tensor, grad.contiguous(), async_op=True)
        return None, torch.zeros(1)


def _leaf(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(*shape, generator=generator).requires_grad_()


def _train_hand_written(case, rank: int, on_torch_ext: bool) -> dict:
    """lookup -> hand-written all_to_all -> sparse layers; a dense chain created later; loss joins them."""
    table = _leaf(rank, 2 * WORLD_SIZE, 3)
    request = _Request()
    exchanged = HandWait.apply(request, HandReq.apply(request, table.exp()))
    sparse = exchanged
    weights = [_leaf(rank, 3, 3, salt=salt + 1) for salt in range(2)]
    for weight in weights:
        sparse = torch.tanh(sparse @ weight)
    dense = _leaf(rank, 2 * WORLD_SIZE, 3, salt=9)
    chain = dense
    for _ in range(3):
        chain = chain.sigmoid()
    loss = (sparse * chain).sum()
    order = _record_order([loss])
    with _engine(on_torch_ext):
        loss.backward()
    names = [node.name() for node in order]
    return {
        "grads": [leaf.grad for leaf in (table, dense, *weights)],
        "order": names,
    }


def _run_everything(rank: int) -> dict:
    torch_ext.register_collective_backward(launches=HandWait, waits=HandReq)
    results = {"hand_written": train_on_both_engines({"pair": None}, _train_hand_written, rank)}
    if HAS_TORCHREC:
        results["dlrm"] = train_on_both_engines({"table_wise": None}, _train_dlrm, rank)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(_run_everything, tmp_path_factory.mktemp("torchrec"))


def _engines(rank_results, name, case):
    return [(result[name][case]["stock"], result[name][case]["torch_ext"]) for result in rank_results]


@NEEDS_TORCHREC
def test_dlrm_grads_and_tables_are_stock_bits(rank_results):
    for rank, (stock, ours) in enumerate(_engines(rank_results, "dlrm", "table_wise")):
        assert_identical(ours["tables_before"], stock["tables_before"], f"rank {rank} tables before")
        for key in ("losses", "dense_grads", "tables_after"):
            assert_identical(ours[key], stock[key], f"rank {rank} {key}")
        # The fused update changed the tables: the comparison is not of untouched weights.
        before, after = (
            torch.cat([shard.flatten() for shards in tables.values() for shard in shards])
            for tables in (stock["tables_before"], stock["tables_after"])
        )
        assert not torch.equal(before, after)


@NEEDS_TORCHREC
def test_dlrm_all_to_all_launches_first_and_is_waited_on_last(rank_results):
    for rank, (stock, ours) in enumerate(_engines(rank_results, "dlrm", "table_wise")):
        stock_order, our_order = stock["order"], ours["order"]
        # Stock: launch and wait back to back, the communication exposed.
        assert stock_order["wait"] == stock_order["launch"] + 1, f"rank {rank}: {stock_order}"
        assert stock_order["launch_priority_from"] == [], "stock ran on torch_ext"
        # torch_ext: launch before the dense arch's backward, wait after all of it.
        first_dense, last_dense = our_order["dense_arch"]
        assert our_order["launch"] < first_dense <= last_dense < our_order["wait"], f"rank {rank}: {our_order}"
        assert our_order["launch_priority_from"] == ["collective"]


def test_hand_written_pair_is_stock_bits_launched_first_and_waited_on_last(rank_results):
    for rank, (stock, ours) in enumerate(_engines(rank_results, "hand_written", "pair")):
        assert_identical(ours["grads"], stock["grads"], f"rank {rank}")
        stock_order, our_order = stock["order"], ours["order"]
        launch, wait = "HandWaitBackward", "HandReqBackward"
        assert stock_order.index(wait) == stock_order.index(launch) + 1, stock_order
        # Stock runs the dense chain (created last) before the launch; torch_ext launches first, runs the
        # chain while the all_to_all is in flight, and waits after it.
        stock_dense = [i for i, name in enumerate(stock_order) if name == "SigmoidBackward0"]
        assert len(stock_dense) == 3 and max(stock_dense) < stock_order.index(launch), stock_order
        dense = [i for i, name in enumerate(our_order) if name == "SigmoidBackward0"]
        assert our_order.index(launch) < min(dense) and max(dense) < our_order.index(wait), our_order
