"""Models that torch_ext's tests, benchmarks and tools build, in one place.

The TorchRec DLRM sharded table-wise over the ranks of the default process group (tests/distributed/test_torchrec.py,
tests/distributed/test_verify_distributed.py, benchmarks/recsys_torchrec.py). TorchRec is imported only when one is
built. ``SyncAllToAll``, a synchronous all_to_all as Megatron-core writes it (tests/distributed/test_collective_order.py,
tools/clean_exit_repro.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def sharded_dlrm(
    *,
    tables: int,
    rows: int,
    dim: int,
    dense_features: int,
    dense_layer_sizes: Sequence[int],
    over_layer_sizes: Sequence[int],
    learning_rate: float,
    world_size: int,
    data_parallel: bool = True,
) -> torch.nn.Module:
    """A DLRM whose EmbeddingBagCollection (``tables`` tables ``t0``... of ``rows`` x ``dim``, feature ``f<i>`` each)
    is sharded table-wise over the default group's ranks by DistributedModelParallel, with the fused CPU kernel
    (EXACT_SGD at ``learning_rate``: the tables are updated inside backward). ``dense_layer_sizes`` ends in ``dim``.
    Its dense parameters start from seed 0 on every rank; with ``data_parallel`` DistributedModelParallel wraps them
    in DistributedDataParallel."""
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    configs = [
        torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(tables)
    ]
    model = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        dense_in_features=dense_features,
        dense_arch_layer_sizes=list(dense_layer_sizes),
        over_arch_layer_sizes=list(over_layer_sizes),
        dense_device=torch.device("cpu"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": learning_rate}
    )
    constraints = {
        config.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for config in configs
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=data_parallel
    )


def dlrm_batch(
    *,
    seed: int,
    batch: int,
    dense_features: int,
    tables: int,
    rows: int,
    ids_per_bag: tuple[int, int],
) -> tuple[torch.Tensor, object, torch.Tensor]:
    """``(dense, sparse, labels)`` for :func:`sharded_dlrm`, drawn from ``seed``: ``batch`` rows of dense features,
    a KeyedJaggedTensor with ``ids_per_bag`` (low, high exclusive) ids in each bag of each table's feature, and
    0/1 labels."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dense_features, generator=generator)
    lengths = torch.randint(*ids_per_bag, (tables * batch,), generator=generator)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=generator)
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths)
    labels = torch.randint(0, 2, (batch,), generator=generator).float()
    return dense, sparse, labels


class SyncAllToAll(torch.autograd.Function):
    """Megatron-core's ``_AllToAll`` in miniature: forward doubles ``x``; backward exchanges the gradient with an
    ``all_to_all_single`` over the default group, synchronously, inside its node (``ctx.group``, as Megatron-core
    and DeepSpeed save it: what ``torch_ext.run_in_lane`` reads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.group = dist.group.WORLD
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return received
