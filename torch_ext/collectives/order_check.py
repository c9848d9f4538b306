"""The collective order check: the ranks of each group issue its collectives in the same order, or they raise.

On every rank, the collectives of one process group must be issued in the same order, or gloo and NCCL hang
(or mix up data). torch_ext keeps its order the same on ranks that have the same graph and priorities; what
breaks it is a graph or a priority that differs by rank. A backward's plan fixes, before any node runs, every
collective it will start and their order (its own ops, PyTorch's functional collectives, TorchRec's launches,
lane nodes; in split backward's passes too). With the check on, the members of each group those collectives
use compare, once per backward, the part of that sequence they all see: the collectives on that group and on
every group containing it, in order. Each collective is named by its node's name, which collective it is (its
index among the call's collectives on its group, in the order forward made them), its group's id (the same
on every rank for the same ranks, computed once: ``torch_ext.collectives.group_mirrors``), and the shapes and
dtypes of the gradients it will be given. A mismatch raises on every member of that group before any
collective of that group starts, or any hook of that backward runs, naming the two ranks and the first
collective they disagree on, where the collective itself would have hung or mixed up data.

The identity matters most where the shapes agree: two all_to_alls of one shape (an MoE layer's dispatch and
combine) started in opposite orders on two ranks do not hang; gloo and NCCL pair them and mix up the data.
Their kinds match, but one rank starts forward's first and the other forward's second. The index counts
collective nodes only, so autograd work one rank does outside them (logging, metrics) does not shift it.

The exchange leaves the engine thread and stays within each group: for each group the backward's collectives
use, an asynchronous all_reduce (min) of a 16-byte digest pair over that group's gloo mirror, started when the
plan is made, and awaited by the thread that starts the backward's first collective or runs its first hook.
Its cost per backward grows with the number of groups used, not with their sizes nor with the world's, and no
rank waits for one outside the groups it communicates with (docs/guides/moe.md has the figures at 8 to 8,192
ranks, from benchmarks/order_check_scale.py). The price: a rank outside the group that disagrees learns of it
only when it next meets a raising rank in another collective, and that collective fails with the process
group's own error (a timeout, or the peer's connection closed), as any collective with a rank that left it
does. Switch the check on with :func:`check_collective_order`, or with ``TORCH_EXT_CHECK_COLLECTIVES=1`` in
every rank's environment (read when torch_ext is imported). Only what torch_ext runs is checked: collectives
issued outside its engine, or by hooks, are not seen.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torch_ext._loader import _C
from torch_ext.collectives.group_mirrors import Group, GroupMirrors
from torch_ext.collectives.lanes import _GROUP_OF

# Every group's mirror, made at its first use (group_mirrors.py) and kept for the next checker: a mirror made
# again would reuse its store keys.
_MIRRORS = GroupMirrors()
# Before the interpreter finalizes, while their worker threads can still take the GIL.
atexit.register(_MIRRORS.forget)


def _process_group(node: Any) -> Any:
    """The process group ``node``'s collective runs on, None where the node does not say (a C++ node, a ctx
    without a group): the group a lane would use for a declared class, else ``ctx.group``, else the group a
    ``torch.library`` formula saved by name (``ctx.group_name``)."""
    if isinstance(node, str):
        return None
    find = _GROUP_OF.get(type(node))
    try:
        if find is not None:
            return find(node)
        group = getattr(node, "group", None)
        name = getattr(node, "group_name", None)
        if group is None and isinstance(name, str):
            group = dist.distributed_c10d._resolve_process_group(name)
        return group
    except (KeyError, ValueError, RuntimeError):
        return None


def _fingerprint(node: Any, position: int, identity: int, group: Group, gradients: list) -> tuple:
    """``group``: its group's; ``gradients``: the (shape, dtype) of each gradient the node will be given, None
    for one the engine cannot describe (a nested tensor's)."""
    name = node if isinstance(node, str) else node.name()
    described = tuple(None if g is None else (tuple(g[0]), _dtype_name(g[1])) for g in gradients)
    return (name, position, identity, group.id, described)


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(fingerprint: tuple, groups: dict[int, tuple[int, ...]]) -> str:
    if fingerprint[0] == "end of backward":
        return f"end of backward after {fingerprint[1]} collective(s)"
    name, position, identity, group_id, gradients = fingerprint
    shapes = ", ".join("nested" if g is None else f"{g[1]}{list(g[0])}" for g in gradients)
    where = Group(group_id, groups[group_id]).describe()
    return f"#{position} {name} (forward's collective #{identity} on its group) on {where} given ({shapes})"


def _seen_by(fingerprints: list[tuple], group: Group, groups: dict[int, Group]) -> list[tuple]:
    """What every member of ``group`` must agree on: the collectives on groups containing it (each member sees
    all of those), in order, without their place in the whole sequence (collectives on other groups may come
    between), and the end of backward."""
    seen = [
        (name, identity, group_id, gradients)
        for name, _, identity, group_id, gradients in fingerprints[:-1]
        if group.within(groups[group_id])
    ]
    return [*seen, ("end of backward", len(seen))]


def _digest(value: object) -> int:
    # repr of tuples of str, int and None is the same in every process, unlike hash() of a str.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _with_identities_per_group(collectives: list[tuple[Any, int, list]], groups: list[Group]) -> list[tuple]:
    """The fingerprints, each collective's identity its index among the call's collectives on its group in the order
    forward made them (the engine gives each one's sequence_nr): a rank with more collectives on a group another
    rank is not in, or more autograd work outside collectives, does not shift the identities they share."""
    by_group: dict[int, list] = {}
    for index, (_, created, _) in enumerate(collectives):
        by_group.setdefault(groups[index].id, []).append((created, index))
    identity = [0] * len(collectives)
    for members in by_group.values():
        for place, (_, index) in enumerate(sorted(members)):
            identity[index] = place
    fingerprints = [
        _fingerprint(node, position, identity[position], groups[position], gradients)
        for position, (node, _, gradients) in enumerate(collectives)
    ]
    return [*fingerprints, ("end of backward", len(collectives))]


def _all_gather_object(mirror: Any, value: object) -> list:
    """``value`` from every member of ``mirror`` (a ProcessGroupGloo that torch.distributed's own
    all_gather_object cannot take: it is not registered), in group-rank order."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(mirror.size())]
    mirror.allgather([sizes], [size]).wait()
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    mirror.allgather([gathered], [padded]).wait()
    return [pickle.loads(g[: int(s)].numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)]


def _minimum() -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


@dataclass
class _GroupExchange:
    """One group's comparison in flight: ``compared`` is ``[d, ~d]`` of this rank's digest ``d``, reduced in place
    to ``[min d, ~max d]`` over the group's members; they agree when ``min d == max d``."""

    group: Group
    compared: torch.Tensor
    work: Any
    # None until waited for, then whether the members agree.
    agreed: bool | None = None

    def verdict(self) -> bool:
        """Waits for the exchange (the GIL released) and says whether the members agree."""
        if self.agreed is None:
            try:
                self.work.wait()
            except Exception as error:
                error.add_note(
                    f"torch_ext: raised by the collective order check's exchange over the gloo mirror of "
                    f"{self.group.describe()}, before any collective of this backward on that group started: a "
                    "rank of that group is gone or did not reach this backward in time"
                )
                raise
            self.agreed = int(self.compared[0]) == ~int(self.compared[1])
        return self.agreed


@dataclass
class _Exchange:
    """One call's exchanges in flight, one per group its collectives use (in the groups' order), and what naming
    a mismatch needs."""

    fingerprints: list[tuple]
    # Each collective's group, in the call's order.
    collective_groups: list[Group]
    groups: dict[int, Group]
    exchanges: list[_GroupExchange]
    # The overlapped backward's (microbatch, forward's rule), from the call's context; None for a backward that
    # torch_ext.overlap_microbatches did not hand over.
    overlap: tuple | None
    # None while a verdict is missing, "" when every group agrees, else the mismatch (or the exchange's error).
    outcome: str | BaseException | None = None
    # Held while a mismatch is named: two threads of this rank (the engine's, a lane's) must not both name it.
    naming: threading.Lock = field(default_factory=threading.Lock)


class _Checker:
    """The checker the engine calls (csrc/bindings/python_collectives.cpp): ``begin`` with a call's collective
    sequence when its plan is made, on the thread running backward; ``wait`` before each collective starts (on
    that thread or a lane's), before the first hook runs and when the call ends, however it ends. Both with the
    GIL.

    ``begin`` starts, for each group the call's collectives use, an asynchronous all_reduce of the digest of what
    that group's members must agree on (:func:`_seen_by`) over the group's mirror, and returns: the engine thread
    never waits for the other ranks to arrive. A call's exchanges start in one order (by the groups' ranks), and
    calls begin in the order their backwards do, on the calling thread, which is the same on every rank.
    """

    def __init__(self, timeout: datetime.timedelta | None) -> None:
        self._timeout = timeout
        self.exchanges = 0
        # The digests' bytes this rank put into exchanges, for benchmarks/order_check_scale.py.
        self.bytes_sent = 0

    def _group_of(self, node: Any) -> Group:
        """The group ``node``'s collective is compared over: its own, or the world's where the check cannot see
        it (a C++ node, a ctx without a group, a backend made by hand), as a group of everyone."""
        group = _process_group(node)
        known = None if group is None else _MIRRORS.of(group, self._timeout)
        return known or _MIRRORS.of(dist.distributed_c10d._get_default_group(), self._timeout)

    def begin(self, collectives: list[tuple[Any, int, list]], overlap: tuple[int, str] | None) -> _Exchange:
        """Starts comparing one call's collective sequence, ``(node, sequence_nr, expected gradients)`` in the
        order the call will start them, with the other ranks'; returns what ``wait`` takes. ``overlap``: the
        call's ``(microbatch, forward_collectives)`` when it is a backward that torch_ext.overlap_microbatches
        handed over (the engine passes it from the call's context), else None."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch_ext: the collective order check needs torch.distributed initialized "
                "(init_process_group) before the first backward that issues a collective"
            )
        _MIRRORS.forget_another_world()
        groups = [self._group_of(node) for node, _, _ in collectives]
        fingerprints = _with_identities_per_group(collectives, groups)
        by_id = {group.id: group for group in groups}
        # A backward that runs beside the next forward (torch_ext.overlap_microbatches): the ranks must also agree
        # on which microbatch it is and on the rule for the forward's collectives, or the two threads' collectives
        # would interleave differently by rank.
        exchanges = []
        for group in sorted(by_id.values(), key=lambda group: group.ranks):
            digest = _digest((overlap, _seen_by(fingerprints, group, by_id)))
            compared = torch.tensor([digest, ~digest], dtype=torch.int64)
            exchanges.append(_GroupExchange(group, compared, group.mirror.allreduce([compared], _minimum())))
            self.bytes_sent += compared.nbytes
        self.exchanges += 1
        return _Exchange(fingerprints, groups, by_id, exchanges, overlap)

    def wait(self, exchange: _Exchange, collective: int | None = None) -> bool:
        """Raises the mismatch ``begin``'s exchanges found, the same on every member of the group that disagrees.
        With ``collective`` (its index in the call's sequence), only the verdicts that collective needs: its
        group's and those of the groups nested with it (containing it or contained in it), whose members it may
        meet in that collective; without, every verdict (before a hook, which may communicate on any group, and
        when the call ends). The engine calls it for every exchange it began, also when the call failed first:
        a mismatch is named with a second exchange that every member of that group takes part in.

        Returns whether every group's verdict is in and agrees: the engine then asks no more for this call (each
        question takes the GIL, which a lane may wait milliseconds for)."""
        if exchange.outcome is None:
            if collective is None:
                needed = exchange.exchanges
            else:
                group = exchange.collective_groups[collective]
                needed = [e for e in exchange.exchanges if e.group.within(group) or group.within(e.group)]
            try:
                if all(e.verdict() for e in needed):
                    if all(e.agreed for e in exchange.exchanges):
                        exchange.outcome = ""
                    return exchange.outcome == ""
                self._name_mismatches(exchange)
            except Exception as error:  # noqa: BLE001 - kept, and raised again by every later wait of this call
                exchange.outcome = exchange.outcome or error
        if isinstance(exchange.outcome, BaseException):
            raise exchange.outcome
        if exchange.outcome:
            raise RuntimeError(exchange.outcome)
        return True

    def _name_mismatches(self, exchange: _Exchange) -> None:
        """Names every disagreeing group's mismatch, in the exchanges' order, once for this rank: the members of
        each take part in naming it, whichever of their threads found it first."""
        with exchange.naming:
            if exchange.outcome is not None:
                return
            # Every verdict first: a rank names the groups that disagree in one order, the same on every rank.
            disagreeing = [e.group for e in exchange.exchanges if not e.verdict()]
            mismatches = [self._name_mismatch(exchange, group) for group in disagreeing]
            exchange.outcome = mismatches[0]

    @staticmethod
    def _name_mismatch(exchange: _Exchange, group: Group) -> str:
        mine = (exchange.overlap, exchange.fingerprints, {g.id: g.ranks for g in exchange.groups.values()})
        gathered = _all_gather_object(group.mirror, mine)
        overlaps = [overlap for overlap, _, _ in gathered]
        if len(set(overlaps)) > 1:
            return _overlap_mismatch_message(list(group.ranks), overlaps)
        ranks_of = {group_id: ranks for _, _, known in gathered for group_id, ranks in known.items()}
        groups = {group_id: Group(group_id, ranks) for group_id, ranks in ranks_of.items()}
        seen = [_seen_by(fingerprints, group, groups) for _, fingerprints, _ in gathered]
        # The first member that disagrees with the group's first.
        for member in range(1, len(group.ranks)):
            for place in range(max(len(seen[0]), len(seen[member]))):
                ours = seen[0][min(place, len(seen[0]) - 1)], seen[member][min(place, len(seen[member]) - 1)]
                if ours[0] != ours[1]:
                    pair = (group.ranks[0], group.ranks[member])
                    sequences = (gathered[0][1], gathered[member][1])
                    return _mismatch_message(pair, sequences, (seen[0], seen[member]), place, ranks_of)
        # Equal sequences with unequal digests cannot happen: repr is deterministic. (A 64-bit digest hides a
        # divergence with probability 2^-64.)
        raise AssertionError("torch_ext: the order check's digests differ but the ranks' collectives agree")


def _position(seen: tuple, sequence: list[tuple]) -> tuple:
    """The full fingerprint of ``seen`` (one of :func:`_seen_by`'s) in ``sequence``."""
    if seen[0] == "end of backward":
        return sequence[-1]
    name, identity, group_id, gradients = seen
    return next(f for f in sequence[:-1] if (f[0], f[2], f[3], f[4]) == (name, identity, group_id, gradients))


def _mismatch_message(
    pair: tuple[int, int], sequences: tuple[list, list], seen: tuple[list, list], place: int, groups: dict
) -> str:
    lines = [
        (
            f"torch_ext: the ranks disagree on collective #{place} of this backward on the groups ranks {pair[0]} "
            f"and {pair[1]} share (collective order check):"
        )
    ]
    for rank, sequence, theirs in zip(pair, sequences, seen, strict=True):
        lines.append(f"  rank {rank}: {_describe(_position(theirs[min(place, len(theirs) - 1)], sequence), groups)}")
    lines.append("each rank's collectives on those groups before it:")
    for rank, sequence, theirs in zip(pair, sequences, seen, strict=True):
        before = [_describe(_position(f, sequence), groups) for f in theirs[:place]]
        lines.append(f"  rank {rank}: " + ("; ".join(before) or "none"))
    lines.append(
        "Issued, these would hang or mix up data. A graph or a priority that differs by rank (data-dependent "
        "routing, set_priority called on one rank) reorders them."
    )
    return "\n".join(lines)


def _overlap_mismatch_message(ranks: list[int], overlaps: list[tuple | None]) -> str:
    def describe(overlap: tuple | None) -> str:
        if overlap is None:
            return "a backward not run beside a forward"
        microbatch, rule = overlap
        how = {
            "after_backward": "waiting for the whole backward",
            "after_backward_collectives": "waiting for its planned collectives",
            "in_turns_with_backward_collectives": "taking turns with its planned collectives",
            "beside_backward_collectives": "beside its planned collectives, which go to twin groups",
        }[rule]
        return f"the backward of microbatch {microbatch}, the next forward's collectives {how}"

    lines = ["torch_ext: the ranks disagree on the microbatch overlap of this backward (collective order check):"]
    lines += [f"  rank {rank}: {describe(overlap)}" for rank, overlap in zip(ranks, overlaps, strict=True)]
    lines.append(
        "The two threads' collectives would interleave differently by rank. A forward saves the RNG state (an "
        "activation checkpoint) on some ranks only, or a rank overlaps microbatches another does not."
    )
    return "\n".join(lines)


_checker: _Checker | None = None


def check_collective_order(enabled: bool = True, *, timeout: datetime.timedelta | None = None) -> None:
    """Switches the collective order check on (or off, with ``enabled=False``) for this process.

    Call it the same way on every rank. Each group is compared over a gloo mirror of its ranks, made the first
    time a backward uses the group (``torch_ext.collectives.group_mirrors``: making one waits for no other rank).

    Args:
        enabled: on or off.
        timeout: how long a rank waits for the others of a group to reach the same backward's check (a rank
            whose backward has no collective on that group, or that died, never does). By default each group's
            own timeout.
    """
    global _checker
    _checker = _Checker(timeout) if enabled else None
    _C.set_collective_checker(_checker)


def collective_check_count() -> int:
    """How many exchanges the check made in this process since it was switched on (0 when off): one for each
    backward that ran its collectives in sequence."""
    return 0 if _checker is None else _checker.exchanges
