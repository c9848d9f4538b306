"""Collective lanes: a synchronous collective's backward node run beside the rest of backward.

Megatron-core and DeepSpeed write their mixture-of-experts all_to_all as an autograd Function
(``_AllToAll``) whose backward runs the collective synchronously inside its node: on stock PyTorch,
and on torch_ext without a lane, the engine waits there for the bytes. Declared to a lane::

    from megatron.core.tensor_parallel.mappings import _AllToAll
    torch_ext.run_in_lane(_AllToAll)

the node's ``apply()`` runs on a thread of its process group's lane (on CPU; the collective releases
the GIL while it waits) while the engine runs every other ready node; its outputs are delivered when it
returns, so the gradients keep stock's bits. The engine drives to the node first (the automatic
collective priority), so the communication starts as early as the graph allows.

What the engine guarantees, so that ranks cannot disagree on the order of collectives (which hangs
gloo and NCCL): every node that issues a collective and that the engine knows of -- lane nodes, its
own collective ops, PyTorch's functional collectives, TorchRec's launches -- starts in one fixed order,
the plan's, which is the same on every rank that has the same graph and priorities; one lane per
process group runs its nodes one at a time in that order; and a collective the engine issues itself
waits until no lane has work. What it cannot see is why a lane is opt-in: a DDP or FSDP communication
hook, or a hook of yours, that issues a collective on the lane's group while the lane's collective is in
flight. Declare a Function only when nothing else communicates on its group during backward -- the
expert-parallel group of an MoE layer, typically. The rule has no automatic case: the engine can never
prove that no hook communicates, so no node goes to a lane undeclared. The one unsafe declaration it
can see, :class:`~torch.nn.parallel.DistributedDataParallel` reducing on the same group, is refused
with an error on the first backward that would use that group's lane.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_ext._loader import _C
from torch_ext.collectives import _LANE, FunctionClasses, _node_classes

# Backward node class -> how to find its process group from the node's ctx.
_GROUP_OF: dict[type, Callable[[Any], Any]] = {}
# Groups already checked, by id. Weakly: a group held here would outlive destroy_process_group, and a
# live gloo group's worker threads can abort the interpreter's exit (tests/distributed/test_clean_exit.py).
# A dead group's entry goes with it, so a new group at the same address is checked afresh; while a call
# runs, its nodes' ctx keep their groups (the lanes' keys) alive.
_CHECKED_GROUPS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _group_attribute(ctx: Any) -> Any:
    # Megatron-core's and DeepSpeed's _AllToAll both save their group as ctx.group.
    return getattr(ctx, "group", None)


def run_in_lane(*functions: FunctionClasses, group_of: Callable[[Any], Any] | None = None) -> None:
    """Declares that the backward of ``functions`` may run beside the rest of backward, on a lane.

    Args:
        functions: autograd Function classes whose backward node runs one synchronous collective
            (Megatron-core's or DeepSpeed's ``_AllToAll``), or their backward node classes.
        group_of: ``group_of(ctx) -> ProcessGroup | None``, the process group a node's collective
            runs on, given its ctx. By default ``ctx.group``, as both libraries save it; None means
            the default group.

    Only for Functions whose group nothing else communicates on while backward runs (see the
    module's documentation): the engine keeps the order of the collectives it knows of the same on
    every rank, but cannot see a hook's. Undo with :func:`torch_ext.unregister_collective_backward`.
    A declaration applies to backward calls that start after it, on every thread.
    """
    api = "run_in_lane"
    if group_of is not None and not callable(group_of):
        raise TypeError(f"torch_ext.{api}: group_of must be callable (ctx -> ProcessGroup), got {group_of!r}")
    node_classes = _node_classes(functions, "functions", api)
    if not node_classes:
        raise ValueError(f"torch_ext.{api}: give at least one Function class")
    for node_class in node_classes:
        _GROUP_OF[node_class] = group_of or _group_attribute
        _C.set_collective_role(node_class, _LANE)


def _function_name(ctx: Any) -> str:
    function = getattr(type(ctx), "_forward_cls", type(ctx))
    return f"{function.__module__}.{function.__qualname__}"


def _ddp_modules_reducing_on(group: Any) -> list[torch.nn.Module]:
    ddp = torch.nn.parallel.DistributedDataParallel
    # issubclass(type(...)), not isinstance: isinstance asks a weak proxy for its __class__, which raises
    # ReferenceError once its referent is gone, and live objects include such proxies.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), ddp) and obj.process_group is group]


def _lane_group(ctx: Any) -> Any:
    """The engine's question, once per lane node and call: the group whose lane runs ``ctx``'s node."""
    group_of = _GROUP_OF.get(type(ctx), _group_attribute)
    group = group_of(ctx)
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"torch_ext.run_in_lane: {_function_name(ctx)} runs on the default process group, "
                "which is not initialized (torch.distributed.init_process_group)"
            )
        group = dist.distributed_c10d._get_default_group()
    # A backend object (ProcessGroupGloo made by hand) is a group of its own too.
    if not isinstance(group, (dist.ProcessGroup, torch._C._distributed_c10d.Backend)):
        raise TypeError(
            f"torch_ext.run_in_lane: the process group of {_function_name(ctx)} must be a "
            f"torch.distributed.ProcessGroup, got {type(group).__name__} (pass group_of= to say where it is)"
        )
    if id(group) in _CHECKED_GROUPS:
        return group
    # Once per group: a scan of every live object, tens of ms in a large program.
    ddp_modules = _ddp_modules_reducing_on(group)
    if ddp_modules:
        raise RuntimeError(
            f"torch_ext.run_in_lane: {_function_name(ctx)} runs its collective on a process group that "
            f"DistributedDataParallel also reduces gradients on ({len(ddp_modules)} module(s)). DDP's "
            "all_reduce would be issued while the lane's collective is in flight, in an order that can "
            "differ between ranks and hang. Give one of them its own group (torch.distributed.new_group), "
            "or undo the declaration (torch_ext.unregister_collective_backward)."
        )
    _CHECKED_GROUPS[id(group)] = group
    return group


_C.set_lane_group_resolver(_lane_group)
