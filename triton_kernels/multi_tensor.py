"""Multi-tensor Triton kernels: one launch for a whole list of tensors.

Gradient plumbing touches hundreds of small tensors per step, where a launch per tensor, not bandwidth,
sets the cost. These kernels follow the multi-tensor-apply pattern: the host writes a table of tensor
addresses and sizes, plus one (tensor, start) entry per block of BLOCK elements, and copies it to the
device in one transfer; each program reads its entry and works on that block of that tensor. Tensors
of different dtypes go to separate launches, since the element type is compiled into a kernel, and so
do tensors at addresses that do not allow 128-bit accesses (VECTOR_BYTES).

Semantics are those of multi_tensor_ref.py: fp32 arithmetic, one rounding to the destination dtype.
Launches turn off fp fusion (multiply-add contraction): the product is rounded before the sum, as in the
reference and the interpreter, so GPU results match them bit for bit (a memory-bound kernel loses nothing).
The launchers take contiguous tensors only (a block is a run of consecutive elements) and raise
ValueError naming the argument otherwise; torch_ext/kernels.py routes other tensors to the reference.

``plan_*`` return the launches as data so that torch_ext/kernels.py can launch them through
``torch.library.wrap_triton``; ``accumulate_``, ``sum_n``, ``pack`` and ``unpack_`` plan and launch
directly (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .multi_tensor_ref import SUPPORTED_DTYPES

# Elements per program. Not measured on a GPU (none on the machine these kernels were written on):
# large enough that a program's fixed cost (reading its table entry) is small against 4096 elements
# at 4 warps, i.e. 32 per thread, small enough that a 1k-element bias does not waste most of a
# program. Read at every launch, so that benchmarks/kernels.py --block-size can measure others on a GPU;
# a launcher's block_size argument overrides it.
BLOCK_SIZE = 4096

# Full blocks of tensors whose addresses are multiples of this many bytes are read and written with
# 128-bit accesses: in PTX for sm_80 the kernels use ld.global.v4.b32 there and scalar ld.global.b16 /
# .b32 otherwise (Triton cannot know the alignment of an address loaded from a table, nor, with a mask
# over an arbitrary size, that whole vectors are in bounds). Not timed: no GPU here.
VECTOR_BYTES: tl.constexpr = tl.constexpr(16)

_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE, to nearest even.

    bf16 is rounded by hand: Triton's interpreter truncates fp32 -> bf16 (4945 of 10000 randn values
    differed from torch with triton 3.9) while GPUs round to nearest even, so the integer rounding
    gives torch's bits on both, and the interpreter tests check the rounding a GPU runs. It costs a
    few integer operations per element in a memory-bound kernel.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        # A NaN's payload can carry into the sign; torch writes the canonical quiet NaN.
        rounded = tl.where(x != x, 0x7FC0, rounded)  # noqa: PLR0124 - true for NaN only
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _scale_block(dst, src, offsets, in_tensor, scale, DST_DTYPE: tl.constexpr, ACCUMULATE: tl.constexpr):
    result = scale * tl.load(src + offsets, mask=in_tensor).to(tl.float32)
    if ACCUMULATE:
        result = tl.load(dst + offsets, mask=in_tensor).to(tl.float32) + result
    tl.store(dst + offsets, _round_to(result, DST_DTYPE), mask=in_tensor)


@triton.jit
def _multi_tensor_scale_kernel(
    table_ptr,
    n_tensors,
    n_blocks,
    scale,
    DST_DTYPE: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``dst_i = scale * src_i`` (or ``dst_i += scale * src_i`` with ACCUMULATE) for every tensor pair i.

    table (int64): dst addresses [n_tensors], src addresses [n_tensors], numels [n_tensors], then per
    block its tensor index [n_blocks] and its first element [n_blocks]. ALIGNED: every address is a
    multiple of VECTOR_BYTES.
    """
    block = tl.program_id(0)
    tensor = tl.load(table_ptr + 3 * n_tensors + block)
    start = tl.load(table_ptr + 3 * n_tensors + n_blocks + block)
    numel = tl.load(table_ptr + 2 * n_tensors + tensor)
    dst = tl.load(table_ptr + tensor).to(tl.pointer_type(DST_DTYPE), bitcast=True)
    src = tl.load(table_ptr + n_tensors + tensor).to(tl.pointer_type(SRC_DTYPE), bitcast=True)
    if ALIGNED:
        dst = tl.multiple_of(dst, VECTOR_BYTES)
        src = tl.multiple_of(src, VECTOR_BYTES)
        start = tl.multiple_of(start, BLOCK)
    offsets = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _scale_block(dst, src, offsets, None, scale, DST_DTYPE, ACCUMULATE)
    else:
        _scale_block(dst, src, offsets, offsets < numel, scale, DST_DTYPE, ACCUMULATE)


