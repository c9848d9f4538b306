"""Collectives in backward: what torch_ext knows about them and does with them, in one place.

- **Roles** (``torch_ext.collectives.roles``): which backward nodes launch a collective and which wait for one.
  The built-in rules cover torch_ext's ops, PyTorch's functional collectives and TorchRec's comm_ops; other
  libraries' Functions are declared with :func:`torch_ext.register_collective_backward`, undone with
  :func:`torch_ext.unregister_collective_backward` and read with :func:`torch_ext.collective_role`. The
  engine drives to a launch first and runs a wait as late as the nodes reading its result allow.
- **Lanes** (``torch_ext.collectives.lanes``): :func:`torch_ext.run_in_lane` runs the node of a synchronous
  collective (Megatron-core's and DeepSpeed's ``_AllToAll``, PyTorch's functional all_to_all) beside the rest
  of backward, and refuses data parallelism that communicates on the lane's group.
- **The order check** (``torch_ext.collectives.order_check``): with :func:`torch_ext.check_collective_order`
  on, the ranks compare the collectives each backward will issue before any starts, and every rank raises on
  a mismatch that would hang or mix up data; :func:`torch_ext.debug.collective_check_count` counts the exchanges.
- **Twin groups** (``torch_ext.collectives.twin_groups``): a gloo group of the same ranks as a group, on which a
  backward running beside the next microbatch's forward issues that group's collectives under
  ``overlap_microbatches(forward_collectives="beside_backward_collectives")``; made on first use, hang-free.
  Twins and the order check's gloo mirrors of groups (``group_mirrors``) share one registry of groups derived
  from a group (``torch_ext.collectives.derived_groups``).
- **The ops** are not here: torch_ext's collectives with autograd (:func:`torch_ext.ops.all_to_all_single`,
  :func:`torch_ext.ops.all_reduce` and the rest, ``torch.ops.torch_ext.*``) live in ``torch_ext.ops``, one
  public function per op beside its fake kernel and autograd formula, as every op of torch_ext does.

Each public name here is also ``torch_ext.<name>``. What the engine asks of them (a node class's role, a lane
node's group, the order check) it asks through torch_ext's host, which torch_ext's import installs with their
functions (``torch_ext/_host.py``).
"""

from torch_ext.collectives.lanes import run_in_lane
from torch_ext.collectives.order_check import check_collective_order
from torch_ext.collectives.roles import collective_role, register_collective_backward, unregister_collective_backward

__all__ = [
    "check_collective_order",
    "collective_role",
    "register_collective_backward",
    "run_in_lane",
    "unregister_collective_backward",
]
