"""DistributedDataParallel trains bit for bit as on stock when torch_ext's engine runs its backward.

DDP's reducer all-reduces gradients from AccumulateGrad post hooks as buckets fill and finishes
in a final callback (Engine::queue_callback), which only works inside a current graph task: both
depend on torch_ext's host task. Two gloo ranks on loopback each train the same model with SGD
twice, on the stock engine and then under ``torch_ext.enable()``, from the same initial
parameters and the same per-rank data; every gradient after every backward and the final
parameters must be equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from _harness import (
    assert_torch_ext_matches_stock,
    profiled_backward,
    ran_on_torch_ext,
    run_ranks,
    train_on_both_engines,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_ext
from torch_ext.testing import assert_identical

pytestmark = pytest.mark.distributed

STEPS = 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)


class MLPWithUnusedHead(MLP):
    """A parameter that never gets a gradient: DDP must be told to look for it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_head = nn.Linear(4, 4)


class TiedEmbeddingLM(nn.Module):
    """The token embedding is reused as the output projection (as in GPT-2): one parameter that
    receives two gradient contributions, summed in its AccumulateGrad's input buffer before DDP's
    hook sees it."""

    VOCAB = 12

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 8)
        self.hidden = nn.Linear(8, 8)
        self.unembed = nn.Linear(8, self.VOCAB, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.unembed(torch.tanh(self.hidden(self.embed(tokens))))


def _regression_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def _token_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = TiedEmbeddingLM.VOCAB
    return torch.randint(vocab, (10,), generator=generator), torch.randint(vocab, (10,), generator=generator)


@dataclass(frozen=True)
class DdpCase:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ddp_kwargs: dict = field(default_factory=dict)
    # Gradient accumulation: every micro-batch of a step but the last runs forward and backward
    # under no_sync(), and the last one's backward all-reduces the accumulated gradients.
    micro_batches: int = 1


# Each rank runs every case, in this order, in one process group.
CASES = {
    # After the first step DDP rebuilds its buckets in the order gradients became ready; a
    # bucket cap of a few bytes then gives every parameter its own all_reduce.
    "mlp_bucket_per_param": DdpCase(MLP, _regression_batch, F.mse_loss, {"bucket_cap_mb": 1e-5}),
    # AccumulateGrad writes .grad straight into the bucket's flat buffer.
    "mlp_grad_as_bucket_view": DdpCase(MLP, _regression_batch, F.mse_loss, {"gradient_as_bucket_view": True}),
    "tied_weights": DdpCase(TiedEmbeddingLM, _token_batch, F.cross_entropy),
    # The reducer walks the graph from the outputs in forward and marks what backward will not reach.
    "unused_parameter": DdpCase(MLPWithUnusedHead, _regression_batch, F.mse_loss, {"find_unused_parameters": True}),
    # The first step's all-reduce is delayed to a callback that DDP queues through
    # torch.autograd's execution engine, which under enable() is torch_ext.Engine.
    "static_graph": DdpCase(MLP, _regression_batch, F.mse_loss, {"static_graph": True}),
    # Under no_sync() the reducer's hooks leave the gradients local; the synced backward then
    # all-reduces the sum of both micro-batches' gradients.
    "no_sync_accumulation": DdpCase(MLP, _regression_batch, F.mse_loss, micro_batches=2),
    # The same with the accumulated gradients living in the bucket's flat buffer.
    "no_sync_grad_as_bucket_view": DdpCase(
        TiedEmbeddingLM, _token_batch, F.cross_entropy, {"gradient_as_bucket_view": True}, micro_batches=2
    ),
}


def _clone(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.clone()


def _train(case: DdpCase, rank: int, on_torch_ext: bool) -> dict:
    """One record per backward, in order: its loss, whether it synced, every gradient after it."""
    torch.manual_seed(0)
    model = case.make_model()
    ddp_model = DistributedDataParallel(model, **case.ddp_kwargs)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    grads, losses, synced = [], [], []
    driver_ran = None
    with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
        for step in range(STEPS):
            optimizer.zero_grad()
            for micro_batch in range(case.micro_batches):
                # Different data on each rank, the same on both engines.
                seed = 1000 * rank + case.micro_batches * step + micro_batch
                inputs, target = case.make_batch(torch.Generator().manual_seed(seed))
                sync = micro_batch == case.micro_batches - 1
                with contextlib.nullcontext() if sync else ddp_model.no_sync():
                    loss = case.loss_fn(ddp_model(inputs), target)
                    if driver_ran is None:
                        driver_ran = ran_on_torch_ext(profiled_backward(loss))
                    else:
                        loss.backward()
                losses.append(loss.item())
                synced.append(sync)
                grads.append({name: _clone(param.grad) for name, param in model.named_parameters()})
            optimizer.step()
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"grads": grads, "params": params, "losses": losses, "synced": synced, "driver_ran": driver_ran}


def _train_every_case(rank: int) -> dict:
    return train_on_both_engines(CASES, _train, rank)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    """Each rank's results: {case name: {"stock": ..., "torch_ext": ...}}."""
    return run_ranks(_train_every_case, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("case_name", list(CASES))
def test_ddp_training_matches_stock(case_name, ddp_results):
    assert_torch_ext_matches_stock(ddp_results, case_name)

    # DDP really averaged: the ranks saw different data yet hold the same gradients after every
    # synced backward. (Without its hooks or its final callback each rank would keep its local
    # gradient and this would fail.) After a no_sync() backward they must still differ.
    first, second = (result[case_name]["torch_ext"] for result in ddp_results)
    assert first["losses"] != second["losses"]
    for index, synced in enumerate(first["synced"]):
        where = f"backward {index}, rank 1 vs rank 0"
        if synced:
            assert_identical(second["grads"][index], first["grads"][index], where)
        else:
            assert any(
                not torch.equal(second["grads"][index][name], grad) for name, grad in first["grads"][index].items()
            ), f"{where}: gradients were all-reduced under no_sync()"
