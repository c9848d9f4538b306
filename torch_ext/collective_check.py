"""The collective order check: every rank issues the same collectives in the same order, or every rank raises.

On every rank, the collectives of one process group must be issued in the same order, or gloo and NCCL hang
(or mix up data). torch_ext keeps its order the same on ranks that have the same graph and priorities; what
breaks it is a graph or a priority that differs by rank. With the check on, before torch_ext starts each
collective it knows of (its own ops, PyTorch's functional collectives, TorchRec's launches, lane nodes), and
at the end of each backward that issued any, the ranks exchange a fingerprint of it over a gloo group of
their own: the node's name, its place in the call's sequence of collectives, the ranks of its group where
the node says (``ctx.group``), and the shapes and dtypes of the gradients it was given. A mismatch raises
on every rank, naming the first collective that differs and each rank's sequence up to it, where the
collective itself would have hung or mixed up data.

Like ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for c10d, it is a debugging aid: each collective costs one small
extra exchange (benchmarks/moe_sync.py measures it). Switch it on with :func:`check_collective_order`, or
with ``TORCH_EXT_CHECK_COLLECTIVES=1`` in every rank's environment (read when torch_ext is imported). Only
what torch_ext runs is checked: collectives issued outside its engine, or by hooks, are not seen.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any

import torch.distributed as dist

from torch_ext.collectives import _C

ENVIRONMENT_VARIABLE = "TORCH_EXT_CHECK_COLLECTIVES"


def _group_ranks(node: Any) -> tuple[int, ...] | None:
    group = getattr(node, "group", None)
    if group is None:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, TypeError, AttributeError):
        # A backend made by hand (not registered with c10d) has no ranks to name: its size stands in.
        size = getattr(group, "size", None)
        return (-1, size()) if callable(size) else None


def _fingerprint(node: Any, position: int, inputs: list | None) -> tuple:
    if node is None:
        return ("end of backward", position)
    name = node if isinstance(node, str) else node.name()
    gradients = tuple(
        None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in inputs or ()
    )
    return (name, position, _group_ranks(node), gradients)


def _describe(fingerprint: tuple) -> str:
    if fingerprint[0] == "end of backward":
        return f"end of backward after {fingerprint[1]} collective(s)"
    name, position, ranks, gradients = fingerprint
    where = "" if ranks is None else f" on ranks {list(ranks)}"
    shapes = ", ".join("undefined" if g is None else f"{g[1]}{list(g[0])}" for g in gradients)
    return f"#{position} {name}{where} given ({shapes})"


class _Checker:
    """The checker the engine calls (csrc/bindings/python_collectives.cpp), with the GIL, on the thread running backward."""

    def __init__(self, group: Any | None, timeout: datetime.timedelta | None) -> None:
        self._group = group
        self._timeout = timeout
        # The collectives this thread's current backward issued so far: each rank's, for the error message.
        self._local = threading.local()
        self.exchanges = 0

    def _check_group(self) -> Any:
        if self._group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch_ext: the collective order check needs torch.distributed initialized "
                    "(init_process_group) before the first backward that issues a collective"
                )
            # Its own gloo group: exchanging on the group a lane is using could itself reorder collectives.
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def __call__(self, node: Any, position: int, inputs: list | None) -> None:
        fingerprint = _fingerprint(node, position, inputs)
        history = getattr(self._local, "history", [])
        if position == 0 and node is not None:
            history = []
        group = self._check_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (fingerprint, history), group=group)
        self.exchanges += 1
        history = [*history, fingerprint]
        self._local.history = [] if node is None else history
        if all(theirs == fingerprint for theirs, _ in gathered):
            return
        ranks = dist.get_process_group_ranks(group)
        lines = [f"torch_ext: the ranks disagree on collective #{position} of this backward (collective order check):"]
        for rank, (theirs, _) in zip(ranks, gathered, strict=True):
            lines.append(f"  rank {rank}: {_describe(theirs)}")
        lines.append("each rank's collectives before it:")
        for rank, (_, seen) in zip(ranks, gathered, strict=True):
            lines.append(f"  rank {rank}: " + ("; ".join(_describe(f) for f in seen) or "none"))
        lines.append(
            "Issued, these would hang or mix up data. A graph or a priority that differs by rank (data-dependent "
            "routing, set_priority called on one rank) reorders them."
        )
        raise RuntimeError("\n".join(lines))


_checker: _Checker | None = None


def check_collective_order(
    enabled: bool = True, *, group: Any | None = None, timeout: datetime.timedelta | None = None
) -> None:
    """Switches the collective order check on (or off, with ``enabled=False``) for this process.

    Args:
        enabled: on or off. Call it the same way on every rank.
        group: the process group the ranks exchange fingerprints over; by default a gloo group of all ranks,
            made (``torch.distributed.new_group``) at the first check. Not the group of a lane.
        timeout: that group's timeout: how long a rank waits for another to reach the same check (a rank
            that issued fewer collectives never does). By default the process group default.
    """
    global _checker
    _checker = _Checker(group, timeout) if enabled else None
    _C.set_collective_checker(_checker)


def collective_checks() -> int:
    """How many fingerprint exchanges the check made in this process since it was switched on (0 when off)."""
    return 0 if _checker is None else _checker.exchanges


if os.environ.get(ENVIRONMENT_VARIABLE, "0") not in ("", "0"):
    check_collective_order()
