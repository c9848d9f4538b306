"""A backward call's graph, walked from its roots before the engine runs, and a torch_ext trace read against it.

The walk gives what the report names nodes by (``"Name #k"``, k a node's position in the walk, the same on both
engines where raw sequence numbers are not), which nodes produced each leaf's gradient, and which nodes are
collectives (``torch_ext.collective_role``) and which wait pairs with which launch. Stock's run times its nodes
with hooks on this graph (``_session``); torch_ext's run is read from its trace here (``_from_trace``), because
both need the walk's labels and pairs to say the same thing about the two engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from torch_ext.collectives import collective_role
from torch_ext.verify._report import Collective

# The class of a leaf's gradient accumulator (torch._C._functions is an attribute of torch._C, not a module).
_AccumulateGrad = torch._C._functions.AccumulateGrad
# Node._sequence_nr() of a node without one (AccumulateGrad) is UINT64_MAX; the trace's is -1.
_NO_SEQUENCE_NR = 2**63


@dataclasses.dataclass
class _Graph:
    """A backward call's graph, walked from its roots before the engine runs."""

    nodes: list[Any]
    position: dict[Any, int]
    # id(leaf) -> the nodes whose outputs feed its AccumulateGrad.
    producers: dict[int, list[Any]]
    leaves: list[torch.Tensor]
    # Collective nodes (torch_ext.collective_role) -> role; a launch -> its paired wait node.
    roles: dict[Any, str]
    wait_of: dict[Any, Any]

    def label(self, node) -> str:
        return _label(node.name(), self.position.get(node), _has_sequence_nr(node._sequence_nr()))

    def describe(self, node) -> str:
        sequence_nr = node._sequence_nr()
        return node.name() + (f" (sequence_nr {sequence_nr})" if _has_sequence_nr(sequence_nr) else "")


def _has_sequence_nr(sequence_nr: int) -> bool:
    return 0 <= sequence_nr < _NO_SEQUENCE_NR


def _label(name: str, position: int | None, numbered: bool) -> str:
    return f"{name} #{position}" if numbered and position is not None else name


def _walk(roots: Sequence[Any]) -> _Graph:
    starts = []
    for root in roots:
        node = root.node if isinstance(root, torch.autograd.graph.GradientEdge) else root.grad_fn
        if node is not None:
            starts.append(node)
    nodes, position, stack = [], {}, list(reversed(starts))
    producers: dict[int, list[Any]] = {}
    leaves: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if node in position:
            continue
        position[node] = len(nodes)
        nodes.append(node)
        if isinstance(node, _AccumulateGrad):
            leaves.append(node.variable)
            continue
        for next_node, _ in reversed(node.next_functions):
            if next_node is None:
                continue
            if isinstance(next_node, _AccumulateGrad):
                edges = producers.setdefault(id(next_node.variable), [])
                if node not in edges:
                    edges.append(node)
            if next_node not in position:
                stack.append(next_node)
    # Only Python Function nodes can be collectives (collective_role says None for C++ nodes, and raises for
    # a C++ node type that torch.autograd.graph.Node does not register, such as CppFunction).
    python_nodes = (node for node in nodes if isinstance(node, torch._C._FunctionBase))
    roles = {node: role for node in python_nodes if (role := collective_role(node)) is not None}
    waits = {node for node, role in roles.items() if role == "wait"}
    wait_of = {}
    for node, role in roles.items():
        if role in ("launch", "lane") and waits and (wait := _nearest(node, waits)) is not None:
            wait_of[node] = wait
    return _Graph(nodes, position, producers, leaves, roles, wait_of)


def _nearest(start, targets: set) -> Any | None:
    """The first of ``targets`` a breadth-first walk down from ``start`` meets (a Req/Wait pair's wait)."""
    frontier, seen = [start], {start}
    while frontier:
        following = []
        for node in frontier:
            for next_node, _ in node.next_functions:
                if next_node is None or next_node in seen:
                    continue
                if next_node in targets:
                    return next_node
                seen.add(next_node)
                following.append(next_node)
        frontier = following
    return None


def _from_trace(graph: _Graph, events: list[dict]) -> tuple[tuple[str, ...] | None, tuple[Collective, ...]]:
    """The order and collectives of the outermost call in a torch_ext trace (None if it has no call)."""
    calls = [event for event in events if event["kind"] == "backward"]
    if not calls:
        return None, ()
    call = calls[0]
    start = call["start_ns"]
    mine = [event for event in events if event["backward_id"] == call["backward_id"]]
    node_of = {(node.name(), node._sequence_nr()): node for node in graph.nodes}
    labels, collectives = [], []
    event_of_node = {}
    for event in mine:
        if event["kind"] != "node":
            continue
        node = node_of.get((event["name"], event["sequence_nr"])) if event["sequence_nr"] >= 0 else None
        labels.append(graph.label(node) if node is not None else event["name"])
        if node is not None:
            event_of_node[node] = event
    for event in mine:
        if event["kind"] != "node":
            continue
        node = node_of.get((event["name"], event["sequence_nr"])) if event["sequence_nr"] >= 0 else None
        role = graph.roles.get(node) if node is not None else None
        if not event["collective"] and role not in ("launch", "lane"):
            continue
        waits = [
            (wait["name"], _ms(wait["start_ns"] - start), _ms(wait["end_ns"] - start))
            for wait in mine
            if wait["kind"] == "collective_wait" and wait["wait_for"] == event["id"]
        ]
        paired = graph.wait_of.get(node)
        if paired in event_of_node:
            wait = event_of_node[paired]
            waits.append((graph.label(paired), _ms(wait["start_ns"] - start), _ms(wait["end_ns"] - start)))
        collectives.append(
            Collective(
                graph.label(node) if node is not None else event["name"],
                role or "launch",
                _ms(event["start_ns"] - start),
                _ms(event["end_ns"] - start),
                tuple(waits),
                beside_engine=event["thread"] != call["thread"],
            )
        )
    return tuple(labels), tuple(collectives)


def _ms(ns: int) -> float:
    return ns / 1e6
