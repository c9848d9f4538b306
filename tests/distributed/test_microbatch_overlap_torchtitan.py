"""Overlap across microbatches (``torch_ext.overlap_microbatches``) with torchtitan 0.3.0's MoE layer, on 2 gloo ranks:
4 microbatches per step, 3 AdamW steps, dropout in the model; every loss, every step's gradients and the final
parameters must equal stock's sequential loop's bit for bit, on both ranks.

torchtitan's MoE is PyTorch-native: ``torchtitan.models.common.moe.MoE`` (``TokenChoiceTopKRouter``,
``RoutedExperts`` with ``GroupedExperts`` and the ``AllToAllTokenDispatcher``), built from its configs, its sharding
configs set by ``set_moe_sharding_config`` (expert parallel) and parallelized with ``Module.parallelize`` over
torchtitan's own ``ParallelDims(dp_shard=2, ep=2)`` mesh under the default ``spmd_types`` backend: each rank keeps 2 of
the 4 experts. The dispatcher exchanges the token counts (spmd_types' ``_AllToAllStack``, no grad) and runs its
dispatch and combine all_to_all-v through spmd_types' synchronous autograd Function ``_AllToAllUneven``, whose backward
issues the reverse all_to_all-v inside its node; it saves its process group as ``ctx.axis`` (the ep mesh axis'
group, resolved in forward), which ``run_in_lane(..., group_of=...)`` is told.

What torchtitan needs on CPU, in this rank only (:func:`_torchtitan_on_cpu`; none of it touches autograd):

- ``ParallelDims.build_mesh`` makes its meshes with ``torchtitan.tools.utils.device_type``, "cuda" on a machine
  without an accelerator: "cpu" here.
- It gives every mesh dimension of degree 1 (pp, dp_replicate, cp, tp, efsdp) the "fake" c10d backend, which
  ``torch.testing._internal.distributed.fake_pg`` registers.
- spmd_types runs every all_to_all as ``torch.distributed.all_to_all`` (lists of tensors), which gloo implements for
  equal sizes only ("ProcessGroupGloo::alltoall: invalid tensor size"); its patchable ``spmd_types._dist`` module
  gets a stand-in whose ``all_to_all`` runs gloo's ``all_to_all_single`` with the chunks' sizes as split sizes
  (everything else is ``torch.distributed``). Stock's and the overlap's runs both use it.
- ``GroupedExperts`` runs ``torch._grouped_mm`` in bf16, whose CPU kernel wants 16-byte strides: DIM and HIDDEN are
  multiples of 8.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist
from _harness import assert_identical, run_ranks
from torch import nn

import torch_ext

pytest.importorskip("spmd_types", reason="spmd_types is not installed (pip install --no-deps spmd_types==0.2.3)")
pytest.importorskip(
    "torchtitan.models.common.moe",
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro ...)",
)

pytestmark = pytest.mark.distributed

STEPS = 3
MICROBATCHES = 4
DIM = 16
HIDDEN = 16
EXPERTS = 4  # 2 per rank
TOP_K = 2
BATCH = 2
SEQUENCE = 6  # a microbatch is BATCH x SEQUENCE tokens


class _GlooAllToAll:
    """``torch.distributed`` for spmd_types, with ``all_to_all`` (lists of tensors; gloo's takes equal sizes only) run
    as gloo's ``all_to_all_single`` over the concatenated chunks, their sizes (on dim 0) the split sizes. Records the
    thread that ran each all_to_all."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        assert not async_op
        self.threads.append(threading.current_thread().name)
        output_splits = [t.shape[0] for t in output_tensor_list]
        inputs = torch.cat(input_tensor_list)
        output = inputs.new_empty((sum(output_splits), *inputs.shape[1:]))
        dist.all_to_all_single(
            output,
            inputs,
            output_split_sizes=output_splits,
            input_split_sizes=[t.shape[0] for t in input_tensor_list],
            group=group,
        )
        for out, chunk in zip(output_tensor_list, output.split(output_splits), strict=True):
            out.copy_(chunk)


_DIST = _GlooAllToAll()


def _torchtitan_on_cpu():
    """The stand-ins of the module's docstring; returns torchtitan's ParallelDims with its meshes built."""
    import spmd_types._dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" c10d backend
    from torchtitan.distributed import parallel_dims as titan_parallel_dims

    titan_parallel_dims.device_type = "cpu"
    spmd_types._dist.set_dist(_DIST)
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=dist.get_world_size()
    )
    dims.build_mesh()
    return dims


def _moe(parallel_dims) -> nn.Module:
    import spmd_types as spmd
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    def normal(param):
        nn.init.normal_(param, std=0.2)

    config = MoE.Config(
        num_experts=EXPERTS,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(
                dim=DIM,
                hidden_dim=HIDDEN,
                num_experts=EXPERTS,
                param_init={"w1_EFD": normal, "w2_EDF": normal, "w3_EFD": normal},
            ),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
        load_balance_coeff=None,
    )
    set_moe_sharding_config(
        config,
        enable_ep=True,
        enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    moe = config.build()
    moe.init_states()
    moe.parallelize(parallel_dims)
    assert isinstance(moe.routed_experts.token_dispatcher, AllToAllTokenDispatcher)
    assert moe.routed_experts.token_dispatcher.ep_mesh is not None
    return moe


class TitanModel(nn.Module):
    """Linear, dropout, torchtitan's MoE with a residual, a head."""

    def __init__(self, parallel_dims) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.25), nn.Tanh())
        self.moe = _moe(parallel_dims)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(tokens)
        return self.head(self.moe(hidden) + hidden).square().mean()


