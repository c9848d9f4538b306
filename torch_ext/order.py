"""The node order torch_ext's engine runs a backward in, asked for before or during the run."""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from torch_ext._loader import _C
from torch_ext.priority import priority_overrides

_STOCK_CURRENT_GRAPH_TASK_EXECUTION_ORDER = torch._C._current_graph_task_execution_order


def _edges(targets, what: str) -> tuple[GradientEdge, ...]:
    if isinstance(targets, (torch.Tensor, GradientEdge)):
        targets = (targets,)
    edges = []
    for i, target in enumerate(targets):
        if isinstance(target, GradientEdge):
            edges.append(target)
        elif isinstance(target, torch.Tensor):
            if not target.requires_grad:
                raise RuntimeError(
                    f"torch_ext.debug.execution_order: element {i} of {what} does not require grad and does not have "
                    "a grad_fn"
                )
            edges.append(get_gradient_edge(target))
        else:
            raise TypeError(
                f"torch_ext.debug.execution_order: {what} must be Tensors or GradientEdges, got {type(target).__name__}"
            )
    return tuple(edges)


def execution_order(outputs, inputs=None, priorities=None) -> list[Node]:
    """The nodes torch_ext's engine runs for a backward from ``outputs``, in the order it runs them.

    Nothing runs: the graph is discovered and the schedule replayed as ``torch_ext.backward(outputs)``
    (``inputs`` omitted) or ``torch_ext.grad(outputs, inputs)`` would run it, with ``priorities`` (as for
    :func:`torch_ext.backward`) over :func:`torch_ext.set_priority`'s and the automatic priority of
    collectives, and with the late slot of a node fed by a torch_ext collective's result in flight. Without
    any priority this is stock PyTorch's order. Nodes of ``grad()`` that only capture a gradient (a leaf's
    AccumulateGrad) are listed where they capture it.

    A collective's result is predicted to be handed over in flight; it is waited on inside its node instead
    (and the order is then stock's around it) under anomaly mode's NaN check or when the node has post hooks.
    """
    roots = _edges(outputs, "outputs")
    input_edges = _edges(inputs, "inputs") if inputs is not None else ()
    if inputs is not None and not input_edges:
        raise RuntimeError("torch_ext.debug.execution_order: inputs cannot be empty")
    return _C.execution_order(roots, input_edges, priority_overrides(priorities, "debug.execution_order"))


def _current_graph_task_execution_order() -> list[Node]:
    """``torch._C._current_graph_task_execution_order`` that reports torch_ext's real order inside its backward.

    Inside a node that torch_ext runs, stock's function would read the host graph task, whose only node is
    torch_ext's driver; this returns the order torch_ext runs the call's nodes in instead. Elsewhere it is
    stock's.
    """
    order = _C._current_execution_order()
    return _STOCK_CURRENT_GRAPH_TASK_EXECUTION_ORDER() if order is None else order


torch._C._current_graph_task_execution_order = _current_graph_task_execution_order
