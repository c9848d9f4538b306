"""Plain-torch references for the multi-tensor kernels in multi_tensor.py.

They define the results the kernels must give: arithmetic in fp32 whatever the storage dtype, rounded
once to the destination dtype (round to nearest even), so a kernel can be checked bit for bit where
the operations are the same. torch_ext's ops run these on CPU; tests and benchmarks import them too.
No validation here beyond what torch does: torch_ext/kernels.py checks arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The dtypes the kernels handle. Others are rejected by the ops rather than silently computed in fp32.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def accumulate_ref_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """``dsts[i] += alpha * srcs[i]`` for every i, in place: the product and the sum in fp32, the sum rounded
    to dst's dtype. dst and src dtypes may differ."""
    if not dsts:
        return
    if alpha == 1.0:
        torch._foreach_add_(list(dsts), list(srcs))
    else:
        # Not add_(src, alpha=alpha): torch's CPU add rounds alpha to the operands' dtype when both are
        # 16-bit, and fuses the multiply-add for fp32; here alpha stays fp32 and the product is rounded
        # before the sum, as the kernel does.
        torch._foreach_add_(list(dsts), torch._foreach_mul([s.float() for s in srcs], alpha))


def sum_n_ref(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors[0] + tensors[1] + ...`` in that order, accumulated in fp32, as a new contiguous tensor of
    their dtype. Needs at least one tensor."""
    first = tensors[0]
    total = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    total.copy_(first)
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total.to(first.dtype)


def pack_ref(tensors: Sequence[torch.Tensor], scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One flat contiguous buffer holding ``scale * tensors[i]`` flattened, one after another, in ``dtype``
    (default: the tensors' common dtype; float32 for an empty list, which gives an empty CPU tensor)."""
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    dtype = dtype or tensors[0].dtype
    numels = [t.numel() for t in tensors]
    flat = torch.empty(sum(numels), dtype=dtype, device=tensors[0].device)
    _copy_scaled_(list(flat.split(numels)), [t.reshape(-1) for t in tensors], scale)
    return flat


def unpack_ref_(flat: torch.Tensor, outs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """The inverse of pack: ``outs[i].copy_(scale * flat[offset_i : offset_i + outs[i].numel()])``, with
    offset_i the total size of the outs before it; outs may be views and of any of the supported dtypes."""
    if not outs:
        return
    pieces = flat.split([o.numel() for o in outs])
    _copy_scaled_(list(outs), [piece.view(o.shape) for piece, o in zip(pieces, outs)], scale)


def _copy_scaled_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], scale: float) -> None:
    # Scaling in fp32 first, then one rounding in the copy: scaling in a 16-bit source dtype would round
    # twice (torch's fp16 multiply rounds its fp32 result back to fp16 before the copy casts it again).
    if scale != 1.0:
        srcs = torch._foreach_mul([s.float() for s in srcs], scale)
    torch._foreach_copy_(dsts, srcs)
