"""Multi-tensor gradient ops: accumulate, N-way sum, pack and unpack, each over a whole list in one launch.

The engine's own GPU work is gradient plumbing over hundreds of small tensors per step, where the number
of launches, not bandwidth, sets the cost. These ops are registered in the ``torch_ext`` namespace:

- ``torch_ext::multi_tensor_accumulate_(Tensor(a!)[] dsts, Tensor[] srcs, float alpha=1.) -> ()``
- ``torch_ext::sum_n(Tensor[] tensors) -> Tensor``
- ``torch_ext::pack(Tensor[] tensors, float scale=1., ScalarType? dtype=None) -> Tensor``
- ``torch_ext::unpack_(Tensor flat, Tensor(a!)[] outs, float scale=1.) -> ()``

Arithmetic is in fp32 whatever the storage dtype (float32, float16, bfloat16), rounded once to the
destination dtype. On CUDA they run the Triton kernels of triton_kernels/multi_tensor.py (installed as
torch_ext._triton_kernels), one launch per dtype combination in the list; on CPU, and on CUDA with
``set_triton_enabled(False)`` or ``TORCH_EXT_TRITON=off`` in the environment, or without triton installed,
the plain-torch references of triton_kernels/multi_tensor_ref.py (torch foreach ops and copies).
Non-contiguous tensors give the same results on every path: on CUDA they are copied to contiguous ones when
read-only, and handed to the reference when written.

Under torch.compile (and any other tracing) the ops decompose into the references, which Inductor fuses
itself: the kernels address tensors through a table of runtime addresses, which a traced graph cannot
express. Importing this module does not need triton.
"""

import contextlib
import functools
import importlib
import importlib.util
import itertools
import logging
from collections.abc import Sequence
from types import ModuleType

import torch
from torch.library import triton_op, wrap_triton

from torch_ext._api import Undo
from torch_ext._loader import TRITON_VARIABLE, switch_on
from torch_ext._triton_kernels.multi_tensor_ref import (
    SUPPORTED_DTYPES,
    accumulate_ref_,
    pack_ref,
    sum_n_ref,
    unpack_ref_,
)

__all__ = ["is_triton_enabled", "multi_tensor_accumulate_", "pack", "set_triton_enabled", "sum_n", "unpack_"]

_use_triton = switch_on(TRITON_VARIABLE)

# Device types whose tensors the Triton kernels take. Tests add "cpu" to run the CUDA path of the ops
# through Triton's interpreter.
_TRITON_DEVICE_TYPES = ("cuda",)


def set_triton_enabled(enabled: bool) -> Undo:
    """Turns the Triton kernels on or off for CUDA tensors (off: the torch references run), process-wide;
    ``with`` limits it to a block. The default is on unless ``TORCH_EXT_TRITON=off`` (or ``0``) is in the
    environment."""
    global _use_triton
    previous, _use_triton = _use_triton, bool(enabled)
    return Undo(f"kernels.set_triton_enabled({bool(enabled)})", functools.partial(_set_use_triton, previous))


def _set_use_triton(enabled: bool) -> None:
    global _use_triton
    _use_triton = enabled


def is_triton_enabled() -> bool:
    """Whether CUDA tensors go to the Triton kernels (:func:`set_triton_enabled`); False also when triton is not
    installed."""
    return _use_triton and _multi_tensor_kernels() is not None


def multi_tensor_accumulate_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """``dsts[i] += alpha * srcs[i]`` for every i, in place, in one launch on CUDA.

    dsts[i] and srcs[i] have the same shape; their dtypes may differ (say fp32 gradients accumulating
    bf16 ones), each of float32, float16, bfloat16. All tensors on one device; dsts must not overlap
    each other or srcs. Lists may be empty, tensors zero-size.
    """
    torch.ops.torch_ext.multi_tensor_accumulate_(list(dsts), list(srcs), alpha)


