"""torch_ext's collectives on an accelerator with streams, 2 ranks: a lane, a deferred wait and overlap across
microbatches keep stock's bits, with device-side collectives on the streams PyTorch's rules name.

Runs on NCCL where there is a GPU, and everywhere else on the test device (tests/testdev) with its collective
backend, ``testdev_gloo``: gloo staged through the host, asynchronous on the device's streams, with a ``Work``
whose wait makes the current stream wait, as NCCL's does. Each rank uses device ``rank % device_count``.

The model is a mixture of experts in miniature: tokens dispatched by an all_to_all to an expert, combined back
by another (a synchronous autograd Function declared to run in a lane, or torch_ext's op, whose wait the engine
defers to the gradient's first use), beside a dense path whose backward keeps the stream busy (the hold op) before writing, so a
collective or a reader that does not wait for its producer's stream reads a gradient not yet written.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _harness import assert_identical, run_ranks
from torch import nn

import torch_ext
import torch_ext.ops as xops

pytestmark = pytest.mark.distributed

DEVICE = "cuda" if torch.cuda.is_available() else "testdev"
BACKEND = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "cpu:gloo,testdev:testdev_gloo"
STEPS = 2
MICROBATCHES = 3
DIM = 8
TOKENS = 6
HOLD_MS = 5

# (case, the rule of overlap_microbatches or None for one backward per step under enable())
CASES = {
    "lane": None,
    "deferred_wait": None,
    "overlap": "after_backward_collectives",
    "overlap_in_turns": "in_turns_with_backward_collectives",
}


def hold_current_stream() -> None:
    if DEVICE == "cuda":
        torch.cuda._sleep(HOLD_MS * 1_000_000)  # ~HOLD_MS at 1 GHz
    else:
        import testdev

        testdev.hold(HOLD_MS)


class HeldTanh(torch.autograd.Function):
    """tanh whose backward keeps its stream busy before writing the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        hold_current_stream()
        return grad * (1 - y * y)


class ExpertAllToAll(torch.autograd.Function):
    """A synchronous all_to_all in forward and in backward (Megatron-core's ``_AllToAll``); its backward records the
    stream it issued the gradient's all_to_all on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, streams_seen: list) -> torch.Tensor:
        ctx.group, ctx.streams_seen = group, streams_seen
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.streams_seen.append(torch.accelerator.current_stream())
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class MoE(nn.Module):
    def __init__(self, group: dist.ProcessGroup, collective: str) -> None:
        super().__init__()
        self.group = group
        self.collective = collective
        self.pre = nn.Linear(DIM, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.dense = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(3)])
        self.head = nn.Linear(DIM, 1)
        self.streams_seen: list[torch.Stream] = []

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if self.collective == "lane":
            return ExpertAllToAll.apply(x, self.group, self.streams_seen)
        return xops.all_to_all_single(x, group=self.group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = HeldTanh.apply(self.pre(tokens))
        routed = self.all_to_all(self.expert(self.all_to_all(h)))
        dense = h
        for layer in self.dense:
            dense = HeldTanh.apply(layer(dense))
        return self.head(routed + dense)


def _to_cpu(tensors):
    return [t.detach().cpu() for t in tensors]


def _train(rank: int, group: dist.ProcessGroup, case: str, on_torch_ext: bool) -> dict:
    device = torch.accelerator.current_accelerator()
    torch.manual_seed(0)  # the same weights on both ranks; the data differs
    model = MoE(group, "lane" if case == "lane" else "deferred_wait").to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = CASES[case]
    result: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        batches = [torch.randn(2 * TOKENS, DIM, generator=generator).to(device) for _ in range(MICROBATCHES)]
        overlapped = on_torch_ext and rule is not None
        opened = torch_ext.overlap_microbatches(forward_collectives=rule) if overlapped else contextlib.nullcontext()
        enabled = torch_ext.enable() if on_torch_ext and not overlapped else contextlib.nullcontext()
        with opened as overlap, enabled:
            for tokens in batches:
                loss = model(tokens).square().mean() / MICROBATCHES
                result["losses"].append(loss.detach().cpu())
                if overlapped:
                    overlap.backward(loss)
                else:
                    loss.backward()
        # Read on the caller's current stream, at once: the end of backward made it wait for the leaf streams.
        result["grads"].append(_to_cpu([p.grad.clone() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = _to_cpu(model.parameters())
    default_stream = torch.accelerator.current_stream()
    result["lane_streams_are_side_streams"] = [stream != default_stream for stream in model.streams_seen]
    return result


def _run(rank: int) -> dict:
    if DEVICE == "testdev":
        import testdev
        import testdev.distributed

        testdev.load()
        testdev.distributed.register_backend()
    torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    group = dist.new_group(backend=BACKEND)
    results = {}
    for case in CASES:
        if case == "lane":
            torch_ext.run_in_lane(ExpertAllToAll)
        try:
            results[case] = {
                "stock": _train(rank, group, case, on_torch_ext=False),
                "torch_ext": _train(rank, group, case, on_torch_ext=True),
            }
        finally:
            if case == "lane":
                torch_ext.unregister_collective_backward(ExpertAllToAll)
    torch.accelerator.synchronize()
    dist.destroy_process_group(group)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("accelerator_collectives"), timeout_s=240)


@pytest.mark.parametrize("case", CASES)
def test_every_loss_gradient_and_parameter_is_stocks(results, case):
    for rank, result in enumerate(results):
        stock, ours = result[case]["stock"], result[case]["torch_ext"]
        for what in ("losses", "grads", "params"):
            assert_identical(ours[what], stock[what], f"rank {rank} {case} {what}")


def test_the_lane_runs_its_collective_on_a_side_stream(results):
    for rank, result in enumerate(results):
        stock, lane = result["lane"]["stock"], result["lane"]["torch_ext"]
        # Stock runs the all_to_all's node on its forward's stream, the default one; the lane on its side stream,
        # where the backend issues the device-side collective.
        assert stock["lane_streams_are_side_streams"] == [False] * (2 * STEPS * MICROBATCHES), rank
        assert lane["lane_streams_are_side_streams"] == [True] * (2 * STEPS * MICROBATCHES), rank
