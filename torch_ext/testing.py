"""What torch_ext's tests, benchmarks and tools compare with and build, in one place.

:func:`assert_identical` (and :func:`identity_difference`, its message or None): the one test of "the same result"
that torch_ext's tests hold the engine to, bit for bit, dtype, shape and strides included, NaNs equal where both hold
them. ``torch_ext.verify`` compares by the same rule (``_elements_differ`` and :func:`identity_difference`).

The TorchRec DLRM sharded table-wise over the ranks of the default process group (tests/distributed/test_torchrec.py,
tests/distributed/test_verify_distributed.py, benchmarks/recsys_torchrec). TorchRec is imported only when one is
built. ``SyncAllToAll``, a synchronous all_to_all as Megatron-core writes it (tests/distributed/test_collective_order.py,
tools/clean_exit_repro.py).
"""

from __future__ import annotations

import cmath
import struct
from collections.abc import Mapping, Sequence

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


# An integer dtype of each floating point element size: a float tensor viewed as it shows its bits.
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where two floating point tensors of one dtype and shape hold different bits (-0.0 is not 0.0 here)."""
    if actual.is_complex():
        return _bits_differ(torch.view_as_real(actual), torch.view_as_real(expected)).any(-1)
    bits = _BITS_OF_SIZE[actual.element_size()]
    return actual.view(bits) != expected.view(bits)


def _elements_differ(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where two strided tensors of one dtype and shape hold different elements: the rule of "the same" for every
    comparison torch_ext makes (:func:`identity_difference` and ``torch_ext.verify``). Floating point and complex
    elements are compared by their bits (-0.0 is not 0.0), except NaNs: a NaN equals any NaN, whatever its payload
    and sign. Other dtypes by ``!=``."""
    if not (actual.is_floating_point() or actual.is_complex()):
        return actual != expected
    # Why a NaN's payload does not count. IEEE 754 fixes every bit of an arithmetic result except a NaN's payload
    # and sign: which input NaN a result carries is left open (x86 passes on the first operand's when both are NaN,
    # CUDA returns one canonical NaN). So a + b and b + a, the same bits for every number, can differ in a NaN's
    # payload: it tells nothing about whether the engine computed what stock did, and "NaN where stock has NaN" is
    # what the same result means there. Python's floats and complex numbers follow the same rule (_number_bits). A
    # complex element is a NaN where either part is (Tensor.isnan).
    nan_actual, nan_expected = actual.isnan(), expected.isnan()
    return (nan_actual != nan_expected) | (~nan_actual & ~nan_expected & _bits_differ(actual, expected))


def _tensor_difference(actual: torch.Tensor, expected: torch.Tensor, compare_strides: bool) -> str | None:
    kind, expected_kind = (f"{t.dtype}{list(t.shape)} on {t.device}, {t.layout}" for t in (actual, expected))
    if kind != expected_kind:
        return f"{kind} != {expected_kind}"
    # Compared outside autograd: a parameter's bits are read through views that need no graph.
    actual, expected = actual.detach(), expected.detach()
    if actual.layout != torch.strided:
        # Sparse and other layouts: the values they stand for (they have no strides).
        actual, expected = actual.to_dense(), expected.to_dense()
    elif compare_strides and actual.stride() != expected.stride():
        return f"strides {actual.stride()} != {expected.stride()}"
    differ = _elements_differ(actual, expected)
    if not differ.any():
        return None
    positions = differ.nonzero()
    first = tuple(positions[0].tolist())
    message = (
        f"{len(positions)} of {actual.numel()} elements differ, first at {list(first)}: "
        f"{actual[first].item()!r} != {expected[first].item()!r}"
    )
    if actual.is_floating_point():
        finite = ~(actual.isnan() | expected.isnan())
        if finite.any():
            message += (
                f"; max abs difference {(actual[finite].double() - expected[finite].double()).abs().max().item()}"
            )
    return message


def _number_bits(value: complex) -> bytes:
    """A float's or a complex number's bits, every NaN the same (the rule of :func:`_elements_differ`)."""
    return b"nan" if cmath.isnan(value) else struct.pack("<dd", value.real, value.imag)


def identity_difference(actual, expected, *, compare_strides: bool = True) -> str | None:
    """None if ``actual`` is identical to ``expected`` (as :func:`assert_identical` says), else where and how the
    first difference lies: ``"[1]['w']: strides (1, 3) != (3, 1)"``."""
    if isinstance(expected, Mapping) or isinstance(actual, Mapping):
        if not (isinstance(expected, Mapping) and isinstance(actual, Mapping)):
            return f": {type(actual).__name__} != {type(expected).__name__}"
        if actual.keys() != expected.keys():
            missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
            return f": keys differ, missing {sorted(map(repr, missing))}, extra {sorted(map(repr, extra))}"
        for key, value in expected.items():
            difference = identity_difference(actual[key], value, compare_strides=compare_strides)
            if difference is not None:
                return f"[{key!r}]{difference}"
        return None
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if type(actual) is not type(expected):
            return f": {type(actual).__name__} != {type(expected).__name__}"
        if len(actual) != len(expected):
            return f": length {len(actual)} != {len(expected)}"
        for index, (ours, theirs) in enumerate(zip(actual, expected)):
            difference = identity_difference(ours, theirs, compare_strides=compare_strides)
            if difference is not None:
                return f"[{index}]{difference}"
        return None
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f": {type(actual).__name__} != {type(expected).__name__}"
        difference = _tensor_difference(actual, expected, compare_strides)
        return None if difference is None else f": {difference}"
    if type(actual) is not type(expected):
        return f": {type(actual).__name__} {actual!r} != {type(expected).__name__} {expected!r}"
    if isinstance(expected, (float, complex)):
        same = _number_bits(actual) == _number_bits(expected)
    else:
        same = actual == expected
    return None if same else f": {actual!r} != {expected!r}"


def assert_identical(actual, expected, where: str = "", *, compare_strides: bool = True) -> None:
    """Asserts ``actual`` is bit for bit ``expected``: what torch_ext's tests mean by "stock's result".

    - Tensors: the same dtype, shape, device, layout and strides, and the same bits in every element, but that NaNs
      count as equal to NaNs in the same places, whatever their payload (``torch.equal`` says NaN != NaN, and
      -0.0 == 0.0, which this does not). Sparse and other non-strided layouts compare their dense values.
      ``compare_strides=False`` leaves strides out: only for a layout stock itself does not fix, and the caller says
      why where it passes it.
    - None equals None only; lists and tuples are the same type and length, element by element; mappings have the
      same keys, value by value; anything else is the same type and ``==`` (floats and complex numbers by their bits,
      NaN equal to NaN).

    The message names ``where`` and the path to the first difference: ``"rank 0['grads'][1]: strides ..."``.
    """
    difference = identity_difference(actual, expected, compare_strides=compare_strides)
    if difference is not None:
        raise AssertionError(f"{where or 'result'}{difference}")
