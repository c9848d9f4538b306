"""Whether a value came out the same on both engines, and if not, what differs, in the words the report prints.

The rule of "the same" is not here: it is :mod:`torch_ext.testing`'s (``_elements_differ`` for a tensor's elements,
``identity_difference`` for anything else), the one torch_ext's tests hold the engine to, so that verify and the
tests cannot disagree about a NaN or a -0.0. What is here is what verify says about a difference (how many
elements, the largest gap) and what it compares of a sparse gradient (its indices, then its values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from torch_ext.testing import _elements_differ, identity_difference
from torch_ext.verify._report import _kind


def _values(returned: Any) -> list[Any]:
    """The tensors and numbers in what the step returned."""
    return [value for value in tree_leaves(returned) if isinstance(value, (torch.Tensor, int, float, complex, bool))]


def _compare_values(stock: Any, ours: Any, missing_on_stock: bool = False) -> str | None:
    """None when ``stock`` and ``ours`` are the same by torch_ext.testing's rule (bit for bit, a NaN equal to any
    NaN); else what differs, in words."""
    if missing_on_stock:
        return "not seen on stock's run"
    if not isinstance(stock, torch.Tensor) or not isinstance(ours, torch.Tensor):
        if isinstance(stock, torch.Tensor) or isinstance(ours, torch.Tensor):
            return f"stock {_kind(stock)}, torch_ext {_kind(ours)}"
        same = identity_difference(ours, stock, compare_strides=False) is None
        return None if same else f"stock {stock!r}, torch_ext {ours!r}"
    if (stock.dtype, stock.shape, stock.layout) != (ours.dtype, ours.shape, ours.layout):
        return f"stock {_kind(stock)}, torch_ext {_kind(ours)}"
    if stock.is_sparse:
        stock, ours = stock.coalesce(), ours.coalesce()
        if not torch.equal(stock.indices(), ours.indices()):
            return "the sparse gradients' indices differ"
        stock, ours = stock.values(), ours.values()
    differ = _elements_differ(ours, stock)
    if not differ.any():
        return None
    detail = f"{int(differ.sum())} of {differ.numel()} elements differ"
    if stock.is_floating_point() or stock.is_complex():
        gap = (stock.to(torch.complex128 if stock.is_complex() else torch.float64) - ours).abs()
        gap = gap[~gap.isnan()]
        if gap.numel():
            detail += f", max abs diff {gap.max().item():.3g}"
    return detail
