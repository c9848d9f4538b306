"""The order check's group registry (torch_ext/collectives/group_mirrors.py), and the registry of derived groups it
shares with the twins (torch_ext/collectives/derived_groups.py), in one process.

The multi-rank behaviour (mirrors made hang-free, a swap raising within its group only) is in
tests/distributed/test_collective_order.py, test_four_ranks.py and test_eight_ranks.py.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import torch_ext
from torch_ext.collectives import order_check
from torch_ext.collectives.derived_groups import DerivedGroups
from torch_ext.collectives.group_mirrors import Group, GroupMirrors, group_id


def test_a_group_id_is_the_same_in_every_process():
    # hash() of a str differs between processes (PYTHONHASHSEED); the id must not.
    code = "from torch_ext.collectives.group_mirrors import group_id; print(group_id((0, 8, 16)))"
    ids = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert ids == {str(group_id((0, 8, 16)))}
    # The order of the ranks is part of a group's identity (a group made with sort_ranks=False).
    assert group_id((0, 8, 16)) != group_id((8, 0, 16))


def test_within_is_containment_of_ranks():
    world, ep, dp = Group(1, tuple(range(16))), Group(2, (0, 1, 2, 3)), Group(3, (0, 4, 8, 12))
    assert ep.within(world) and dp.within(world) and ep.within(ep)
    assert not world.within(ep) and not ep.within(dp) and not dp.within(ep)


def test_a_large_group_is_described_shortened():
    assert Group(1, (2, 3)).describe() == "ranks [2, 3]"
    described = Group(1, tuple(range(0, 8192, 8))).describe()
    assert described == "ranks [0, 8, 16, 24, 32, 40, 48, 56, ..., 8176, 8184] (1024 ranks)"


def test_a_mirror_is_made_at_a_groups_first_use_once_per_rank_list(one_rank_world):
    registry = order_check._MIRRORS
    registry.forget_another_world()
    world = registry.of(dist.group.WORLD, None)
    assert world.ranks == (0,) and world.mirror is not None and world.mirror.size() == 1
    # Two groups over the same ranks share one mirror and one id; asked again, nothing is made again.
    later = dist.new_group([0])
    assert registry.of(later, None) is world and registry.of(dist.group.WORLD, None) is world
    # Not a process group of this rank's: the check compares its collectives over the world's mirror instead.
    assert registry.of(object(), None) is None


def test_a_mirror_connects_lazily_so_making_it_waits_for_no_rank(one_rank_world):
    """A mirror of a group whose other members have not come: made at once (an eagerly connected gloo group
    waits in the store for them, here until its timeout)."""
    mirrors = GroupMirrors()
    mirrors.forget_another_world()
    made_up = dist.new_group([0])  # stands for a two-rank group: only the registry's record of it is changed
    dist.distributed_c10d._world.pg_group_ranks[made_up] = {0: 0, 1: 1}
    start = time.monotonic()
    group = mirrors.of(made_up, datetime.timedelta(seconds=30))
    assert group.ranks == (0, 1) and group.mirror.size() == 2
    assert time.monotonic() - start < 5


def test_a_made_up_group_shares_the_group_of_its_ranks(one_rank_world):
    class MadeUp:  # benchmarks/order_check_scale.py's synthetic groups: weakly referenceable, unknown to torch
        pass

    mirrors = GroupMirrors()
    first, second = MadeUp(), MadeUp()
    made_up = mirrors.add_made_up(first, (0, 1), mirror="a mirror")
    assert made_up.ranks == (0, 1) and made_up.id == group_id((0, 1)) and made_up.mirror == "a mirror"
    assert mirrors.add_made_up(second, (0, 1), mirror="another") is made_up
    assert mirrors.of(first, None) is made_up and mirrors.of(second, None) is made_up


def test_a_new_world_makes_new_mirrors(one_rank_world):
    mirrors = GroupMirrors()
    mirrors.forget_another_world()
    first = mirrors.of(dist.group.WORLD, None)
    mirrors.forget_another_world()  # the same world: kept
    assert mirrors.of(dist.group.WORLD, None) is first
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mirrors.forget_another_world()
    second = mirrors.of(dist.group.WORLD, None)
    assert second is not first and second.id == first.id
    mirrors.forget()


def test_derived_groups_make_one_per_rank_list_and_unmake_them_with_another_world(one_rank_world):
    made, unmade = [], []

    def make(group, ranks, tag):
        made.append((ranks, tag))
        return f"derived {len(made)}"

    registry = DerivedGroups(make, unmake=unmade.append)
    registry.forget_another_world()
    assert registry.derived(dist.group.WORLD, "a") == "derived 1" == registry.derived(dist.new_group([0]), "b")
    assert made == [((0,), "a")] and unmade == []
    # No group of this rank's: nothing made, not even for an object that is not weakly referenceable.
    assert registry.derived(object(), "c") is None and registry.derived(7, "c") is None
    assert len(made) == 1
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    registry.forget_another_world()
    assert unmade == ["derived 1"] and registry.derived(dist.group.WORLD, "d") == "derived 2"


def test_the_group_argument_is_gone():
    # Deprecated before 0.1.0 and removed with it: the check exchanges over a mirror of each group it sees.
    with pytest.raises(TypeError, match="group"):
        torch_ext.check_collective_order(group=object())
