"""torch_ext's ops: collectives with autograd (``torch.ops.torch_ext.*``).

What the engine does with collectives in backward (their roles, lanes, the order check) is in
:mod:`torch_ext.collectives`.
"""

from torch_ext.ops.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single,
    reduce_scatter_tensor,
)

__all__ = ["all_gather_into_tensor", "all_reduce", "all_reduce_coalesced", "all_to_all_single", "reduce_scatter_tensor"]
