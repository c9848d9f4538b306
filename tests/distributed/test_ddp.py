"""DistributedDataParallel trains bit for bit as on stock when torch_ext's engine runs its backward.

DDP's reducer all-reduces gradients from AccumulateGrad post hooks as buckets fill and finishes
in a final callback (Engine::queue_callback), which only works inside a current graph task: both
depend on torch_ext's host task. Two gloo ranks on loopback each train the same model with SGD
twice, on the stock engine and then under ``torch_ext.enabled()``, from the same initial
parameters and the same per-rank data; every gradient after every step and the final parameters
must be equal.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_ext

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
STEPS = 4
# Whole run, both ranks: spawning costs ~7 s on 2 cores, training well under a second.
SPAWN_TIMEOUT_S = 120
# A rank whose peer died fails its collective after this instead of waiting forever.
COLLECTIVE_TIMEOUT_S = 60
# A rank still running after this writes every thread's stack, which the test reports if it hangs.
STACK_DUMP_S = SPAWN_TIMEOUT_S - 20


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
}


def _clone(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.clone()


def _train(case: DdpCase, rank: int, on_torch_ext: bool) -> dict:
    torch.manual_seed(0)
    model = case.make_model()
    ddp_model = DistributedDataParallel(model, **case.ddp_kwargs)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    grads, losses = [], []
    with torch_ext.enabled() if on_torch_ext else contextlib.nullcontext():
        for step in range(STEPS):
            # Different data on each rank, the same on both engines.
            inputs, target = case.make_batch(torch.Generator().manual_seed(1000 * rank + step))
            optimizer.zero_grad()
            loss = case.loss_fn(ddp_model(inputs), target)
            if step == 0:
                # torch_ext's host task runs its driver node on the stock engine; stock never does.
                with torch.profiler.profile() as profile:
                    loss.backward()
                driver_ran = any("torch_ext::BackwardDriver" in event.name for event in profile.events())
            else:
                loss.backward()
            losses.append(loss.item())
            grads.append({name: _clone(param.grad) for name, param in model.named_parameters()})
            optimizer.step()
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"grads": grads, "params": params, "losses": losses, "driver_ran": driver_ran}


def _train_every_case(rank: int, port: int, parent_torch_ext_file: str) -> dict:
    # The rank got the parent's sys.path from spawn; make sure it resolved to the same build.
    if torch_ext.__file__ != parent_torch_ext_file:
        raise ImportError(f"rank imported torch_ext from {torch_ext.__file__}, the test from {parent_torch_ext_file}")
    torch.set_num_threads(1)  # two ranks share two cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        # One process group for every case: spawning the ranks is most of the test's time.
        results = {}
        for case_name, case in CASES.items():
            try:
                results[case_name] = {
                    "stock": _train(case, rank, on_torch_ext=False),
                    "torch_ext": _train(case, rank, on_torch_ext=True),
                }
            except BaseException as error:
                error.add_note(f"in DDP case {case_name!r}")
                raise
        return results
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, port: int, out_dir: str, parent_torch_ext_file: str) -> None:
    out = Path(out_dir)
    with open(out / f"rank{rank}.stacks", "w") as stack_dump:
        # Should the rank hang, the test reports where.
        faulthandler.dump_traceback_later(STACK_DUMP_S, file=stack_dump)
        try:
            results = _train_every_case(rank, port, parent_torch_ext_file)
        except BaseException:
            (out / f"rank{rank}.traceback").write_text(traceback.format_exc())
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
    torch.save(results, out / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(out_dir: Path) -> list[dict]:
    """Runs _rank_main on every rank; returns each rank's results or fails with the ranks' tracebacks."""
    context = mp.get_context("spawn")
    port = _free_port()
    ranks = [
        context.Process(target=_rank_main, args=(rank, port, str(out_dir), torch_ext.__file__), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    timed_out = False
    try:
        while running := [process for process in ranks if process.exitcode is None]:
            if any(process.exitcode for process in ranks):
                break  # a failed rank: its peers would wait for it in a collective
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            wait_for_any([process.sentinel for process in running], timeout=remaining)
    finally:
        for process in ranks:
            if process.exitcode is None:
                process.kill()
            process.join()

    problems = []
    for rank, process in enumerate(ranks):
        traceback_file = out_dir / f"rank{rank}.traceback"
        if traceback_file.exists():
            problems.append(f"rank {rank} raised:\n{traceback_file.read_text()}")
        elif process.exitcode != 0:
            problems.append(f"rank {rank} exited with code {process.exitcode}")
    if timed_out:
        problems.insert(0, f"ranks did not finish within {SPAWN_TIMEOUT_S} s and were killed")
        for rank in range(WORLD_SIZE):
            stacks = out_dir / f"rank{rank}.stacks"
            if stacks.exists():
                problems.append(f"rank {rank} stacks after {STACK_DUMP_S} s:\n{stacks.read_text()}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    """Each rank's results: {case name: {"stock": ..., "torch_ext": ...}}."""
    return _run_ranks(tmp_path_factory.mktemp("ddp"))


def _assert_equal(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    if expected is None or actual is None:
        assert actual is expected, f"{what}: {actual} != {expected}"
        return
    assert torch.equal(actual, expected), f"{what}: max abs diff {(actual - expected).abs().max().item()}"


@pytest.mark.parametrize("case_name", list(CASES))
def test_ddp_training_matches_stock(case_name, ddp_results):
    for rank, result in enumerate(ddp_results):
        stock, ours = result[case_name]["stock"], result[case_name]["torch_ext"]
        assert not stock["driver_ran"], f"rank {rank}: the stock run went through torch_ext"
        assert ours["driver_ran"], f"rank {rank}: backward under enabled() did not run on torch_ext"
        assert ours["losses"] == stock["losses"], f"rank {rank}"
        for step, (stock_grads, our_grads) in enumerate(zip(stock["grads"], ours["grads"], strict=True)):
            assert our_grads.keys() == stock_grads.keys()
            for name, grad in stock_grads.items():
                _assert_equal(our_grads[name], grad, f"rank {rank}, step {step}, grad of {name}")
        for name, param in stock["params"].items():
            _assert_equal(ours["params"][name], param, f"rank {rank}, final {name}")

    # DDP really averaged: the ranks saw different data yet hold the same gradients. (Without its
    # hooks or its final callback each rank would keep its local gradient and this would fail.)
    first, second = (result[case_name]["torch_ext"] for result in ddp_results)
    assert first["losses"] != second["losses"]
    for step in range(STEPS):
        for name, grad in first["grads"][step].items():
            _assert_equal(second["grads"][step][name], grad, f"step {step}, grad of {name} on rank 1 vs rank 0")