@triton.jit
def _sum_n_block(table_ptr, out_ptr, n_inputs, offsets, in_tensor, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    first = tl.load(table_ptr).to(tl.pointer_type(DTYPE), bitcast=True)
    if ALIGNED:
        first = tl.multiple_of(first, VECTOR_BYTES)
    total = tl.load(first + offsets, mask=in_tensor).to(tl.float32)  # not 0 + first: that turns -0.0 into 0.0
    for i in range(1, n_inputs):
        addend = tl.load(table_ptr + i).to(tl.pointer_type(DTYPE), bitcast=True)
        if ALIGNED:
            addend = tl.multiple_of(addend, VECTOR_BYTES)
        total += tl.load(addend + offsets, mask=in_tensor).to(tl.float32)
    tl.store(out_ptr + offsets, _round_to(total, DTYPE), mask=in_tensor)


@triton.jit
def _sum_n_kernel(table_ptr, out_ptr, n_inputs, numel, DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """``out = inputs[0] + inputs[1] + ...`` in that order, in fp32; table (int64): the input addresses.
    ALIGNED: every input address is a multiple of VECTOR_BYTES."""
    start = tl.program_id(0).to(tl.int64) * BLOCK  # past 2**31 elements too
    offsets = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _sum_n_block(table_ptr, out_ptr, n_inputs, offsets, None, DTYPE, ALIGNED)
    else:
        _sum_n_block(table_ptr, out_ptr, n_inputs, offsets, offsets < numel, DTYPE, ALIGNED)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: ``kernel[grid](**kwargs)``.

    ``addressed`` holds the tensors the kernel reaches through its address table: while the launch is
    alive their memory cannot be freed and reused (say, a ``.contiguous()`` copy made only for it).
    """

    kernel: Any
    grid: tuple[int]
    kwargs: dict[str, Any]
    addressed: tuple[torch.Tensor, ...]

    def run(self) -> None:
        self.kernel[self.grid](**self.kwargs)


def plan_accumulate_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], alpha: float = 1.0, block_size: int | None = None
) -> list[KernelLaunch]:
    """Launches for ``dsts[i] += alpha * srcs[i]``: one per (dst dtype, src dtype) pair present."""
    _check_contiguous("dsts", dsts)
    _check_contiguous("srcs", srcs)
    return _plan_scale(
        dsts,
        srcs,
        [d.data_ptr() for d in dsts],
        [s.data_ptr() for s in srcs],
        [d.numel() for d in dsts],
        alpha,
        accumulate=True,
        block_size=block_size,
    )


def plan_pack(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float = 1.0, block_size: int | None = None
) -> list[KernelLaunch]:
    """Launches writing ``scale * tensors[i]``, flattened and one after another, into the 1-D ``flat``."""
    _check_contiguous("tensors", tensors)
    _check_contiguous("flat", [flat])
    numels = [t.numel() for t in tensors]
    return _plan_scale(
        [flat] * len(tensors),
        tensors,
        _addresses_in(flat, numels),
        [t.data_ptr() for t in tensors],
        numels,
        scale,
        accumulate=False,
        block_size=block_size,
    )


def plan_unpack_(
    flat: torch.Tensor,
    outs: Sequence[torch.Tensor],
    scale: float = 1.0,
    block_size: int | None = None,
    offsets: Sequence[int] | None = None,
) -> list[KernelLaunch]:
    """Launches writing ``scale * flat[offset_i : offset_i + outs[i].numel()]`` into each ``outs[i]``, where
    offset_i is ``offsets[i]`` or, by default, the total size of the outs before it."""
    _check_contiguous("flat", [flat])
    _check_contiguous("outs", outs)
    numels = [o.numel() for o in outs]
    if offsets is None:
        src_addresses = _addresses_in(flat, numels)
    else:
        src_addresses = [flat.data_ptr() + offset * flat.element_size() for offset in offsets]
    return _plan_scale(
        outs,
        [flat] * len(outs),
        [o.data_ptr() for o in outs],
        src_addresses,
        numels,
        scale,
        accumulate=False,
        block_size=block_size,
    )


def plan_sum_n(tensors: Sequence[torch.Tensor], out: torch.Tensor, block_size: int | None = None) -> list[KernelLaunch]:
    """The launch writing ``tensors[0] + tensors[1] + ...`` into ``out`` (all of one shape and dtype)."""
    _check_contiguous("tensors", tensors)
    _check_contiguous("out", [out])
    _check_dtype("out", out.dtype)
    if out.numel() == 0:
        return []
    block_size = block_size or BLOCK_SIZE
    addresses = [t.data_ptr() for t in tensors]
    table = _to_device(torch.tensor(addresses, dtype=torch.int64), out.device)
    return [
        KernelLaunch(
            _sum_n_kernel,
            (triton.cdiv(out.numel(), block_size),),
            {
                "table_ptr": table,
                "out_ptr": out,
                "n_inputs": len(tensors),
                "numel": out.numel(),
                "DTYPE": _TRITON_DTYPES[out.dtype],
                "ALIGNED": all(address % VECTOR_BYTES.value == 0 for address in [out.data_ptr(), *addresses]),
                "BLOCK": block_size,
                "enable_fp_fusion": False,
            },
            addressed=tuple(tensors),
        )
    ]


def accumulate_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], alpha: float = 1.0, block_size: int | None = None
) -> None:
    """``dsts[i] += alpha * srcs[i]`` for contiguous same-shape pairs, one launch per dtype pair (two if
    alignment differs)."""
    _run(plan_accumulate_(dsts, srcs, alpha, block_size))


def sum_n(tensors: Sequence[torch.Tensor], block_size: int | None = None) -> torch.Tensor:
    """A new contiguous tensor ``tensors[0] + tensors[1] + ...``, accumulated in fp32, in one launch."""
    out = torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device=tensors[0].device)
    _run(plan_sum_n(tensors, out, block_size))
    return out


def pack(
    tensors: Sequence[torch.Tensor], scale: float = 1.0, dtype: torch.dtype | None = None, block_size: int | None = None
) -> torch.Tensor:
    """A new 1-D tensor of ``dtype`` (default: the first tensor's) holding ``scale * tensors[i]`` flattened,
    one after another. Needs at least one tensor (the device comes from it)."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    _run(plan_pack(tensors, flat, scale, block_size))
    return flat


def unpack_(
    flat: torch.Tensor, outs: Sequence[torch.Tensor], scale: float = 1.0, block_size: int | None = None
) -> None:
    """Writes ``scale * flat[offset_i : offset_i + outs[i].numel()]`` into each ``outs[i]``, in place."""
    _run(plan_unpack_(flat, outs, scale, block_size))


def _run(launches: list[KernelLaunch]) -> None:
    for launch in launches:
        launch.run()


def _plan_scale(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    dst_addresses: list[int],
    src_addresses: list[int],
    numels: list[int],
    scale: float,
    accumulate: bool,
    block_size: int | None,
) -> list[KernelLaunch]:
    """One launch of the scale kernel per (dst dtype, src dtype, all addresses aligned to VECTOR_BYTES), in
    order of first appearance, for the tensor pairs with elements. dsts[i] and srcs[i] give dtypes and
    keep memory alive; the addresses may point inside them (pack, unpack). Per-tensor work stays in list
    comprehensions: at hundreds of tensors the host time of planning is what this launch saves."""
    aligned = [(d | s) % VECTOR_BYTES.value == 0 for d, s in zip(dst_addresses, src_addresses)]
    dst_dtypes, src_dtypes = {d.dtype for d in dsts}, {s.dtype for s in srcs}
    groups: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
    if len(dst_dtypes) == 1 and len(src_dtypes) == 1:  # the common case, without a per-tensor loop
        for is_aligned in (True, False):
            indices = [i for i, (n, a) in enumerate(zip(numels, aligned)) if n > 0 and a == is_aligned]
            if indices:
                groups[(*dst_dtypes, *src_dtypes, is_aligned)] = indices
    else:
        for i, (dst, src, numel, is_aligned) in enumerate(zip(dsts, srcs, numels, aligned)):
            if numel > 0:
                groups.setdefault((dst.dtype, src.dtype, is_aligned), []).append(i)
    block_size = block_size or BLOCK_SIZE
    launches = []
    for (dst_dtype, src_dtype, is_aligned), indices in groups.items():
        _check_dtype("destination", dst_dtype)
        _check_dtype("source", src_dtype)
        group_numels = torch.tensor([numels[i] for i in indices], dtype=torch.int64)
        addresses = torch.tensor(
            [dst_addresses[i] for i in indices] + [src_addresses[i] for i in indices], dtype=torch.int64
        )
        blocks_per_tensor = (group_numels + block_size - 1) // block_size
        end_blocks = torch.cumsum(blocks_per_tensor, 0)
        first_blocks = end_blocks - blocks_per_tensor
        n_blocks = int(end_blocks[-1])
        # Block -> tensor by counting tensor starts: repeat_interleave and searchsorted took ~8 ms for 500
        # tensors on this 2-core machine (their parallel loops wake the thread pool; 37 us on one thread),
        # this ~50 us.
        block_tensor = torch.zeros(n_blocks, dtype=torch.int64)
        block_tensor[first_blocks[1:]] = 1
        block_tensor = torch.cumsum(block_tensor, 0)
        block_start = (torch.arange(n_blocks) - first_blocks[block_tensor]) * block_size
        table = torch.cat([addresses, group_numels, block_tensor, block_start])
        launches.append(
            KernelLaunch(
                _multi_tensor_scale_kernel,
                (n_blocks,),
                {
                    "table_ptr": _to_device(table, dsts[indices[0]].device),
                    "n_tensors": len(indices),
                    "n_blocks": n_blocks,
                    "scale": scale,
                    "DST_DTYPE": _TRITON_DTYPES[dst_dtype],
                    "SRC_DTYPE": _TRITON_DTYPES[src_dtype],
                    "ACCUMULATE": accumulate,
                    "ALIGNED": is_aligned,
                    "BLOCK": block_size,
                    "enable_fp_fusion": False,
                },
                addressed=tuple(dsts[i] for i in indices) + tuple(srcs[i] for i in indices),
            )
        )
    return launches


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":  # the interpreter reads host memory
        return table
    # Pinned, so the copy is asynchronous; the caching host allocator keeps the pinned block until the
    # copy has run, and the device copy is freed on the launch stream, so both outlive the kernel.
    return table.pin_memory().to(device, non_blocking=True)


def _addresses_in(flat: torch.Tensor, numels: list[int]) -> list[int]:
    """Addresses of consecutive pieces of ``flat`` with the given sizes."""
    element_size, address = flat.element_size(), flat.data_ptr()
    addresses = []
    for numel in numels:
        addresses.append(address)
        address += numel * element_size
    return addresses


def _check_contiguous(name: str, tensors: Sequence[torch.Tensor]) -> None:
    if all(t.is_contiguous() for t in tensors):
        return
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            where = name if name in ("flat", "out") else f"{name}[{i}]"
            raise ValueError(
                f"{where} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); these kernels read "
                "each tensor as consecutive elements (torch_ext.kernels routes other tensors to torch)"
            )


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {dtype} is not supported; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
