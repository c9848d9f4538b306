"""torch.distributed.pipelining's zero-bubble schedules train to the same parameters with torch_ext's
split backward (``torch_ext.pipelining.patch_zero_bubble()``) as with stock's.

Two gloo ranks run a 4-stage pipeline, two stages per rank, with each zero-bubble schedule: every
step runs each microbatch's forward ("F"), input pass ("I") and, later, weight pass ("W"). Both runs
start from the same parameters and see the same data; the losses and the parameters after a few SGD
steps must be equal bit for bit.

The same process group also trains a DistributedDataParallel model with torch_ext's split backward
against a full stock backward: DDP all-reduces from hooks on AccumulateGrad and finishes in a final
callback, so its gradients are averaged only if the weight pass runs AccumulateGrad inside a graph
task (pytorch#144530: stock's split assigns .grad and DDP never sees it).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_ranks
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
from torch.nn.parallel import DistributedDataParallel

import torch_ext
import torch_ext.pipelining
from torch_ext.testing import assert_identical

pytestmark = pytest.mark.distributed

STEPS = 3
MICROBATCHES = 4
NUM_STAGES = 4
WIDTH = 16
BATCH = 8

# Which stages each rank holds: the interleaved schedule loops (rank r holds r and r + 2), ZB-V goes
# down and back up (rank 0 holds the first and the last stage).
SCHEDULES = {
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, {0: [0, 2], 1: [1, 3]}),
    "zbv_zero_bubble": (ScheduleZBVZeroBubble, {0: [0, 3], 1: [1, 2]}),
}


def _stage_module(stage_index: int) -> nn.Module:
    torch.manual_seed(100 + stage_index)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH))


def _train(schedule_name: str, rank: int, on_torch_ext: bool) -> dict:
    schedule_class, stages_of_rank = SCHEDULES[schedule_name]
    modules = {index: _stage_module(index) for index in stages_of_rank[rank]}
    # A post-accumulate-grad hook per parameter: torch_ext's weight pass accumulates through
    # AccumulateGrad; stock's assigns .grad itself (first stage aside, whose backward is whole).
    hook_calls = {index: 0 for index in modules}
    for index, module in modules.items():
        for param in module.parameters():

            def count(param, index=index):
                hook_calls[index] += 1

            param.register_post_accumulate_grad_hook(count)
    stages = [PipelineStage(module, index, NUM_STAGES, torch.device("cpu")) for index, module in modules.items()]
    schedule = schedule_class(stages, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    with torch_ext.pipelining.patch_zero_bubble() if on_torch_ext else contextlib.nullcontext():
        for _ in range(STEPS):
            # Every rank draws the same data; the first stage reads the inputs, the last the targets.
            inputs = torch.randn(BATCH, WIDTH, generator=generator)
            target = torch.randn(BATCH, WIDTH, generator=generator)
            optimizer.zero_grad()
            step_losses: list[torch.Tensor] = []
            kwargs = {}
            if 0 in modules:
                kwargs["x"] = inputs
            if NUM_STAGES - 1 in modules:
                kwargs.update(target=target, losses=step_losses)
            schedule.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
            losses.append([loss.detach().clone() for loss in step_losses])
            optimizer.step()
    dist.barrier()
    params = {
        f"stage{index}.{name}": param.detach().clone()
        for index, module in modules.items()
        for name, param in module.named_parameters()
    }
    return {"params": params, "losses": losses, "hook_calls": hook_calls}


def _train_ddp(rank: int, split: bool) -> dict:
    """DDP, one microbatch per step: a full stock backward, or torch_ext's input then weight pass."""
    model = _stage_module(0)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=1e-4)  # several buckets
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    # Different data on each rank, the same for both runs.
    generator = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=generator).requires_grad_()
        target = torch.randn(BATCH, WIDTH, generator=generator)
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(x), target)
        if split:
            _, state = torch_ext.backward_input(loss, None, [x], list(model.parameters()))
            assert all(p.grad is None for p in model.parameters())
            torch_ext.backward_weight(state)
        else:
            loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return {"grads": grads, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _train_every_case(rank: int) -> dict:
    results = {}
    for name in SCHEDULES:
        results[name] = {
            "stock": _train(name, rank, on_torch_ext=False),
            "torch_ext": _train(name, rank, on_torch_ext=True),
        }
    results["ddp"] = {"stock": _train_ddp(rank, split=False), "torch_ext": _train_ddp(rank, split=True)}
    return results


@pytest.fixture(scope="module")
def pipelining_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_train_every_case, tmp_path_factory.mktemp("pipelining"))


@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_zero_bubble_training_matches_stock_split(schedule_name, pipelining_results):
    for rank, result in enumerate(pipelining_results):
        stock, ours = result[schedule_name]["stock"], result[schedule_name]["torch_ext"]
        assert_identical(ours["params"], stock["params"], f"rank {rank} parameters")
        assert_identical(ours["losses"], stock["losses"], f"rank {rank} losses")
        # The schedule really called torch_ext's weight pass: every non-first stage's parameters
        # were accumulated through AccumulateGrad once per microbatch and step, and never on stock.
        params_per_stage = len(list(_stage_module(0).parameters()))
        for index, calls in ours["hook_calls"].items():
            assert calls == STEPS * MICROBATCHES * params_per_stage, f"rank {rank} stage {index}"
            if index != 0:
                assert stock["hook_calls"][index] == 0, f"rank {rank} stage {index}"


def test_ddp_averages_gradients_of_the_weight_pass(pipelining_results):
    for rank, result in enumerate(pipelining_results):
        stock, ours = result["ddp"]["stock"], result["ddp"]["torch_ext"]
        assert_identical(ours, stock, f"rank {rank}")
    # The ranks saw different data and hold the same (all-reduced) gradients.
    first, second = (result["ddp"]["torch_ext"] for result in pipelining_results)
    assert_identical(second["grads"], first["grads"], "rank 1 vs rank 0")