def sum_n(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors[0] + tensors[1] + ...`` (in that order, in fp32) as a new contiguous tensor.

    At least one tensor; all of one shape, one dtype (float32, float16 or bfloat16) and one device.
    """
    return torch.ops.torch_ext.sum_n(list(tensors))


def pack(tensors: Sequence[torch.Tensor], scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new 1-D tensor of ``dtype`` holding ``scale * tensors[i]``, each flattened, one after another.

    ``dtype`` defaults to the tensors' dtype, which must then be the same for all; any of float32,
    float16, bfloat16 (tensors may mix them when ``dtype`` is given). The result has
    ``sum(t.numel() for t in tensors)`` elements; an empty list gives an empty CPU tensor (float32
    unless ``dtype`` says otherwise). ``unpack_`` is the inverse.
    """
    return torch.ops.torch_ext.pack(list(tensors), scale, dtype)


def unpack_(flat: torch.Tensor, outs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Writes ``scale * flat[offset_i : offset_i + outs[i].numel()]`` into each ``outs[i]``, reshaped to it;
    offset_i is the total size of the outs before it.

    ``flat`` is 1-D with exactly ``sum(o.numel() for o in outs)`` elements; outs may be views (a
    parameter's ``.grad``, slices of a larger buffer) and of any of float32, float16, bfloat16, cast from
    flat's dtype. Outs must not overlap each other or flat.
    """
    torch.ops.torch_ext.unpack_(flat, list(outs), scale)


# Argument checks, shared by the CPU, device and fake implementations, so every path raises the same errors.


# Each check compares whole lists first and looks for the culprit only on failure: with hundreds of
# tensors, a per-tensor loop of checks cost about as much as the launches these ops save (1 ms for 500
# pairs here).

_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _check_dtypes(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    if {t.dtype for t in tensors} <= _SUPPORTED:
        return
    i, tensor = next((i, t) for i, t in enumerate(tensors) if t.dtype not in _SUPPORTED)
    supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    raise ValueError(f"{op}: {name}[{i}] has dtype {tensor.dtype}; supported: {supported}")


def _check_one_device(op: str, *groups: tuple[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
    """All tensors of all groups on one device; the culprit is named ``name[i]``, or ``name`` for a bare tensor."""
    lists = [[tensors] if isinstance(tensors, torch.Tensor) else tensors for _, tensors in groups]
    if len({t.device for tensors in lists for t in tensors}) <= 1:
        return
    named = [
        (name if isinstance(tensors, torch.Tensor) else f"{name}[{i}]", t)
        for (name, tensors), ts in zip(groups, lists)
        for i, t in enumerate(ts)
    ]
    first_name, first = named[0]
    name, tensor = next((n, t) for n, t in named if t.device != first.device)
    raise ValueError(f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}")


def _check_accumulate(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    op = "multi_tensor_accumulate_"
    if len(dsts) != len(srcs):
        raise ValueError(f"{op}: got {len(dsts)} dsts and {len(srcs)} srcs; they pair up one to one")
    if [d.shape for d in dsts] != [s.shape for s in srcs]:
        i, dst, src = next((i, d, s) for i, (d, s) in enumerate(zip(dsts, srcs)) if d.shape != s.shape)
        raise ValueError(f"{op}: dsts[{i}] has shape {tuple(dst.shape)} but srcs[{i}] has {tuple(src.shape)}")
    _check_dtypes(op, "dsts", dsts)
    _check_dtypes(op, "srcs", srcs)
    _check_one_device(op, ("dsts", dsts), ("srcs", srcs))


def _check_sum_n(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("sum_n: needs at least one tensor (the result's shape, dtype and device come from them)")
    first = tensors[0]
    _check_dtypes("sum_n", "tensors", tensors[:1])
    for i, tensor in enumerate(tensors[1:], start=1):
        if tensor.shape != first.shape:
            raise ValueError(
                f"sum_n: tensors[{i}] has shape {tuple(tensor.shape)} but tensors[0] has {tuple(first.shape)}"
            )
        if tensor.dtype != first.dtype:
            raise ValueError(f"sum_n: tensors[{i}] has dtype {tensor.dtype} but tensors[0] has {first.dtype}")
    _check_one_device("sum_n", ("tensors", tensors))


def _check_pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _SUPPORTED:
        raise ValueError(f"pack: dtype {dtype} is not supported; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    _check_dtypes("pack", "tensors", tensors)
    if dtype is None and len({t.dtype for t in tensors}) > 1:
        i, tensor = next((i, t) for i, t in enumerate(tensors) if t.dtype != tensors[0].dtype)
        raise ValueError(
            f"pack: tensors[{i}] has dtype {tensor.dtype} but tensors[0] has {tensors[0].dtype}; "
            "pass dtype= to pack tensors of several dtypes"
        )
    _check_one_device("pack", ("tensors", tensors))


def _check_unpack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    if flat.dim() != 1:
        raise ValueError(f"unpack_: flat must be 1-D, got shape {tuple(flat.shape)}")
    if flat.dtype not in _SUPPORTED:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"unpack_: flat has dtype {flat.dtype}; supported: {supported}")
    _check_dtypes("unpack_", "outs", outs)
    total = sum(out.numel() for out in outs)
    if flat.numel() != total:
        raise ValueError(f"unpack_: flat has {flat.numel()} elements but the outs hold {total}")
    _check_one_device("unpack_", ("flat", flat), ("outs", outs))


# Device implementations: the body of each triton_op, run for every device without its own kernel (CUDA),
# for calls without tensors, and, with fake or functional tensors, under tracing.


def _multi_tensor_kernels() -> ModuleType | None:
    """torch_ext._triton_kernels.multi_tensor, imported on first use; None when triton is not installed."""
    try:
        return importlib.import_module("torch_ext._triton_kernels.multi_tensor")
    except ImportError:
        return None


def _kernels_for(tensors: Sequence[torch.Tensor]) -> ModuleType | None:
    """The kernel module when ``tensors`` should go to Triton, else None (run the reference)."""
    if not _use_triton or not tensors or tensors[0].device.type not in _TRITON_DEVICE_TYPES:
        return None
    # Fake and functional tensors (tracing, torch.compile) have no addresses to put in a kernel's table.
    # Tracing wraps every tensor of a call, so the first tells.
    first = tensors[0]
    if type(first) not in (torch.Tensor, torch.nn.Parameter) or torch._is_functional_tensor(first):
        return None
    return _multi_tensor_kernels()


def _launch(launches: list) -> None:
    for launch in launches:
        # Triton launches on the current device's current stream.
        device = launch.addressed[0].device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            wrap_triton(launch.kernel)[launch.grid](**launch.kwargs)


def _multi_tensor_accumulate_on_device(dsts: list[torch.Tensor], srcs: list[torch.Tensor], alpha: float = 1.0) -> None:
    _check_accumulate(dsts, srcs)
    kernels = _kernels_for(dsts + srcs)
    if kernels is None:
        accumulate_ref_(dsts, srcs, alpha)
        return
    contiguous = [dst.is_contiguous() for dst in dsts]
    if all(contiguous):
        _launch(kernels.plan_accumulate_(dsts, [src.contiguous() for src in srcs], alpha))
        return
    in_kernel = [i for i, c in enumerate(contiguous) if c]
    by_reference = [i for i, c in enumerate(contiguous) if not c]
    _launch(kernels.plan_accumulate_([dsts[i] for i in in_kernel], [srcs[i].contiguous() for i in in_kernel], alpha))
    accumulate_ref_([dsts[i] for i in by_reference], [srcs[i] for i in by_reference], alpha)


def _sum_n_on_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    _check_sum_n(tensors)
    kernels = _kernels_for(tensors)
    if kernels is None:
        return sum_n_ref(tensors)
    out = torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device=tensors[0].device)
    _launch(kernels.plan_sum_n([t.contiguous() for t in tensors], out))
    return out


def _pack_on_device(tensors: list[torch.Tensor], scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    _check_pack(tensors, dtype)
    kernels = _kernels_for(tensors)
    if kernels is None:
        return pack_ref(tensors, scale, dtype)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    _launch(kernels.plan_pack([t.contiguous() for t in tensors], flat, scale))
    return flat


def _unpack_on_device(flat: torch.Tensor, outs: list[torch.Tensor], scale: float = 1.0) -> None:
    _check_unpack(flat, outs)
    kernels = _kernels_for([flat] + outs)
    if kernels is None:
        unpack_ref_(flat, outs, scale)
        return
    flat = flat.contiguous()
    offsets = list(itertools.accumulate((out.numel() for out in outs[:-1]), initial=0))
    contiguous = [out.is_contiguous() for out in outs]
    if all(contiguous):
        _launch(kernels.plan_unpack_(flat, outs, scale))
        return
    _launch(
        kernels.plan_unpack_(
            flat,
            [out for out, c in zip(outs, contiguous) if c],
            scale,
            offsets=[offset for offset, c in zip(offsets, contiguous) if c],
        )
    )
    for out, offset, c in zip(outs, offsets, contiguous):
        if not c:
            unpack_ref_(flat[offset : offset + out.numel()], [out], scale)


@contextlib.contextmanager
def _quiet_triton_op_registration():
    """triton_op looks for the kernels an op launches (for AOTAutograd's cache key) and, when triton is not
    installed, warns about it once per op. Without triton these ops run their references: nothing to warn."""
    logger = logging.getLogger("torch._library.triton")
    level = logger.level
    if importlib.util.find_spec("triton") is None:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


with _quiet_triton_op_registration():
    _accumulate_op = triton_op("torch_ext::multi_tensor_accumulate_", mutates_args={"dsts"})(
        _multi_tensor_accumulate_on_device
    )
    _sum_n_op = triton_op("torch_ext::sum_n", mutates_args=())(_sum_n_on_device)
    _pack_op = triton_op("torch_ext::pack", mutates_args=())(_pack_on_device)
    _unpack_op = triton_op("torch_ext::unpack_", mutates_args={"outs"})(_unpack_on_device)


@_accumulate_op.register_kernel("cpu")
def _(dsts, srcs, alpha=1.0):
    _check_accumulate(dsts, srcs)
    accumulate_ref_(dsts, srcs, alpha)


@_sum_n_op.register_kernel("cpu")
def _(tensors):
    _check_sum_n(tensors)
    return sum_n_ref(tensors)


@_pack_op.register_kernel("cpu")
def _(tensors, scale=1.0, dtype=None):
    _check_pack(tensors, dtype)
    return pack_ref(tensors, scale, dtype)


@_unpack_op.register_kernel("cpu")
def _(flat, outs, scale=1.0):
    _check_unpack(flat, outs)
    unpack_ref_(flat, outs, scale)


# Fakes replace the ones triton_op derives from the device implementation, which would run the reference
# on fake tensors: these only check arguments and make the result.


@_accumulate_op.register_fake
def _(dsts, srcs, alpha=1.0):
    _check_accumulate(dsts, srcs)


@_sum_n_op.register_fake
def _(tensors):
    _check_sum_n(tensors)
    return tensors[0].new_empty(tensors[0].shape)


@_pack_op.register_fake
def _(tensors, scale=1.0, dtype=None):
    _check_pack(tensors, dtype)
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    return tensors[0].new_empty(sum(t.numel() for t in tensors), dtype=dtype or tensors[0].dtype)


@_unpack_op.register_fake
def _(flat, outs, scale=1.0):
    _check_unpack(flat, outs)


# Autograd for the two out-of-place ops. sum_n's gradient reaches every input unchanged; pack's is the
# gradient of the flat buffer cut back into the inputs' shapes and dtypes and scaled, by one unpack_.
# For a list argument, ctx.needs_input_grad holds one flag per element.


def _sum_n_backward(ctx, grad):
    (tensors_need_grad, *_) = ctx.needs_input_grad
    return [grad if needed else None for needed in tensors_need_grad]


def _pack_setup_context(ctx, inputs, output):
    tensors, scale, _ = inputs
    ctx.scale = scale
    ctx.shapes_and_dtypes = [(t.shape, t.dtype) for t in tensors]


def _pack_backward(ctx, grad_flat):
    (tensors_need_grad, *non_tensor_args) = ctx.needs_input_grad
    # One gradient per argument the caller passed (trailing defaults may have been left out), which is
    # what needs_input_grad holds, while setup_context sees every argument.
    no_grads = (None,) * len(non_tensor_args)
    if not any(tensors_need_grad):
        return (None, *no_grads)
    grads = [grad_flat.new_empty(shape, dtype=dtype) for shape, dtype in ctx.shapes_and_dtypes]
    torch.ops.torch_ext.unpack_(grad_flat, grads, ctx.scale)
    return ([g if needed else None for g, needed in zip(grads, tensors_need_grad)], *no_grads)


_sum_n_op.register_autograd(_sum_n_backward, setup_context=lambda ctx, inputs, output: None)
_pack_op.register_autograd(_pack_backward, setup_context=_pack_setup_context)
