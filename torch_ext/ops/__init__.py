"""torch_ext's ops: collectives with autograd (``torch.ops.torch_ext.*``)."""

from torch_ext.ops.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single,
    reduce_scatter_tensor,
)

__all__ = ["all_gather_into_tensor", "all_reduce", "all_reduce_coalesced", "all_to_all_single", "reduce_scatter_tensor"]
