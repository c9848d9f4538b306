"""Groups torch_ext derives from a process group, in one registry: the order check's mirrors
(``group_mirrors.py``) and the overlap's twins (``twin_groups.py``).

A kind of derived group is one function, ``make``: the derived group of a group of given ranks. The registry makes
one per rank list, at the first use of a group of those ranks (two groups of the same ranks share it), and knows it
by the group object, weakly (a group the user drops is not kept alive by torch_ext), and by its ranks. Every derived
group is made from the default store of one world: when a new default group starts another (destroy_process_group,
then init_process_group again), the registry forgets them all, each unmade as its kind says (a twin's registered
name is unregistered).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist

Derived = TypeVar("Derived")


def member_ranks(group: Any) -> tuple[int, ...] | None:
    """``group``'s global ranks, in group-rank order; None for an object torch.distributed does not know as a group
    of this rank (a backend made by hand, a group this rank is not in)."""
    # A rank outside a group made with new_group is registered under the NON_GROUP_MEMBER sentinel.
    rank_of = dist.distributed_c10d._world.pg_group_ranks.get(group) if isinstance(group, dist.ProcessGroup) else None
    if rank_of is None or dist.get_rank() not in rank_of:
        return None
    return tuple(sorted(rank_of, key=rank_of.__getitem__))


class DerivedGroups(Generic[Derived]):
    """Every group of one kind this rank derived, by the process group object it was made from and by its ranks.

    ``make(group, ranks, *args)`` makes the derived group of ``group``, whose global ranks are ``ranks``, at the
    first use of those ranks (``args``: what the kind passes to :meth:`derived`). ``admit(group)``, if given,
    raises for a group that may have none, at its first use (the twins' gloo-only refusal). ``unmake(derived)``, if
    given, undoes what making it did outside the registry (a twin's registered name)."""

    def __init__(
        self,
        make: Callable[..., Derived],
        *,
        admit: Callable[[Any], None] | None = None,
        unmake: Callable[[Derived], None] | None = None,
    ) -> None:
        self._make = make
        self._admit = admit
        self._unmake = unmake
        self._by_object: weakref.WeakKeyDictionary[Any, Derived] = weakref.WeakKeyDictionary()
        self._by_ranks: dict[tuple[int, ...], Derived] = {}
        # The default group the derived groups were made under: a new init_process_group starts afresh.
        self._default_group: weakref.ref | None = None

    def derived(self, group: Any, *args: Any) -> Derived | None:
        """``group``'s derived group, made now if this is the first use of its ranks; None for an object
        torch.distributed does not know as a group of this rank (a backend made by hand, a group this rank is not
        in). Does not look for another world: call :meth:`forget_another_world` first."""
        try:
            known = self._by_object.get(group)
        except TypeError:  # not weakly referenceable: no process group
            return None
        if known is not None:
            return known
        ranks = member_ranks(group)
        if ranks is None:
            return None
        if self._admit is not None:
            self._admit(group)
        known = self._by_ranks.get(ranks)
        if known is None:
            known = self._by_ranks[ranks] = self._make(group, ranks, *args)
        self._by_object[group] = known
        return known

    def add(self, group: Any, ranks: tuple[int, ...], derived: Derived) -> Derived:
        """Registers ``group`` as a group of ``ranks`` whose derived group is ``derived``, unless ``ranks`` have one
        already (then that one, returned); made by the caller, not by ``make``."""
        known = self._by_ranks.setdefault(ranks, derived)
        self._by_object[group] = known
        return known

    def forget(self) -> None:
        """Drops every derived group, each unmade first: the last reference to a ProcessGroupGloo joins its worker
        threads, which must not outlive the interpreter (tests/distributed/test_clean_exit.py)."""
        if self._unmake is not None:
            for derived in self._by_ranks.values():
                self._unmake(derived)
        self._by_object = weakref.WeakKeyDictionary()
        self._by_ranks = {}
        self._default_group = None

    def forget_another_world(self) -> None:
        """Starts afresh under a new default group (destroy_process_group, then init_process_group again)."""
        default_group = dist.distributed_c10d._get_default_group()
        if self._default_group is None or self._default_group() is not default_group:
            self.forget()
            self._default_group = weakref.ref(default_group)
