"""The collective order check: every rank issues the same collectives in the same order, or every rank raises.

On every rank, the collectives of one process group must be issued in the same order, or gloo and NCCL hang
(or mix up data). torch_ext keeps its order the same on ranks that have the same graph and priorities; what
breaks it is a graph or a priority that differs by rank. A backward's plan fixes, before any node runs, every
collective it will start and their order (its own ops, PyTorch's functional collectives, TorchRec's launches,
lane nodes; in split backward's passes too). With the check on, the ranks compare that whole sequence once
per backward, over a gloo group of their own. Each collective is named by its node's name, which collective it
is (its index among the call's collectives on its group, in the order forward made them), its group's ranks
where the node says (``ctx.group``), and the shapes and dtypes of the gradients it will be given. Two ranks
must agree, in order, on the collectives of the groups they share (ranks of different expert-parallel groups
need not). A mismatch raises on every rank before any of them starts a collective, or runs a hook, of that
backward, naming the two ranks and the first collective they disagree on, where the collective itself would
have hung or mixed up data.

The identity matters most where the shapes agree: two all_to_alls of one shape (an MoE layer's dispatch and
combine) started in opposite orders on two ranks do not hang; gloo and NCCL pair them and mix up the data.
Their kinds match, but one rank starts forward's first and the other forward's second. The index counts
collective nodes only, so autograd work one rank does outside them (logging, metrics) does not shift it.

The exchange leaves the engine thread: an asynchronous all_gather of an 8-byte digest per rank, started when
the plan is made, and awaited by the thread that starts the backward's first collective (a lane, which would
wait for the other ranks in that collective anyway; the engine thread when the engine issues the collective
itself) or runs its first hook. It costs about 0.2 ms of the engine thread per backward and is cheap enough to
leave on (benchmarks/moe_sync.py measures it; docs/guides/moe.md has the figures). Switch it on with
:func:`check_collective_order`, or with ``TORCH_EXT_CHECK_COLLECTIVES=1`` in every rank's environment (read
when torch_ext is imported). Only what torch_ext runs is checked: collectives issued outside its engine, or by
hooks, are not seen.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_ext import microbatches as _microbatches
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


def _fingerprint(node: Any, position: int, identity: int, ranks: tuple | None, gradients: list) -> tuple:
    """``ranks``: its group's (:func:`_group_ranks`); ``gradients``: the (shape, dtype) of each gradient the node
    will be given, None for one the engine cannot describe (a nested tensor's)."""
    name = node if isinstance(node, str) else node.name()
    described = tuple(None if g is None else (tuple(g[0]), str(g[1]).removeprefix("torch.")) for g in gradients)
    return (name, position, identity, ranks, described)


def _describe(fingerprint: tuple) -> str:
    if fingerprint[0] == "end of backward":
        return f"end of backward after {fingerprint[1]} collective(s)"
    name, position, identity, ranks, gradients = fingerprint
    where = "" if ranks is None else f" on ranks {list(ranks)}"
    shapes = ", ".join("nested" if g is None else f"{g[1]}{list(g[0])}" for g in gradients)
    return f"#{position} {name} (forward's collective #{identity} on its group){where} given ({shapes})"


def _shared_with(fingerprints: list[tuple], rank: int) -> list[tuple]:
    """What ``rank`` must agree on with this rank: the collectives on groups it is in (a group whose ranks are
    unknown counts as everyone's), in this rank's order, without their place in this rank's whole sequence
    (collectives on groups ``rank`` is not in may come between), and the end of backward."""
    shared = []
    for fingerprint in fingerprints[:-1]:
        name, _, identity, ranks, gradients = fingerprint
        if ranks is None or ranks[0] == -1 or rank in ranks:
            shared.append((name, identity, ranks, gradients))
    return [*shared, ("end of backward", len(shared))]


def _digest(value: object) -> int:
    # repr of tuples of str, int and None is the same in every process, unlike hash() of a str.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _with_identities_per_group(collectives: list[tuple[Any, int, list]]) -> list[tuple]:
    """The fingerprints, each collective's identity its index among the call's collectives on its group in the order
    forward made them (the engine gives each one's sequence_nr): a rank with more collectives on a group another
    rank is not in, or more autograd work outside collectives, does not shift the identities they share."""
    ranks = [_group_ranks(node) for node, _, _ in collectives]
    by_group: dict = {}
    for index, (_, created, _) in enumerate(collectives):
        by_group.setdefault(ranks[index], []).append((created, index))
    identity = [0] * len(collectives)
    for members in by_group.values():
        for place, (_, index) in enumerate(sorted(members)):
            identity[index] = place
    fingerprints = [
        _fingerprint(node, position, identity[position], ranks[position], gradients)
        for position, (node, _, gradients) in enumerate(collectives)
    ]
    return [*fingerprints, ("end of backward", len(collectives))]


@dataclass
class _Exchange:
    """One call's exchange in flight: its digests' all_gather, and what naming a mismatch needs."""

    group: Any
    fingerprints: list[tuple]
    digests: torch.Tensor
    gathered: list[torch.Tensor]
    work: Any
    # The overlapped backward's (microbatch, forward's rule), None outside torch_ext.overlap_microbatches.
    overlap: tuple | None
    # The first wait's outcome: None while not waited on, "" when the ranks agree, else the mismatch.
    outcome: str | None = None


class _Checker:
    """The checker the engine calls (csrc/bindings/python_collectives.cpp): ``begin`` with a call's collective
    sequence when its plan is made, on the thread running backward; ``wait`` before the call's first collective
    or hook runs (on that thread or a lane's) and when the call ends, however it ends. Both with the GIL.

    Two ranks must agree on the collectives of the groups they share, in order: ranks of an expert-parallel
    group on its all_to_alls, but not on another EP group's. So each rank sends, for every rank, a digest of its
    sequence as that rank must see it (:func:`_shared_with`), and rank r agrees with rank q when r's digest for q
    is q's digest for r. ``begin`` starts that asynchronous all_gather and returns: the engine thread never waits
    for the other ranks to arrive. The exchanges are started in the order the calls begin, on the calling
    thread, which is the same on every rank.
    """

    def __init__(self, group: Any | None, timeout: datetime.timedelta | None) -> None:
        self._group = group
        self._timeout = timeout
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

    def begin(self, collectives: list[tuple[Any, int, list]]) -> _Exchange:
        """Starts comparing one call's collective sequence, ``(node, sequence_nr, expected gradients)`` in the
        order the call will start them, with the other ranks'; returns what ``wait`` takes."""
        fingerprints = _with_identities_per_group(collectives)
        # A backward that runs beside the next forward (torch_ext.overlap_microbatches): the ranks must also agree
        # on which microbatch it is and on the rule for the forward's collectives, or the two threads' collectives
        # would interleave differently by rank.
        overlap = _microbatches.handed_backward()
        group = self._check_group()
        ranks = dist.get_process_group_ranks(group)
        digests = torch.tensor(
            [_digest((overlap, _shared_with(fingerprints, rank))) for rank in ranks], dtype=torch.int64
        )
        gathered = [torch.empty_like(digests) for _ in ranks]
        work = dist.all_gather(gathered, digests, group=group, async_op=True)
        self.exchanges += 1
        return _Exchange(group, fingerprints, digests, gathered, work, overlap)

    def wait(self, exchange: _Exchange) -> None:
        """Raises the mismatch ``begin``'s exchange found, the same message on every rank. The engine calls it for
        every exchange it began, also when the call failed first: a mismatch is named with a second exchange that
        every rank takes part in."""
        if exchange.outcome is None:
            try:
                exchange.work.wait()
            except Exception as error:
                error.add_note(
                    "torch_ext: raised by the collective order check's exchange (over its own group), before any "
                    "collective of this backward started: a rank is gone or did not reach this backward in time"
                )
                raise
            matrix = torch.stack(exchange.gathered)  # [r][q]: rank r's digest for rank q
            exchange.outcome = "" if torch.equal(matrix, matrix.T) else self._name_mismatch(exchange)
        if exchange.outcome:
            raise RuntimeError(exchange.outcome)

    @staticmethod
    def _name_mismatch(exchange: _Exchange) -> str:
        gathered: list = [None] * len(exchange.gathered)
        dist.all_gather_object(gathered, (exchange.overlap, exchange.fingerprints), group=exchange.group)
        ranks = dist.get_process_group_ranks(exchange.group)
        overlaps = [overlap for overlap, _ in gathered]
        gathered = [fingerprints for _, fingerprints in gathered]
        if len(set(overlaps)) > 1:
            return _overlap_mismatch_message(ranks, overlaps)
        for i, rank in enumerate(ranks):
            for j in range(i + 1, len(ranks)):
                mine, theirs = _shared_with(gathered[i], ranks[j]), _shared_with(gathered[j], rank)
                for place in range(max(len(mine), len(theirs))):
                    ours = mine[min(place, len(mine) - 1)], theirs[min(place, len(theirs) - 1)]
                    if ours[0] != ours[1]:
                        return _mismatch_message((rank, ranks[j]), (gathered[i], gathered[j]), ours, place)
        # Equal sequences with unequal digests cannot happen: repr is deterministic. (A 64-bit digest hides a
        # divergence with probability 2^-64.)
        raise AssertionError("torch_ext: the order check's digests differ but the ranks' collectives agree")


def _position(shared: tuple, sequence: list[tuple]) -> tuple:
    """The full fingerprint of ``shared`` (one of :func:`_shared_with`'s) in ``sequence``."""
    if shared[0] == "end of backward":
        return sequence[-1]
    name, identity, ranks, gradients = shared
    return next(f for f in sequence[:-1] if (f[0], f[2], f[3], f[4]) == (name, identity, ranks, gradients))


def _mismatch_message(pair: tuple[int, int], sequences: tuple[list, list], shared: tuple, place: int) -> str:
    lines = [
        (
            f"torch_ext: the ranks disagree on collective #{place} of this backward on the groups ranks {pair[0]} "
            f"and {pair[1]} share (collective order check):"
        )
    ]
    for rank, sequence, fingerprint in zip(pair, sequences, shared, strict=True):
        lines.append(f"  rank {rank}: {_describe(_position(fingerprint, sequence))}")
    lines.append("each rank's collectives on those groups before it:")
    for rank, other, sequence in zip(pair, reversed(pair), sequences, strict=True):
        before = [_describe(_position(f, sequence)) for f in _shared_with(sequence, other)[:place]]
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


def check_collective_order(
    enabled: bool = True, *, group: Any | None = None, timeout: datetime.timedelta | None = None
) -> None:
    """Switches the collective order check on (or off, with ``enabled=False``) for this process.

    Args:
        enabled: on or off. Call it the same way on every rank.
        group: the process group the ranks exchange fingerprints over; by default a gloo group of all ranks,
            made (``torch.distributed.new_group``) at the first check. Not the group of a lane.
        timeout: that group's timeout: how long a rank waits for another to reach the same backward's check (a
            rank whose backward has no collective, or that died, never does). By default the process group
            default.
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
