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
prove that no hook communicates, so no node goes to a lane undeclared. The unsafe declarations it can
see are refused with an error on the backward that would use that group's lane, before any of its hooks
runs: :class:`~torch.nn.parallel.DistributedDataParallel` reducing on the same group, a DDP communication
hook whose state is that group (or holds it as ``process_group``), FSDP2 (``fully_shard``: its parameter
groups' shard, reduce-scatter and replicate groups) and FSDP1 communicating on it. A group is checked at
its lane's first use, and again after any DDP module, DDP communication hook or FSDP parameter group is
made (torch_ext wraps their constructors and ``register_comm_hook`` to forget the groups checked; nothing
else changes), so wrapping a model after the first backward is seen too. Groups are compared by identity: a second
group over the same ranks is another communicator (safe under gloo; under NCCL, see the design notes on
several communicators).
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_ext.collectives.roles import (
    _LANE,
    FunctionClasses,
    _generated_function,
    _is_op,
    _node_classes,
    _overload,
    _set_role,
)

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


def _functional_collective_group(ctx: Any) -> Any:
    # _c10d_functional's formulas save the group by name (torch/distributed/_functional_collectives.py).
    return dist.distributed_c10d._resolve_process_group(ctx.group_name)


def run_in_lane(*functions: FunctionClasses | Any, group_of: Callable[[Any], Any] | None = None) -> None:
    """Declares that the backward of ``functions`` may run beside the rest of backward, on a lane.

    Args:
        functions: autograd Function classes whose backward node runs one synchronous collective
            (Megatron-core's or DeepSpeed's ``_AllToAll``), or their backward node classes; or ops whose
            ``torch.library`` autograd formula runs one, such as PyTorch's functional all_to_all,
            ``torch.ops._c10d_functional.all_to_all_single`` (what ``all_to_all_single_autograd``, DTensor
            and torchtitan call: its backward issues the collective and waits for it inside the node).
        group_of: ``group_of(ctx) -> ProcessGroup | None``, the process group a node's collective
            runs on, given its ctx. By default ``ctx.group``, as both libraries save it (for a
            ``_c10d_functional`` op, the group its formula saved by name); None means the default group.

    Only for Functions whose group nothing else communicates on while backward runs (see the
    module's documentation): the engine keeps the order of the collectives it knows of the same on
    every rank, but cannot see a hook's. Undo with :func:`torch_ext.unregister_collective_backward`.
    A declaration applies to backward calls that start after it, on every thread.
    """
    api = "run_in_lane"
    if group_of is not None and not callable(group_of):
        raise TypeError(f"torch_ext.{api}: group_of must be callable (ctx -> ProcessGroup), got {group_of!r}")
    ops = [_overload(f) for f in functions if _is_op(f)]
    classes = [f for f in functions if not _is_op(f)]
    declared = [(node_class, group_of or _group_attribute) for node_class in _node_classes(classes, "functions", api)]
    for op in ops:
        node_class = _generated_function(op, api)._backward_cls
        default = _functional_collective_group if op.namespace == "_c10d_functional" else _group_attribute
        declared.append((node_class, group_of or default))
    if not declared:
        raise ValueError(f"torch_ext.{api}: give at least one Function class or op")
    for node_class, find_group in declared:
        _GROUP_OF[node_class] = find_group
        _set_role(node_class, _LANE)


def _function_name(ctx: Any) -> str:
    function = getattr(type(ctx), "_forward_cls", type(ctx))
    return f"{function.__module__}.{function.__qualname__}"


def _groups_of_hook_state(state: Any) -> list[Any]:
    # A DDP communication hook's state: the group itself (allreduce_hook), or an object holding it
    # (DefaultState, PowerSGDState: .process_group).
    if isinstance(state, (dist.ProcessGroup, torch._C._distributed_c10d.Backend)):
        return [state]
    group = getattr(state, "process_group", None)
    return [] if group is None else [group]


def _data_parallel_communication(obj: Any) -> list[tuple[str, Any]]:
    """What ``obj`` communicates on during backward, if it is data parallelism torch_ext knows of:
    (what, group) pairs."""
    kind = type(obj)
    if issubclass(kind, torch.nn.parallel.DistributedDataParallel):
        found = [("DistributedDataParallel reduces gradients", obj.process_group)]
        for _, state in getattr(obj, "_comm_hooks", ()):
            found += [("a DDP communication hook communicates", g) for g in _groups_of_hook_state(state)]
        return found
    if _FSDP_PARAM_GROUP is not None and issubclass(kind, _FSDP_PARAM_GROUP):
        # FSDP2 (fully_shard): all-gathers parameters (unshard) and reduce-scatters gradients in backward;
        # HSDP all-reduces across replicas.
        found = []
        for mesh_info in (obj.mesh_info, getattr(obj, "post_forward_mesh_info", None)):
            for attribute in ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group"):
                group = getattr(mesh_info, attribute, None)
                if group is not None:
                    found.append(("FSDP (fully_shard) communicates", group))
        return found
    if _FSDP1 is not None and issubclass(kind, _FSDP1):
        groups = (getattr(obj, "process_group", None), getattr(obj, "_inter_node_pg", None))
        return [("FullyShardedDataParallel communicates", g) for g in groups if g is not None]
    return []


def _data_parallel_on(group: Any) -> list[str]:
    """What communicates on ``group`` during backward besides the lane: one line per DDP module, FSDP parameter
    group or communication hook found on it."""
    # issubclass(type(...)), not isinstance: isinstance asks a weak proxy for its __class__, which raises
    # ReferenceError once its referent is gone, and live objects include such proxies.
    return [what for obj in gc.get_objects() for what, theirs in _data_parallel_communication(obj) if theirs is group]


def _forget_checked_groups(*_: Any) -> None:
    """A new DDP module, FSDP parameter group or communication hook may use a group already checked: every
    group is checked again at its lane's next use (the cost of a scan of live objects, once)."""
    _CHECKED_GROUPS.clear()


def _recheck_after(owner: type, method: str) -> None:
    original = getattr(owner, method)

    @functools.wraps(original)
    def then_recheck(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _forget_checked_groups()
        return result

    setattr(owner, method, then_recheck)


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
    if _fsdp_newly_imported():
        _forget_checked_groups()
    if id(group) in _CHECKED_GROUPS:
        return group
    # Once per group, and again after any DDP module, FSDP parameter group or DDP communication hook is made
    # (_recheck_after): a scan of every live object, tens of ms in a large program.
    others = _data_parallel_on(group)
    if others:
        what = "; ".join(f"{what} ({count}x)" for what, count in collections.Counter(others).items())
        raise RuntimeError(
            f"torch_ext.run_in_lane: {_function_name(ctx)} runs its collective on a process group that other "
            f"data parallelism also uses during backward: {what}. Their collectives would be issued while the "
            "lane's collective is in flight, in an order that can differ between ranks and hang. Give one of "
            "them its own group (torch.distributed.new_group, or another mesh dimension), or undo the "
            "declaration (torch_ext.unregister_collective_backward)."
        )
    _CHECKED_GROUPS[id(group)] = group
    return group


# FSDP's classes, once torch.distributed.fsdp is imported: importing it here would cost torch_ext's import
# about 1.7 s, and a program that uses FSDP has imported it before its first backward.
_FSDP_PARAM_GROUP: type | None = None
_FSDP1: type | None = None


def _fsdp_newly_imported() -> bool:
    """Whether torch.distributed.fsdp was imported since the last call; if so, its classes are read and their
    constructors made to recheck, as DDP's are."""
    global _FSDP_PARAM_GROUP, _FSDP1
    if _FSDP1 is not None or "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    _FSDP_PARAM_GROUP, _FSDP1 = FSDPParamGroup, FullyShardedDataParallel
    _recheck_after(FSDPParamGroup, "__init__")
    _recheck_after(FullyShardedDataParallel, "__init__")
    return True


_recheck_after(torch.nn.parallel.DistributedDataParallel, "__init__")
_recheck_after(torch.nn.parallel.DistributedDataParallel, "register_comm_hook")
