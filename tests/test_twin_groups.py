"""Twin groups (torch_ext/collectives/twin_groups.py), in a one-rank world: one twin per rank list, a registered
ProcessGroup that carries collectives under its own name, refused for a group of another backend than gloo, and
forgotten (its name unregistered) with a new world. The two-rank behaviour, the backward's collectives issued on
the twins beside the forward's, is tests/distributed/test_microbatch_overlap.py's twins case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torch_ext.collectives.twin_groups import TwinGroups


def test_a_twin_is_a_registered_gloo_group_of_the_same_ranks_made_once(one_rank_world):
    twins = TwinGroups()
    world = dist.group.WORLD
    twin = twins.of(world)
    assert twin is not world and (twin.rank(), twin.size()) == (world.rank(), world.size())
    # One twin per rank list: another group of the same ranks shares it.
    assert twins.of(world) is twin and twins.of(dist.new_group([0])) is twin
    assert dist.distributed_c10d._resolve_process_group(twin.group_name) is twin
    assert twins.name_of(world.group_name) == twin.group_name == twins.name_of(twin.group_name)
    # It carries collectives itself, by object and by name, and counts them as its own.
    before = world._get_sequence_number_for_group()
    tensor = torch.ones(3)
    dist.all_reduce(tensor, group=twin)
    reduced = funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", twin.group_name))
    assert torch.equal(tensor, torch.ones(3)) and torch.equal(reduced, torch.ones(3))
    assert (twin._get_sequence_number_for_group(), world._get_sequence_number_for_group()) == (2, before)
    twins.forget()
    with pytest.raises(RuntimeError):
        dist.distributed_c10d._resolve_process_group(twin.group_name)


def test_a_group_of_another_backend_has_no_twin(one_rank_world):
    def gloo_under_another_name(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("torch_ext_test_backend", gloo_under_another_name, devices=["cpu"])
    other = dist.new_group([0], backend="torch_ext_test_backend")
    twins = TwinGroups()
    twins.of(dist.group.WORLD)  # its ranks have a twin: a group of another backend does not share it
    with pytest.raises(RuntimeError, match="this group's backend is torch_ext_test_backend: on NCCL two communicators"):
        twins.of(other)
    twins.forget()


def test_an_object_that_is_no_group_of_this_rank_has_no_twin(one_rank_world):
    with pytest.raises(RuntimeError, match="is not a process group of this rank: it can have no twin"):
        TwinGroups().of(object())


def test_a_new_world_makes_new_twins(one_rank_world):
    twins = TwinGroups()
    first = twins.of(dist.group.WORLD)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    second = twins.of(dist.group.WORLD)
    assert second is not first
    assert dist.distributed_c10d._resolve_process_group(second.group_name) is second
    twins.forget()
