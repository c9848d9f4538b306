"""Each process group's identity and its gloo mirror, for the collective order check.

The order check compares a backward's collectives among the members of each group they use, over a gloo
group of the same ranks: the group's *mirror*. Exchanging on the group itself could reorder its collectives
(a lane may be using it), and an NCCL group cannot carry a CPU exchange off the engine thread. A group is
known by an id every rank computes alike from its ranks, once, so a backward's fingerprints carry an integer
instead of a rank list, and the check's cost per backward does not grow with the group's size.

**Hang-free creation.** A mirror is a ``ProcessGroupGloo`` made from the default store under a prefix of its
own; only its members take part in making it (each waits in the store for the others), and it is not
registered with torch.distributed, so the user's groups and group counter are untouched. Two members that
made their mirrors in different orders could each wait for the other forever, so every rank makes the
mirrors of its groups in one global order, by rank list. That is deadlock-free: of the groups some rank
still waits on, take the least; each of its members has either made every lesser mirror of its own or waits
on one of them, and neither can block it, so all of its members reach it. Mirrors are made when the check
is switched on (every rank calls :func:`torch_ext.check_collective_order` at the same point of the
program), for the groups registered with torch.distributed then; with ``TORCH_EXT_CHECK_COLLECTIVES=1``,
which switches the check on before the process group exists, at the first backward the check sees. Never
lazily for one group from one rank's backward: there, the ranks' orders are what the check has not yet
compared. A backward whose collective uses a group made later raises, asking for the check to be switched
on again on every rank.
"""

from __future__ import annotations

import datetime
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# The store prefix of every mirror: the default store's keys of torch.distributed's own groups are numbers or
# rank hashes, never this.
_STORE_PREFIX = "torch_ext_order_check"


@dataclass(frozen=True, eq=False)
class Group:
    """A process group as the check knows it: ``id``, the same on every rank for the same ``ranks`` (global
    ranks, in group-rank order); ``mirror``, a gloo group over the same ranks (None for a group made up by a
    benchmark)."""

    id: int
    ranks: tuple[int, ...]
    mirror: Any = None
    members: frozenset[int] = field(init=False)
    # Whether a group contains this one, by id: asked once per pair of groups, never per backward.
    _contained_in: dict[int, bool] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", frozenset(self.ranks))

    def within(self, other: Group) -> bool:
        """Whether every rank of this group is in ``other``: then each of this group's members sees every
        collective of ``other``, and they must agree on how those interleave with this group's."""
        known = self._contained_in.get(other.id)
        if known is None:
            known = self._contained_in[other.id] = self.members <= other.members
        return known

    def describe(self) -> str:
        """Its ranks, shortened past 16."""
        ranks = list(self.ranks)
        if len(ranks) <= 16:
            return f"ranks {ranks}"
        return f"ranks [{', '.join(map(str, ranks[:8]))}, ..., {', '.join(map(str, ranks[-2:]))}] ({len(ranks)} ranks)"


def group_id(ranks: tuple[int, ...]) -> int:
    # repr of a tuple of ints is the same in every process, unlike hash() of a str.
    return int.from_bytes(hashlib.blake2b(repr(ranks).encode(), digest_size=8).digest(), "little", signed=True)


class GroupMirrors:
    """Every group this rank's checked collectives may use: its :class:`Group`, by the process group object."""

    def __init__(self) -> None:
        self._by_object: weakref.WeakKeyDictionary[Any, Group] = weakref.WeakKeyDictionary()
        self._by_ranks: dict[tuple[int, ...], Group] = {}
        # The default group the mirrors were made under: a new init_process_group starts afresh.
        self._default_group: weakref.ref | None = None

    def made(self) -> bool:
        return self._default_group is not None and self._default_group() is dist.distributed_c10d._get_default_group()

    def make(self, timeout: datetime.timedelta | None) -> None:
        """Mirrors each group this rank is in that has none yet, in the one global order (this module's text)."""
        default_group = dist.distributed_c10d._get_default_group()
        if self._default_group is None or self._default_group() is not default_group:
            self._by_object = weakref.WeakKeyDictionary()
            self._by_ranks = {}
            self._default_group = weakref.ref(default_group)
        me = dist.get_rank()
        registered = []
        for group, rank_of in list(dist.distributed_c10d._world.pg_group_ranks.items()):
            # A rank outside a group made with new_group is registered under the NON_GROUP_MEMBER sentinel.
            if isinstance(group, dist.ProcessGroup) and me in rank_of:
                registered.append((tuple(sorted(rank_of, key=rank_of.__getitem__)), group))
        store = dist.distributed_c10d._get_default_store()
        for ranks, group in sorted(registered, key=lambda entry: entry[0]):
            known = self._by_ranks.get(ranks)
            if known is None:
                identity = group_id(ranks)
                mirror = dist.ProcessGroupGloo(
                    dist.PrefixStore(f"{_STORE_PREFIX}/{identity & (2**64 - 1):016x}/", store),
                    ranks.index(me),
                    len(ranks),
                    timeout or _timeout_of(group),
                )
                known = self._by_ranks[ranks] = Group(identity, ranks, mirror)
            self._by_object[group] = known

    def add_made_up(self, group: Any, ranks: tuple[int, ...]) -> Group:
        """Registers a stand-in for a process group that has no mirror (a benchmark's synthetic world)."""
        known = self._by_ranks.get(ranks) or Group(group_id(ranks), ranks)
        self._by_ranks[ranks] = self._by_object[group] = known
        return known

    def of(self, group: Any) -> Group | None:
        """``group``'s :class:`Group`, None if it was made after the mirrors (or is not a registered group)."""
        try:
            return self._by_object.get(group)
        except TypeError:  # not weakly referenceable: nothing registered is
            return None

    def world(self) -> Group:
        """The default group's: what a collective whose group the check cannot see is compared over."""
        known = self.of(dist.distributed_c10d._get_default_group())
        assert known is not None, "the default group is registered and mirrored with the others"
        return known


def _timeout_of(group: Any) -> datetime.timedelta:
    """``group``'s own timeout where its backend says it, else gloo's default: a mirror gives up when the group
    would."""
    try:
        # The CPU backend's: a mirror is a CPU group (an NCCL group has a CPU backend only if made with one).
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return dist.distributed_c10d._get_default_timeout(dist.Backend.GLOO)
