"""Each process group's identity and its gloo mirror, for the collective order check.

The order check compares a backward's collectives among the members of each group they use, over a gloo
group of the same ranks: the group's *mirror*. Exchanging on the group itself could reorder its collectives
(a lane may be using it), and an NCCL group cannot carry a CPU exchange off the engine thread. A group is
known by an id every rank computes alike from its ranks, once, so a backward's fingerprints carry an integer
instead of a rank list, and the check's cost per backward does not grow with the group's size.

**Made without a hang, whenever first needed.** ``torch.distributed.new_group`` must be called by every rank
of the world in one order, because making a group synchronizes its members. A mirror does not: it is a
``ProcessGroupGloo`` made from the default store under a prefix of its own (the group's id), with gloo's lazy
connection (what PyTorch's documented ``TORCH_GLOO_LAZY_INIT=1`` makes, asked of the mirror's devices rather
than of the environment). Making it writes this rank's address to
the store and returns at once; a pair of members connects when it first exchanges, which is when the members
compare a backward anyway. So a rank makes a group's mirror the first time a backward's collective uses the
group, in any order relative to its other groups and without waiting for anyone: nothing is made per world,
and no rank makes a mirror of a group it never checks. Only the pairs the exchange's algorithm uses connect,
not the full mesh that an eagerly made gloo group of 1,024 ranks opens (1,023 sockets a rank; 8,191 for a
world of 8,192, past the usual limit of 1,024 open files). The mirror is not registered with
torch.distributed, so the user's groups, their names and the group counter are untouched.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torch_ext.collectives.derived_groups import DerivedGroups

# The store prefix of every mirror: the default store's keys of torch.distributed's own groups are numbers or
# rank hashes, never this.
_STORE_PREFIX = "torch_ext_order_check"


@dataclass(frozen=True, eq=False)
class Group:
    """A process group as the check knows it: ``id``, the same on every rank for the same ``ranks`` (global
    ranks, in group-rank order); ``mirror``, a gloo group over the same ranks (None for a group rebuilt from
    another rank's fingerprints to name a mismatch, which is never exchanged over)."""

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


def store_key(ranks: tuple[int, ...]) -> str:
    """The group's id as the store prefixes and names of the groups torch_ext makes of it (mirrors, twins) spell it:
    16 hex digits."""
    return f"{group_id(ranks) & (2**64 - 1):016x}"


class GroupMirrors(DerivedGroups[Group]):
    """Every group this rank's checked collectives used: its :class:`Group`, by the process group object (a
    :class:`DerivedGroups` registry, as the twins' is; :meth:`forget` drops every mirror)."""

    def __init__(self) -> None:
        super().__init__(_make_mirror)

    def of(self, group: Any, timeout: datetime.timedelta | None) -> Group | None:
        """``group``'s :class:`Group`, its mirror made now if this is its first use (``timeout``: the mirror's,
        by default the group's own); None for an object torch.distributed does not know as a group of this
        rank (a backend made by hand). Call :meth:`forget_another_world` first, once per backward."""
        return self.derived(group, timeout)

    def add_made_up(self, group: Any, ranks: tuple[int, ...], mirror: Any) -> Group:
        """Registers ``group``, an object standing for a process group of ``ranks`` that this process is not
        really part of, with ``mirror`` to exchange over (benchmarks/order_check_scale.py's synthetic worlds)."""
        self.forget_another_world()
        return self.add(group, ranks, Group(group_id(ranks), ranks, mirror))


def _make_mirror(group: Any, ranks: tuple[int, ...], timeout: datetime.timedelta | None) -> Group:
    """The :class:`Group` of ``group``, of ``ranks``, with its mirror (``timeout``: the mirror's, by default the
    group's own)."""
    prefix = f"{_STORE_PREFIX}/{store_key(ranks)}/"
    mirror = _lazily_connected_gloo(
        dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store()),
        ranks.index(dist.get_rank()),
        len(ranks),
        timeout or _timeout_of(group),
    )
    return Group(group_id(ranks), ranks, mirror)


def _lazily_connected_gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A ProcessGroupGloo whose pairs connect at their first exchange: what ``TORCH_GLOO_LAZY_INIT=1`` makes,
    asked of its devices instead of the process's environment. The devices are the ones PyTorch's own
    constructor picks: one per interface of ``GLOO_SOCKET_IFNAME``, else the host's default."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True) for name in interfaces]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _timeout_of(group: Any) -> datetime.timedelta:
    """``group``'s own timeout where its backend says it, else gloo's default: a mirror gives up when the group
    would."""
    try:
        # The CPU backend's: a mirror is a CPU group (an NCCL group has a CPU backend only if made with one).
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return dist.distributed_c10d._get_default_timeout(dist.Backend.GLOO)
