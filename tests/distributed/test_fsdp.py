"""FSDP2 (``fully_shard``) and FSDP1 train bit for bit as on stock when torch_ext's engine runs backward.

FSDP reads the current graph task while backward runs, which torch_ext's host task provides: FSDP2's
``is_bw()`` (``torch._C._current_graph_task_id() != -1``) keeps a module's forward hook, rerun by
activation checkpointing's recompute inside backward, from resharding its parameters; both FSDP2 and
FSDP1 finish backward in a final callback queued through ``Variable._execution_engine`` (the
reduce-scatter wait, resharding, and FSDP1's gradient bookkeeping). FSDP2 also runs its own autograd
Function nodes (``RegisterPostBackwardFunction``) and tensor hooks that all-gather parameters again.

Two gloo ranks on loopback train each model on the stock engine and then under
``torch_ext.enable()``, from the same initial parameters and the same per-rank data. After every
backward, every parameter's gradient must be equal, as the rank's local shard and as the full
tensor gathered from both ranks; so must the parameters after the last step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_identical

pytestmark = pytest.mark.distributed

STEPS = 3
# The profiler events FSDP2 and FSDP1 record around their own work.
_FSDP_EVENT_PREFIXES = ("FSDP::", "FullyShardedDataParallel.")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def shard_units(self) -> list[nn.Module]:
        """The submodules that get their own FSDP parameter group."""
        return [layer for layer in self.layers if isinstance(layer, nn.Linear)]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in backward."""

    def __init__(self, width: int, heads: int, use_reentrant: bool = False) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.block = Block(width, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


class TinyLM(nn.Module):
    VOCAB = 20
    WIDTH = 16

    def __init__(self, make_block: Callable[[int, int], nn.Module] = Block, checkpoint: str | None = None) -> None:
        """``checkpoint``: None, ``"each_block"`` or ``"all_blocks"`` (one region around the stack)."""
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(self.VOCAB, self.WIDTH)
        self.blocks = nn.ModuleList(make_block(self.WIDTH, 2) for _ in range(2))
        self.norm = nn.LayerNorm(self.WIDTH)
        self.head = nn.Linear(self.WIDTH, self.VOCAB)

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint == "each_block" else block(x)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = (
            checkpoint(self._run_blocks, x, use_reentrant=False)
            if self.checkpoint == "all_blocks"
            else self._run_blocks(x)
        )
        return self.head(self.norm(x))


def _regression_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def _token_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(TinyLM.VOCAB, (2, 7), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _fully_shard(model: nn.Module, mesh: DeviceMesh, **kwargs) -> nn.Module:
    """FSDP2 as its docs prescribe: each unit, then the root."""
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _fsdp1(model: nn.Module, mesh: DeviceMesh, **kwargs) -> nn.Module:
    unit_types = {type(unit) for unit in model.shard_units()}
    return FullyShardedDataParallel(
        model,
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy(unit_types),
        device_id=torch.device("cpu"),
        **kwargs,
    )


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


@dataclass(frozen=True)
class FsdpCase:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shard: Callable[[nn.Module, DeviceMesh], nn.Module]
    make_optimizer: Callable[..., torch.optim.Optimizer]
    # Gradient accumulation: every micro-batch of a step but the last runs without gradient sync
    # (FSDP2's set_requires_gradient_sync(False), FSDP1's no_sync()).
    micro_batches: int = 1


# Each rank runs every case, in this order, in one process group.
CASES = {
    # Parameters are resharded after forward, so each layer's pre-backward hook all-gathers them again.
    "fsdp2_mlp_sgd": FsdpCase(MLP, _regression_batch, F.mse_loss, _fully_shard, _sgd),
    "fsdp2_mlp_no_reshard_adam": FsdpCase(
        MLP, _regression_batch, F.mse_loss, functools.partial(_fully_shard, reshard_after_forward=False), _adam
    ),
    "fsdp2_transformer_adam": FsdpCase(TinyLM, _token_batch, _next_token_loss, _fully_shard, _adam),
    # Unsynced micro-batches accumulate unsharded gradients inside FSDP; the synced one
    # reduce-scatters their sum.
    "fsdp2_transformer_grad_accumulation": FsdpCase(
        TinyLM, _token_batch, _next_token_loss, _fully_shard, _adam, micro_batches=2
    ),
    # checkpoint(fully_shard(block)): the recompute in backward reruns the block's FSDP forward
    # hooks, after its pre-backward hook has unsharded its parameters.
    "fsdp2_checkpoint_each_sharded_block": FsdpCase(
        functools.partial(TinyLM, checkpoint="each_block"), _token_batch, _next_token_loss, _fully_shard, _adam
    ),
    # One checkpoint around all the sharded blocks: the recompute, triggered from the last block's
    # backward, runs the earlier blocks' forward hooks before their pre-backward hooks. Only
    # is_bw() (a current graph task) keeps those hooks from resharding and all-gathering again.
    "fsdp2_checkpoint_around_sharded_blocks": FsdpCase(
        functools.partial(TinyLM, checkpoint="all_blocks"), _token_batch, _next_token_loss, _fully_shard, _adam
    ),
    # fully_shard(checkpointed block): FSDP's hooks sit outside the recomputed region.
    "fsdp2_sharded_checkpointed_blocks": FsdpCase(
        functools.partial(TinyLM, make_block=CheckpointedBlock), _token_batch, _next_token_loss, _fully_shard, _adam
    ),
    # Reentrant checkpoint: each block's backward is a nested backward pass inside a node, on
    # torch_ext's engine too when it is enabled.
    "fsdp2_sharded_reentrant_checkpointed_blocks": FsdpCase(
        functools.partial(TinyLM, make_block=functools.partial(CheckpointedBlock, use_reentrant=True)),
        _token_batch,
        _next_token_loss,
        _fully_shard,
        _adam,
    ),
    # bf16 compute (cast nodes between the sharded fp32 parameters and the blocks), fp32 reduction.
    "fsdp2_mixed_precision_bf16": FsdpCase(
        TinyLM,
        _token_batch,
        _next_token_loss,
        functools.partial(
            _fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ),
        _adam,
    ),
    "fsdp1_mlp_adam": FsdpCase(MLP, _regression_batch, F.mse_loss, _fsdp1, _adam),
    "fsdp1_transformer_shard_grad_op_no_sync": FsdpCase(
        TinyLM,
        _token_batch,
        _next_token_loss,
        functools.partial(_fsdp1, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
        _sgd,
        micro_batches=2,
    ),
}


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def _local_and_full(tensor: torch.Tensor | None, gather: bool) -> dict | None:
    if tensor is None:
        return None
    assert isinstance(tensor, DTensor), f"FSDP2 left a {type(tensor).__name__}, not a DTensor"
    return {"local": tensor.to_local().clone(), "full": tensor.full_tensor() if gather else None}


def _snapshot(model: nn.Module, of_grads: bool, gather: bool = True) -> dict:
    """Every parameter (or its gradient) as this rank's shard and, if ``gather``, as the full tensor."""
    if isinstance(model, FSDPModule):
        return {
            name: _local_and_full(param.grad if of_grads else param, gather) for name, param in model.named_parameters()
        }
    # FSDP1 with use_orig_params: each parameter is a view of this rank's piece of a flat parameter
    # (possibly empty); summon_full_params gathers the full ones, under names without FSDP's prefixes.
    names = [name for name, _ in model.named_parameters()]
    local = [_clone(param.grad if of_grads else param) for param in model.parameters()]
    full = [None] * len(local)
    if gather:
        with FullyShardedDataParallel.summon_full_params(model, with_grads=of_grads):
            full = [_clone(param.grad if of_grads else param) for param in model.parameters()]
    return {
        name: {"local": local_tensor, "full": full_tensor}
        for name, local_tensor, full_tensor in zip(names, local, full, strict=True)
    }


def _gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


def _train(case: FsdpCase, rank: int, on_torch_ext: bool, mesh: DeviceMesh) -> dict:
    """One record per backward, in order: its loss, FSDP's profiler events in it and every gradient
    after it; then the parameters."""
    torch.manual_seed(0)
    model = case.shard(case.make_model(), mesh)
    optimizer = case.make_optimizer(model.parameters())
    grads, losses, fsdp_events = [], [], []
    driver_ran = None
    with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
        for step in range(STEPS):
            optimizer.zero_grad()
            for micro_batch in range(case.micro_batches):
                # Different data on each rank, the same on both engines.
                seed = 1000 * rank + case.micro_batches * step + micro_batch
                inputs, target = case.make_batch(torch.Generator().manual_seed(seed))
                sync = micro_batch == case.micro_batches - 1
                with _gradient_sync(model, sync):
                    loss = case.loss_fn(model(inputs), target)
                    events = profiled_backward(loss)
                if driver_ran is None:
                    driver_ran = ran_on_torch_ext(events)
                # What FSDP did in backward (hooks, all-gathers, prefetches, reduce-scatters), in
                # order. Some of it leaves no trace in the numbers: an AC recompute that took
                # itself for a forward would reshard and all-gather again, to the same values.
                fsdp_events.append([event.name for event in events if event.name.startswith(_FSDP_EVENT_PREFIXES)])
                losses.append(loss.item())
                # Gradients left unsharded by FSDP1's no_sync() cannot be gathered (summon_full_params
                # asserts that they are sharded, on stock too).
                grads.append(_snapshot(model, of_grads=True, gather=sync))
            optimizer.step()
    return {
        "grads": grads,
        "params": _snapshot(model, of_grads=False),
        "losses": losses,
        "fsdp_events": fsdp_events,
        "driver_ran": driver_ran,
    }


def _train_every_case(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    return train_on_both_engines(CASES, functools.partial(_train, mesh=mesh), rank)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> list[dict]:
    """Each rank's results: {case name: {"stock": ..., "torch_ext": ...}}."""
    # Measured 25-60 s on 2 cores, depending on what else competes for them.
    return run_ranks(_train_every_case, tmp_path_factory.mktemp("fsdp"), timeout_s=240)


@pytest.mark.parametrize("case_name", list(CASES))
def test_fsdp_training_matches_stock(case_name, fsdp_results):
    assert_torch_ext_matches_stock(fsdp_results, case_name)

    # The model really was sharded and trained together: the ranks saw different data, hold
    # different shards, and gather the same full parameters.
    first, second = (result[case_name]["torch_ext"] for result in fsdp_results)
    assert first["losses"] != second["losses"]
    assert any(
        not torch.equal(first["params"][name]["local"], second["params"][name]["local"]) for name in first["params"]
    )
    for name, param in first["params"].items():
        assert_identical(second["params"][name]["full"], param["full"], f"final {name} on rank 1 vs rank 0")