def _record_thread(loss: torch.Tensor, threads: list[str]) -> None:
    """Which thread ran the microbatch's backward: its first node's hook appends the thread's name."""
    loss.register_hook(lambda grad: threads.append(threading.current_thread().name) or grad)


def _all_to_all_nodes(loss: torch.Tensor) -> int:
    """How many ``_AllToAllUneven`` backward nodes the loss's graph holds (dispatch's and combine's)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(type(node).__name__ == "_AllToAllUnevenBackward" for node in seen)


def _record_splits(model: nn.Module, splits: list) -> None:
    """Each forward's dispatch all_to_all-v input and output split sizes, on this rank."""
    dispatcher = model.moe.routed_experts.token_dispatcher
    dispatch = dispatcher.dispatch

    def recording(*args, **kwargs):
        routed, counts, metadata = dispatch(*args, **kwargs)
        splits.append((tuple(metadata.input_splits), tuple(metadata.output_splits)))
        return routed, counts, metadata

    dispatcher.dispatch = recording


def _train(parallel_dims, rank: int, overlapped: bool, rule: str = "after_backward_collectives") -> dict:
    from torchtitan.distributed.utils import get_spmd_context

    torch.manual_seed(0)  # the same weights on both ranks (each keeps its experts' shard), in both runs
    model = TitanModel(parallel_dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    result: dict = {"losses": [], "grads": [], "threads": [], "splits": [], "nodes": []}
    _record_splits(model, result["splits"])
    _DIST.threads.clear()
    with get_spmd_context(parallel_dims=parallel_dims)():
        for step in range(STEPS):
            torch.manual_seed(1000 * step + rank)  # the data, then dropout's draws, in forward order
            batches = [torch.randn(BATCH, SEQUENCE, DIM) for _ in range(MICROBATCHES)]
            with torch_ext.overlap_microbatches(rule) if overlapped else contextlib.nullcontext() as overlap:
                for tokens in batches:
                    loss = model(tokens) / MICROBATCHES
                    result["losses"].append(loss.detach())
                    _record_thread(loss, result["threads"])
                    result["nodes"].append(_all_to_all_nodes(loss))
                    if overlapped:
                        overlap.backward(loss)
                    else:
                        loss.backward()
            result["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
    result["all_to_all_calls"] = list(_DIST.threads)
    _DIST.threads.clear()
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    result["shapes"] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return result


def _run_torchtitan(rank: int) -> dict:
    from spmd_types._collectives import _AllToAllUneven

    parallel_dims = _torchtitan_on_cpu()
    torch_ext.run_in_lane(_AllToAllUneven, group_of=lambda ctx: ctx.axis)
    return {
        "stock": _train(parallel_dims, rank, overlapped=False),
        "overlap": _train(parallel_dims, rank, overlapped=True),
        # The backward's all_to_all-v on the ep group's twin, beside the forward's.
        "overlap_twins": _train(parallel_dims, rank, overlapped=True, rule="beside_backward_collectives"),
    }


@pytest.fixture(scope="module")
def torchtitan_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run_torchtitan, tmp_path_factory.mktemp("overlap_torchtitan"))


def test_torchtitan_moe_bits_equal_stocks(torchtitan_results):
    """Stock's bits; every backward handed over; each backward's two all_to_all-v ran on a lane, off the caller's and
    the backward thread."""
    calls = STEPS * MICROBATCHES
    for rank, result in enumerate(torchtitan_results):
        stock, overlap = result["stock"], result["overlap"]
        assert stock["shapes"]["moe.routed_experts.inner_experts.w1_EFD"] == (EXPERTS // 2, HIDDEN, DIM)
        for variant in ("overlap", "overlap_twins"):
            for what in ("losses", "grads", "params"):
                assert_identical(result[variant][what], stock[what], f"rank {rank} {variant} {what}")
        assert stock["threads"] == ["MainThread"] * calls, (rank, stock["threads"])
        assert overlap["threads"] == ["torch_ext-microbatch-backward"] * calls, (rank, overlap["threads"])
        # The real dispatcher: dispatch and combine through _AllToAllUneven, all_to_all-v with uneven splits.
        assert stock["nodes"] == overlap["nodes"] == [2] * calls, rank
        assert stock["splits"] == overlap["splits"], rank
        assert any(len(set(splits)) > 1 for splits, _ in stock["splits"]), (rank, stock["splits"])
        # Forward: the count exchange, dispatch and combine; backward: dispatch's and combine's reverse.
        assert stock["all_to_all_calls"] == ["MainThread"] * (5 * calls), rank
        on_main = [name for name in overlap["all_to_all_calls"] if name == "MainThread"]
        elsewhere = [name for name in overlap["all_to_all_calls"] if name != "MainThread"]
        assert len(on_main) == 3 * calls and len(elsewhere) == 2 * calls, (rank, overlap["all_to_all_calls"])
        assert "torch_ext-microbatch-backward" not in elsewhere, (rank, elsewhere)
