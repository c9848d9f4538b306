"""Backward priorities: which ready node the engine runs first.

Among the nodes whose inputs are all ready, torch_ext runs the highest priority first; equal
priorities (the default is 0) keep stock PyTorch's order. A priority set with ``propagate=True``
(the default) also applies to every node on a path from the backward roots to the target, so the
engine drives straight to the target and runs it as early as its dependencies allow — the way to
launch a collective's gradient communication early and overlap it with the rest of backward.

Stock PyTorch's only lever, ``grad_fn._set_sequence_nr(n)``, boosts one node only once it is ready
and rewrites the number the profiler uses to link backward to forward ops. torch_ext keeps its
priorities in its own table and never changes ``sequence_nr`` (a ``_set_sequence_nr`` boost still
works as on stock: it orders nodes of equal priority).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node

from torch_ext._api import Undo
from torch_ext._loader import _C

# The priority launch_first() gives: the largest a priority can be.
LAUNCH_FIRST = 2**63 - 1
_MIN_PRIORITY = -(2**63)

PriorityTarget = torch.Tensor | Node | GradientEdge


def _node_of(target: PriorityTarget, api: str) -> Node:
    if isinstance(target, GradientEdge):
        return target.node
    if isinstance(target, Node):
        return target
    if isinstance(target, torch.Tensor):
        if target.grad_fn is not None:
            return target.grad_fn
        if target.requires_grad:
            # A leaf: its AccumulateGrad node (created here if backward has not made one yet).
            return torch.autograd.graph.get_gradient_edge(target).node
        raise ValueError(
            f"torch_ext.{api}: the tensor has no grad_fn and does not require grad, so no backward node "
            "runs for it; give a tensor produced by a differentiable op, a leaf with requires_grad=True, "
            "a torch.autograd.graph.Node or a GradientEdge"
        )
    raise TypeError(
        f"torch_ext.{api}: expected a Tensor, a torch.autograd.graph.Node or a GradientEdge, "
        f"got {type(target).__name__}"
    )


def _checked_priority(priority, api: str) -> int:
    # bool is an int subclass, but True as a priority is almost certainly a mistake.
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"torch_ext.{api}: priority must be an int, got {type(priority).__name__}")
    if not _MIN_PRIORITY <= priority <= LAUNCH_FIRST:
        raise ValueError(f"torch_ext.{api}: priority {priority} does not fit in 64 bits")
    return priority


def set_priority(target: PriorityTarget, priority: int, *, propagate: bool = True) -> None:
    """Gives the backward node of ``target`` a priority, for every backward it takes part in.

    Args:
        target: a tensor (its ``grad_fn``, or a leaf's AccumulateGrad), a
            ``torch.autograd.graph.Node`` or a ``GradientEdge``.
        priority: among ready nodes, higher runs first; the default of every node is 0.
        propagate: also run every node on a path from the roots to ``target`` with at least this
            priority, so the engine reaches ``target`` as early as dependencies allow.

    The priority lives as long as the node and can be removed with :func:`clear_priority`.
    """
    node = _node_of(target, "set_priority")
    _C.set_priority(node, _checked_priority(priority, "set_priority"), bool(propagate))


def clear_priority(target: PriorityTarget) -> bool:
    """Removes the priority of ``target``'s node; returns whether it had one."""
    return _C.clear_priority(_node_of(target, "clear_priority"))


def get_priority(target: PriorityTarget) -> tuple[int, bool] | None:
    """``(priority, propagate)`` set for ``target``'s node, or None."""
    return _C.get_priority(_node_of(target, "get_priority"))


def launch_first(target: PriorityTarget) -> None:
    """Runs ``target``'s node, and everything on the path to it, before any other work."""
    set_priority(target, LAUNCH_FIRST, propagate=True)


def set_auto_collective_priority_enabled(enabled: bool) -> Undo:
    """Switches the automatic priority of collectives (on by default); ``with`` limits it to a block.

    When on, the backward node that launches a collective — torch_ext's own ops
    (:mod:`torch_ext.ops`), PyTorch's functional collectives (``_c10d_functional``), TorchRec's
    comm_ops and whatever :func:`torch_ext.register_collective_backward` declared (see
    :mod:`torch_ext.collectives`) — runs with a high propagated priority (``2**62``, below
    :data:`LAUNCH_FIRST`), unless it has a priority of its own: the engine drives straight to it
    so its communication starts as early as dependencies allow.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            f"torch_ext.set_auto_collective_priority_enabled: expected a bool, got {type(enabled).__name__}"
        )
    previous = _C.auto_collective_priority()
    _C.set_auto_collective_priority(enabled)
    return Undo(
        f"set_auto_collective_priority_enabled({enabled})",
        lambda: _C.set_auto_collective_priority(previous),
    )


def is_auto_collective_priority_enabled() -> bool:
    """Whether collectives are prioritised automatically (:func:`set_auto_collective_priority_enabled`)."""
    return _C.auto_collective_priority()


def priority_overrides(priorities, api: str) -> list[tuple[Node, int, bool]] | None:
    """``{target: priority}`` of one call as the engine takes it: ``[(node, priority, propagate)]``."""
    if priorities is None:
        return None
    if not isinstance(priorities, dict):
        raise TypeError(
            f"torch_ext.{api}: priorities must be a dict {{target: priority}}, got {type(priorities).__name__}"
        )
    return [(_node_of(target, api), _checked_priority(priority, api), True) for target, priority in priorities.items()]
