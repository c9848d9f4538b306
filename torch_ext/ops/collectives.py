"""Collectives with autograd whose backward overlaps the rest of backward.

``all_to_all_single``, ``all_reduce``, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` on any
torch.distributed process group (gloo, NCCL). Each is a ``torch.library`` custom op
(``torch.ops.torch_ext.*``) with a fake kernel and an autograd formula, so opcheck and torch.compile
see an ordinary op.

What differs from PyTorch's functional collectives is backward. Their formulas (in 2.13) launch the
gradient collective and wait for it inside the same node, so the engine thread stands idle while the
bytes are on the wire. Here the formula launches the collective and returns at once; torch_ext's
engine waits on the result just before the first thing that reads it — the node it feeds, an
accumulation into the same gradient, or the end of backward. Together with the automatic priority
collectives get (see :mod:`torch_ext.priority`), the engine drives straight to the collective,
launches it, and runs the rest of backward while it is in flight. Under stock autograd, or when the
formula is traced by torch.compile, it waits in place as PyTorch's own formulas do.

Forward waits before returning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Imported now, not by the functional collectives' first call (through torch._dynamo): its functions'
# default group=group.WORLD binds the default group live at import, which then outlives
# destroy_process_group, and a live gloo group's threads can abort the interpreter's exit
# (tests/distributed/test_clean_exit.py). Imported before init_process_group, it binds None. ~3 ms.
import torch.distributed.nn
from torch import Tensor

from torch_ext._loader import _C
from torch_ext.collectives.roles import _declare_collective_op

# Reductions whose gradient is the same reduction of the gradients (sum) or its mean (avg).
_DIFFERENTIABLE_REDUCE_OPS = ("sum", "avg")


def _group_name(group, api: str) -> str:
    """The name c10d resolves a process group by (what the ops take, being schema-typed)."""
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"torch_ext.ops.{api}: no process group: call torch.distributed.init_process_group() "
                "first, or pass group="
            )
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"torch_ext.ops.{api}: group must be a torch.distributed.ProcessGroup, its name, or None for "
            f"the default group; got {type(group).__name__}"
        )
    return group.group_name


def _group_size(group_name: str) -> int:
    return dist.distributed_c10d._get_group_size_by_name(group_name)


def _reduce_op(reduce_op: str, api: str) -> str:
    op = str(reduce_op).lower()
    if op not in _DIFFERENTIABLE_REDUCE_OPS:
        raise ValueError(
            f"torch_ext.ops.{api}: reduce_op must be one of {_DIFFERENTIABLE_REDUCE_OPS} (the reductions "
            f"with a gradient), got {reduce_op!r}"
        )
    return op


def _wait_at_first_use(result: Tensor) -> Tensor:
    """Hands a collective's in-flight result to torch_ext's engine, or waits for it here."""
    if _C.defer_wait(result):
        return result
    return torch.ops._c10d_functional.wait_tensor(result)


def _wait(result: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(result)


# --- all_to_all_single -----------------------------------------------------------------------------


@torch.library.custom_op("torch_ext::all_to_all_single", mutates_args=())
def _all_to_all_single(
    input: Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str
) -> Tensor:
    return _wait(
        torch.ops._c10d_functional.all_to_all_single(
            input.contiguous(), output_split_sizes, input_split_sizes, group_name
        )
    )


@_all_to_all_single.register_fake
def _(input, output_split_sizes, input_split_sizes, group_name):
    return input.new_empty((sum(output_split_sizes), *input.shape[1:]))


def _all_to_all_single_setup(ctx, inputs, output):
    _, ctx.output_split_sizes, ctx.input_split_sizes, ctx.group_name = inputs


def _all_to_all_single_backward(ctx, grad):
    # The gradient goes back the way the data came: the split sizes swap.
    result = torch.ops._c10d_functional.all_to_all_single(
        grad.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes, ctx.group_name
    )
    return _wait_at_first_use(result), None, None, None


_all_to_all_single.register_autograd(_all_to_all_single_backward, setup_context=_all_to_all_single_setup)
_declare_collective_op(torch.ops.torch_ext.all_to_all_single.default, defers_wait=True)


def all_to_all_single(
    input: Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
) -> Tensor:
    """Splits ``input`` along dim 0, sends split ``i`` to rank ``i``, and concatenates what arrives.

    Args:
        input: the tensor to scatter; split along dim 0.
        output_split_sizes: rows received from each rank; with ``input_split_sizes`` None, equal splits.
        input_split_sizes: rows sent to each rank; must sum to ``input.shape[0]``.
        group: a ProcessGroup, its name, or None for the default group.

    Returns a new tensor of ``sum(output_split_sizes)`` rows. Its backward is an all_to_all of the
    gradient with the split sizes swapped, launched early and waited on at first use.
    """
    name = _group_name(group, "all_to_all_single")
    world = _group_size(name)
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError(
            "torch_ext.ops.all_to_all_single: give both output_split_sizes and input_split_sizes, or neither "
            "for equal splits"
        )
    if input.dim() == 0:
        raise ValueError("torch_ext.ops.all_to_all_single: input must have at least one dimension")
    if input_split_sizes is None:
        if input.shape[0] % world != 0:
            raise ValueError(
                f"torch_ext.ops.all_to_all_single: equal splits need input.shape[0] ({input.shape[0]}) "
                f"divisible by the group size ({world})"
            )
        input_split_sizes = output_split_sizes = [input.shape[0] // world] * world
    for what, sizes in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if len(sizes) != world:
            raise ValueError(
                f"torch_ext.ops.all_to_all_single: {what} has {len(sizes)} entries, the group has {world} ranks"
            )
        if any(size < 0 for size in sizes):
            raise ValueError(f"torch_ext.ops.all_to_all_single: {what} has a negative size: {list(sizes)}")
    if sum(input_split_sizes) != input.shape[0]:
        raise ValueError(
            f"torch_ext.ops.all_to_all_single: input_split_sizes sum to {sum(input_split_sizes)}, "
            f"but input has {input.shape[0]} rows"
        )
    return _all_to_all_single(input, list(output_split_sizes), list(input_split_sizes), name)


# --- all_reduce -------------------------------------------------------------------------------------


@torch.library.custom_op("torch_ext::all_reduce", mutates_args=())
def _all_reduce(input: Tensor, reduce_op: str, group_name: str) -> Tensor:
    return _wait(torch.ops._c10d_functional.all_reduce(input.contiguous(), reduce_op, group_name))


@_all_reduce.register_fake
def _(input, reduce_op, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output):
    _, ctx.reduce_op, ctx.group_name = inputs


def _all_reduce_backward(ctx, grad):
    # Every rank's output is the reduction of every rank's input, so each input's gradient is the
    # same reduction of every rank's output gradient.
    result = torch.ops._c10d_functional.all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name)
    return _wait_at_first_use(result), None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)
_declare_collective_op(torch.ops.torch_ext.all_reduce.default, defers_wait=True)


def all_reduce(input: Tensor, reduce_op: str = "sum", group=None) -> Tensor:
    """Returns the reduction (``"sum"`` or ``"avg"``) of ``input`` over the group, as a new tensor.

    Unlike ``torch.distributed.all_reduce`` it does not modify ``input``. Backward all-reduces the
    gradient the same way, launched early and waited on at first use.
    """
    return _all_reduce(input, _reduce_op(reduce_op, "all_reduce"), _group_name(group, "all_reduce"))


# --- all_reduce_coalesced: a bucket of tensors, one collective ----------------------------------------


def _kernels():
    # torch_ext.kernels costs ~2 s to import (triton_op imports torch._inductor); only buckets need it.
    from torch_ext import kernels

    return kernels


@torch.library.custom_op("torch_ext::all_reduce_coalesced", mutates_args=())
def _all_reduce_coalesced(inputs: list[Tensor], reduce_op: str, group_name: str) -> list[Tensor]:
    kernels = _kernels()
    reduced = _wait(torch.ops._c10d_functional.all_reduce(kernels.pack(inputs), reduce_op, group_name))
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
    kernels.unpack_(reduced, outputs)
    return outputs


@_all_reduce_coalesced.register_fake
def _(inputs, reduce_op, group_name):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]


def _all_reduce_coalesced_setup(ctx, inputs, output):
    tensors, ctx.reduce_op, ctx.group_name = inputs
    ctx.shapes = [t.shape for t in tensors]
    ctx.dtype, ctx.device = tensors[0].dtype, tensors[0].device


def _all_reduce_coalesced_backward(ctx, grads):
    grads = [
        grad if grad is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
        for grad, shape in zip(grads, ctx.shapes, strict=True)
    ]
    # One packed buffer, one collective; the gradients are views of its result, so nothing has to
    # read the result before the engine's wait at first use (unpacking into copies would).
    result = torch.ops._c10d_functional.all_reduce(_kernels().pack(grads), ctx.reduce_op, ctx.group_name)
    pieces = [
        piece.view(shape)
        for piece, shape in zip(result.split([shape.numel() for shape in ctx.shapes]), ctx.shapes, strict=True)
    ]
    # c10d finds a collective's work by the storage, so waiting on any piece waits for the bucket;
    # the engine defers all pieces or (same node, same conditions) none.
    if not pieces or not _C.defer_wait(pieces[0]):
        _wait(result)
    else:
        for piece in pieces[1:]:
            _C.defer_wait(piece)
    return pieces, None, None


_all_reduce_coalesced.register_autograd(_all_reduce_coalesced_backward, setup_context=_all_reduce_coalesced_setup)
_declare_collective_op(torch.ops.torch_ext.all_reduce_coalesced.default, defers_wait=True)


# What torch_ext.kernels.pack/unpack take.
_BUCKET_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def all_reduce_coalesced(inputs: list[Tensor], reduce_op: str = "sum", group=None) -> list[Tensor]:
    """All-reduces a bucket of tensors with one collective: packs them into one buffer, reduces it and
    returns the reduced tensors (new tensors; the inputs are not modified).

    The tensors must share a dtype (float32, float16 or bfloat16) and a device. Packing and unpacking
    use :mod:`torch_ext.kernels` (one Triton launch each on CUDA). Backward packs the gradients,
    launches one all_reduce and returns views of its result, waited on at first use.
    """
    op = _reduce_op(reduce_op, "all_reduce_coalesced")
    name = _group_name(group, "all_reduce_coalesced")
    inputs = list(inputs)
    if not inputs:
        raise ValueError("torch_ext.ops.all_reduce_coalesced: inputs is empty")
    first = inputs[0]
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"torch_ext.ops.all_reduce_coalesced: inputs[{index}] is a {type(tensor).__name__}")
        if tensor.dtype not in _BUCKET_DTYPES:
            raise ValueError(
                f"torch_ext.ops.all_reduce_coalesced: inputs[{index}] is {tensor.dtype}; a bucket holds "
                "float32, float16 or bfloat16 (the dtypes torch_ext.kernels packs)"
            )
        if (tensor.dtype, tensor.device) != (first.dtype, first.device):
            raise ValueError(
                f"torch_ext.ops.all_reduce_coalesced: inputs[{index}] is {tensor.dtype} on {tensor.device}, "
                f"inputs[0] {first.dtype} on {first.device}; a bucket holds one dtype on one device"
            )
    return _all_reduce_coalesced(inputs, op, name)


# --- reduce_scatter_tensor / all_gather_into_tensor --------------------------------------------------


@torch.library.custom_op("torch_ext::reduce_scatter_tensor", mutates_args=())
def _reduce_scatter_tensor(input: Tensor, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    return _wait(
        torch.ops._c10d_functional.reduce_scatter_tensor(input.contiguous(), reduce_op, group_size, group_name)
    )


@_reduce_scatter_tensor.register_fake
def _(input, reduce_op, group_size, group_name):
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


def _reduce_scatter_tensor_setup(ctx, inputs, output):
    _, ctx.reduce_op, ctx.group_size, ctx.group_name = inputs


def _reduce_scatter_tensor_backward(ctx, grad):
    result = torch.ops._c10d_functional.all_gather_into_tensor(grad.contiguous(), ctx.group_size, ctx.group_name)
    if ctx.reduce_op == "avg":
        # Waiting here is unavoidable: the scale reads the result.
        return _wait(result) / ctx.group_size, None, None, None
    return _wait_at_first_use(result), None, None, None


_reduce_scatter_tensor.register_autograd(_reduce_scatter_tensor_backward, setup_context=_reduce_scatter_tensor_setup)
_declare_collective_op(torch.ops.torch_ext.reduce_scatter_tensor.default, defers_wait=True)


def reduce_scatter_tensor(input: Tensor, reduce_op: str = "sum", group=None) -> Tensor:
    """Reduces ``input`` over the group and returns this rank's block of dim 0.

    ``input.shape[0]`` must be divisible by the group size; the result has ``input.shape[0] / size``
    rows. Backward all-gathers the gradient, launched early and waited on at first use.
    """
    op = _reduce_op(reduce_op, "reduce_scatter_tensor")
    name = _group_name(group, "reduce_scatter_tensor")
    world = _group_size(name)
    if input.dim() == 0 or input.shape[0] % world != 0:
        raise ValueError(
            f"torch_ext.ops.reduce_scatter_tensor: input.shape[0] must be divisible by the group size ({world}), "
            f"got shape {tuple(input.shape)}"
        )
    return _reduce_scatter_tensor(input, op, world, name)


@torch.library.custom_op("torch_ext::all_gather_into_tensor", mutates_args=())
def _all_gather_into_tensor(input: Tensor, group_size: int, group_name: str) -> Tensor:
    return _wait(torch.ops._c10d_functional.all_gather_into_tensor(input.contiguous(), group_size, group_name))


@_all_gather_into_tensor.register_fake
def _(input, group_size, group_name):
    return input.new_empty((input.shape[0] * group_size, *input.shape[1:]))


def _all_gather_into_tensor_setup(ctx, inputs, output):
    _, ctx.group_size, ctx.group_name = inputs


def _all_gather_into_tensor_backward(ctx, grad):
    result = torch.ops._c10d_functional.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    return _wait_at_first_use(result), None, None


_all_gather_into_tensor.register_autograd(_all_gather_into_tensor_backward, setup_context=_all_gather_into_tensor_setup)
_declare_collective_op(torch.ops.torch_ext.all_gather_into_tensor.default, defers_wait=True)


def all_gather_into_tensor(input: Tensor, group=None) -> Tensor:
    """Concatenates every rank's ``input`` along dim 0 (rank order). Backward reduce-scatters the gradient
    (sum), launched early and waited on at first use."""
    name = _group_name(group, "all_gather_into_tensor")
    if input.dim() == 0:
        raise ValueError("torch_ext.ops.all_gather_into_tensor: input must have at least one dimension")
    return _all_gather_into_tensor(input, _group_size(name), name)
