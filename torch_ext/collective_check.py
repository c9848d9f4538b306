"""The collective order check: every rank issues the same collectives in the same order, or every rank raises.

On every rank, the collectives of one process group must be issued in the same order, or gloo and NCCL hang
(or mix up data). torch_ext keeps its order the same on ranks that have the same graph and priorities; what
breaks it is a graph or a priority that differs by rank. A backward's plan fixes, before any node runs, every
collective it will start and their order (its own ops, PyTorch's functional collectives, TorchRec's launches,
lane nodes). With the check on, the ranks exchange a fingerprint of that whole sequence over a gloo group of
their own, once per backward: for each collective, the node's name, its place in the sequence, which
collective it is (its index among the call's collective nodes in the order forward made them), the ranks of
its group where the node says (``ctx.group``), and the shapes and dtypes of the gradients it will be given.
A mismatch raises on every rank before any of them starts a collective of that backward, naming the first
collective that differs and each rank's sequence up to it, where the collective itself would have hung or
mixed up data.

The identity matters most where the shapes agree: two all_to_alls of one shape (an MoE layer's dispatch and
combine) started in opposite orders on two ranks do not hang; gloo and NCCL pair them and mix up the data.
Their kinds match, but one rank starts forward's first and the other forward's second. The index counts
collective nodes only, so autograd work one rank does outside them (logging, metrics) does not shift it.

The exchange leaves the engine thread: it starts on a worker thread when the plan is made, and only the thread
that starts the backward's first collective waits for it (a lane, which would wait for the other ranks in
that collective anyway; the engine thread when the engine issues the collective itself), so it is cheap
enough to leave on (benchmarks/moe_sync.py measures it). Switch it on with :func:`check_collective_order`, or
with ``TORCH_EXT_CHECK_COLLECTIVES=1`` in every rank's environment (read when torch_ext is imported). Only
what torch_ext runs is checked: collectives issued outside its engine, or by hooks, are not seen, nor those
of split backward's passes.
"""

from __future__ import annotations

import datetime
import hashlib
import queue
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from torch_ext._api import deprecated
from torch_ext._loader import _C, switch_on

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


def _fingerprint(node: Any, position: int, identity: int, gradients: list | None) -> tuple:
    """``gradients``: the (shape, dtype) of each gradient the node will be given, None for one the engine cannot
    describe (a nested tensor's)."""
    if node is None:
        return ("end of backward", position)
    name = node if isinstance(node, str) else node.name()
    described = tuple(None if g is None else (tuple(g[0]), str(g[1]).removeprefix("torch.")) for g in gradients or ())
    return (name, position, identity, _group_ranks(node), described)


def _describe(fingerprint: tuple) -> str:
    if fingerprint[0] == "end of backward":
        return f"end of backward after {fingerprint[1]} collective(s)"
    name, position, identity, ranks, gradients = fingerprint
    where = "" if ranks is None else f" on ranks {list(ranks)}"
    shapes = ", ".join("nested" if g is None else f"{g[1]}{list(g[0])}" for g in gradients)
    return f"#{position} {name} (forward's collective #{identity}){where} given ({shapes})"


class _Checker:
    """The checker the engine calls (csrc/collectives/collective_nodes.cpp): ``begin`` with a call's collective
    sequence when its plan is made, on the thread running backward; ``wait`` before the call's first collective
    starts (on that thread or a lane's) and before the call returns. Both with the GIL.

    The exchange runs on a worker thread of the checker's own, one call's after another in the order the calls
    began (the same on every rank), so the engine thread never waits for the other ranks to arrive: only the
    thread that starts the first collective waits, and a lane would wait for them in that collective anyway.
    """

    def __init__(self, group: Any | None, timeout: datetime.timedelta | None) -> None:
        self._group = group
        self._timeout = timeout
        self._exchanges: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
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

    def begin(self, collectives: list[tuple[Any, int, list]]) -> Future:
        """Starts comparing one call's collective sequence, ``(node, identity, expected gradients)`` in the order
        the call will start them, with the other ranks'; returns what ``wait`` takes."""
        fingerprints = [
            _fingerprint(node, position, identity, gradients)
            for position, (node, identity, gradients) in enumerate(collectives)
        ]
        fingerprints.append(_fingerprint(None, len(collectives), -1, None))
        # Made here, on the calling thread: new_group is itself collective, in program order.
        group = self._check_group()
        pending: Future = Future()
        self._exchanges.put((pending, group, fingerprints))
        if self._worker is None:
            self._worker = threading.Thread(target=self._exchange_forever, name="torch_ext order check", daemon=True)
            self._worker.start()
        return pending

    def wait(self, pending: Future) -> None:
        """Raises the mismatch ``begin``'s exchange found, the same message on every rank."""
        mismatch = pending.result()
        if mismatch is not None:
            raise RuntimeError(mismatch)

    def _exchange_forever(self) -> None:
        while True:
            pending, group, fingerprints = self._exchanges.get()
            try:
                pending.set_result(self._exchange(group, fingerprints))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                pending.set_exception(error)

    def _exchange(self, group: Any, fingerprints: list[tuple]) -> str | None:
        # One all_gather of an 8-byte digest when the ranks agree (all_gather_object is two collectives and a
        # pickle); the fingerprints themselves only to name a mismatch, which every rank sees in the digests, so
        # every rank's worker takes part, whatever its engine thread is doing.
        digest = hashlib.blake2b(repr(fingerprints).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(digests, mine, group=group)
        self.exchanges += 1
        if all(torch.equal(theirs, mine) for theirs in digests):
            return None
        gathered: list = [None] * len(digests)
        dist.all_gather_object(gathered, fingerprints, group=group)
        for position in range(max(len(theirs) for theirs in gathered)):
            at_position = [theirs[min(position, len(theirs) - 1)] for theirs in gathered]
            if any(theirs != at_position[0] for theirs in at_position):
                return _mismatch_message(dist.get_process_group_ranks(group), gathered, position)
        # Equal fingerprints with unequal digests cannot happen: repr is deterministic.
        raise AssertionError("torch_ext: the order check's digests differ but its fingerprints agree")


def _mismatch_message(ranks: list[int], gathered: list[list[tuple]], position: int) -> str:
    lines = [f"torch_ext: the ranks disagree on collective #{position} of this backward (collective order check):"]
    for rank, theirs in zip(ranks, gathered, strict=True):
        lines.append(f"  rank {rank}: {_describe(theirs[min(position, len(theirs) - 1)])}")
    lines.append("each rank's collectives before it:")
    for rank, theirs in zip(ranks, gathered, strict=True):
        lines.append(f"  rank {rank}: " + ("; ".join(_describe(f) for f in theirs[:position]) or "none"))
    lines.append(
        "Issued, these would hang or mix up data. A graph or a priority that differs by rank (data-dependent "
        "routing, set_priority called on one rank) reorders them."
    )
    return "\n".join(lines)


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


def collective_check_count() -> int:
    """How many exchanges the check made in this process since it was switched on (0 when off): one for each
    backward that ran its collectives in sequence."""
    return 0 if _checker is None else _checker.exchanges


collective_checks = deprecated(
    "torch_ext.collective_checks", "torch_ext.collective_check_count", collective_check_count
)


if switch_on(ENVIRONMENT_VARIABLE):
    check_collective_order()
