"""Twin process groups: where a backward running beside the next microbatch's forward issues its collectives
under ``overlap_microbatches(forward_collectives="beside_backward_collectives")``.

Two threads issuing collectives on one group must issue them in one order on every rank. The other rules keep
that order by making one thread wait for the other (docs/design.md, "The collective order rule"). This one gives
the backward's collectives a group of their own instead: the *twin* of each group, a gloo group of the same ranks
in the same order. The forward's collectives stay on the group, the backward's go to its twin (the collective
gate swaps the group argument, csrc/overlap/collective_gate.cpp), and neither thread waits for the other: each
communicator is used by one thread, in that thread's program order, the same on every rank.

**Made without a hang, whenever first needed**, as the order check's mirrors are (``group_mirrors.py``): from the
default store under a prefix of the group's id, with gloo's lazy connection. Making a twin writes this rank's
address to the store and returns; a pair of members connects at its first exchange. So a rank makes a twin at
the backward's first collective on the group, in any order relative to its other groups, waiting for no one.
Unlike a mirror, a twin is a full ``ProcessGroup`` registered under a name of its own: the c10d operators take a
ProcessGroup and the functional collectives a group's name.

**gloo only.** On NCCL, two communicators of the same ranks driven from two streams can deadlock: each
collective's kernel occupies the device until its peers arrive, and nothing orders one communicator's kernels
against the other's across ranks. A group whose backend is not gloo has no twin; its collective is refused with
an error that names the rule to use there.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist

from torch_ext.collectives.derived_groups import DerivedGroups
from torch_ext.collectives.group_mirrors import _lazily_connected_gloo, _timeout_of, store_key

# The store prefix of every twin, and the start of its registered name: torch.distributed's own groups are
# named by numbers or rank hashes, never this.
_PREFIX = "torch_ext_twin"


class TwinGroups(DerivedGroups[Any]):
    """Every twin this rank made, by the process group object it is the twin of; one per rank list (a
    :class:`DerivedGroups` registry, as the order check's mirrors are). :meth:`forget` drops every twin, and its
    registered name."""

    def __init__(self) -> None:
        super().__init__(_make_twin, admit=_refuse_unless_gloo, unmake=_unregister)

    def of(self, group: Any) -> Any:
        """``group``'s twin, made now if this is its first use."""
        self.forget_another_world()
        twin = self.derived(group)
        if twin is None:
            raise RuntimeError(f"torch_ext: {group!r} is not a process group of this rank: it can have no twin")
        return twin

    def name_of(self, group_name: str) -> str:
        """The registered name of the twin of the group registered as ``group_name`` (a functional collective's
        argument; a twin's own name is its own)."""
        if group_name.startswith(f"{_PREFIX}_"):
            return group_name
        return self.of(dist.distributed_c10d._resolve_process_group(group_name)).group_name


def _refuse_unless_gloo(group: Any) -> None:
    """Raises for a group whose backend is not gloo: it has no twin (the module's docstring, "gloo only")."""
    backend = dist.get_backend(group)
    if backend != dist.Backend.GLOO:
        raise RuntimeError(
            f"torch_ext: forward_collectives='beside_backward_collectives' issues the backward's collectives on a "
            f"gloo twin of their group, and this group's backend is {backend}: on NCCL two communicators of the "
            "same ranks, used from two streams, can deadlock. Keep one order of collectives there: "
            "forward_collectives='after_backward_collectives' (the default) or "
            "'in_turns_with_backward_collectives'"
        )


def _make_twin(group: Any, ranks: tuple[int, ...]) -> Any:
    identity = store_key(ranks)
    timeout = _timeout_of(group)
    store = dist.PrefixStore(f"{_PREFIX}/{identity}/", dist.distributed_c10d._get_default_store())
    rank, size = ranks.index(dist.get_rank()), len(ranks)
    twin = dist.ProcessGroup(store, rank, size)
    twin._register_backend(
        torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, _lazily_connected_gloo(store, rank, size, timeout)
    )
    twin._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    twin._set_group_name(f"{_PREFIX}_{identity}")
    dist.distributed_c10d._register_process_group(twin.group_name, twin)
    return twin


def _unregister(twin: Any) -> None:
    """Unregisters a forgotten twin's name: the last reference to its ProcessGroupGloo joins its worker threads,
    which must not outlive the interpreter."""
    dist.distributed_c10d._unregister_process_group(twin.group_name)


TWINS = TwinGroups()
# The twins' gloo worker threads must not outlive the interpreter (tests/distributed/test_clean_exit.py).
atexit.register(TWINS.forget)
