"""Runs a function on gloo ranks (two unless told) over loopback and compares stock PyTorch's results with torch_ext's.

A test module hands :func:`run_ranks` a module-level function of the rank; each spawned rank joins
one process group, calls it and sends back what it returned (nested dicts and lists of tensors,
numbers and None). Spawning is most of a distributed test's time, so a module runs its cases in few
pairs of processes (one per concern, so that a failure or hang in one spares the rest), each case on
both engines (:func:`train_on_both_engines`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.profiler_util import EventList

import torch_ext
from torch_ext import testing

WORLD_SIZE = 2
# Whole run, both ranks: spawning costs ~7 s on 2 cores, each case about a second.
SPAWN_TIMEOUT_S = 120
# A rank whose peer died fails its collective after this instead of waiting forever.
COLLECTIVE_TIMEOUT_S = 60
# A rank still running this long before the spawn timeout writes every thread's stack, which the
# test reports if it hangs.
STACK_DUMP_MARGIN_S = 20


def train_on_both_engines(cases: Mapping[str, object], train: Callable[..., dict], rank: int) -> dict:
    """``{case name: {"stock": train(case, rank, False), "torch_ext": train(case, rank, True)}}``."""
    results = {}
    for case_name, case in cases.items():
        try:
            results[case_name] = {
                "stock": train(case, rank, on_torch_ext=False),
                "torch_ext": train(case, rank, on_torch_ext=True),
            }
        except BaseException as error:
            error.add_note(f"in case {case_name!r}")
            raise
    return results


def profiled_backward(loss: torch.Tensor) -> EventList:
    """``loss.backward()`` under the profiler; returns its events in the order they began."""
    with torch.profiler.profile() as profile:
        loss.backward()
    return profile.events()


def node_threads(events: EventList, is_collective: Callable[[str], bool]) -> dict[str, set[int]]:
    """The threads a profiled backward ran the collective's nodes on (events whose name ``is_collective`` accepts)
    and the dense path's (its matmuls, AddmmBackward): ``{"all_to_all": ..., "dense": ...}``. A lane shows as a
    collective thread apart from the dense ones."""
    threads: dict[str, set[int]] = {"all_to_all": set(), "dense": set()}
    for event in events:
        if is_collective(event.name):
            threads["all_to_all"].add(event.thread)
        elif event.name.startswith("autograd::engine::evaluate_function: AddmmBackward"):
            threads["dense"].add(event.thread)
    return threads


def ran_on_torch_ext(events: EventList) -> bool:
    """Whether a profiled backward ran on torch_ext's engine.

    torch_ext's host task runs its driver node on the stock engine, and stock never does.
    """
    return any("torch_ext::BackwardDriver" in event.name for event in events)


def parameter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each parameter's gradient, by name."""
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def train_steps(
    model: torch.nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    on_torch_ext: bool,
    first_backward: Callable[[EventList], dict] = lambda events: {"driver_ran": ran_on_torch_ext(events)},
) -> dict:
    """``steps`` AdamW steps (lr 0.01, MSE against ``batch(step)``'s targets) on either engine: each step's loss
    and gradients, the final parameters, and what ``first_backward`` reads from the first backward's profiled
    events (by default whether it ran on torch_ext)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    result: dict = {"losses": [], "grads": []}
    with torch_ext.enable() if on_torch_ext else contextlib.nullcontext():
        for step in range(steps):
            tokens, target = batch(step)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(tokens), target)
            if step == 0:
                result.update(first_backward(profiled_backward(loss)))
            else:
                loss.backward()
            result["losses"].append(loss.detach())
            result["grads"].append(parameter_grads(model))
            optimizer.step()
    result["params"] = {name: param.detach().clone() for name, param in model.named_parameters()}
    return result


def rank_batch(rank: int, step: int, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens x dim inputs, tokens x 1 targets)``, different on every rank and step, the same in every run."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(tokens, dim, generator=generator), torch.randn(tokens, 1, generator=generator)


def assert_torch_ext_matches_stock(rank_results: list[dict], case_name: str) -> None:
    """On every rank, the case's torch_ext run returned exactly what its stock run did.

    Each run's result must hold ``"driver_ran"`` (from :func:`ran_on_torch_ext`): the stock run must
    not have gone through torch_ext, the other must have.
    """
    for rank, result in enumerate(rank_results):
        stock, ours = dict(result[case_name]["stock"]), dict(result[case_name]["torch_ext"])
        assert not stock.pop("driver_ran"), f"rank {rank}: the stock run went through torch_ext"
        assert ours.pop("driver_ran"), f"rank {rank}: backward under enable() did not run on torch_ext"
        assert_identical(ours, stock, f"rank {rank}")


def assert_identical(actual, expected, where: str) -> None:
    """torch_ext.testing.assert_identical: nested results equal bit for bit, dtypes, shapes and strides too."""
    testing.assert_identical(actual, expected, where)


def run_ranks(
    run_on_rank: Callable[[int], dict],
    out_dir: Path,
    timeout_s: float = SPAWN_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    world_size: int = WORLD_SIZE,
) -> list[dict]:
    """Runs ``run_on_rank(rank)`` on each of ``world_size`` ranks, inside a gloo process group on loopback.

    ``run_on_rank`` must be a module-level function (spawned ranks import it by name). ``env`` is
    added to the ranks' environment (read at their import of torch_ext, e.g.
    ``TORCH_EXT_CURRENT_NODE``). Returns each rank's result, or fails the test with every rank's
    traceback, or its stacks if it hung.
    """
    context = mp.get_context("spawn")
    # The ranks rendezvous through a store the test holds open on a port the OS chose, so no other
    # process on a busy machine can take that port between choosing it and the ranks' start.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    port = store.port
    stack_dump_s = max(timeout_s - STACK_DUMP_MARGIN_S, 1)
    ranks = [
        context.Process(
            target=_rank_main,
            args=(rank, port, str(out_dir), run_on_rank, torch_ext.__file__, stack_dump_s, world_size),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    # A spawned process takes the parent's environment as it is at start().
    saved_env = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        for process in ranks:
            process.start()
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    deadline = time.monotonic() + timeout_s
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
        del store

    problems = []
    for rank, process in enumerate(ranks):
        traceback_file = out_dir / f"rank{rank}.traceback"
        if traceback_file.exists():
            problems.append(f"rank {rank} raised:\n{traceback_file.read_text()}")
        elif process.exitcode != 0:
            problems.append(f"rank {rank} exited with code {process.exitcode}")
    if timed_out:
        problems.insert(0, f"ranks did not finish within {timeout_s} s and were killed")
        for rank in range(world_size):
            stacks = out_dir / f"rank{rank}.stacks"
            if stacks.exists():
                problems.append(f"rank {rank} stacks after {stack_dump_s} s:\n{stacks.read_text()}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


def _run_in_process_group(
    rank: int, port: int, run_on_rank: Callable[[int], dict], parent_torch_ext_file: str, world_size: int
):
    # The rank got the parent's sys.path from spawn; make sure it resolved to the same build.
    if torch_ext.__file__ != parent_torch_ext_file:
        raise ImportError(f"rank imported torch_ext from {torch_ext.__file__}, the test from {parent_torch_ext_file}")
    torch.set_num_threads(1)  # the ranks share two cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        return run_on_rank(rank)
    finally:
        dist.destroy_process_group()


def _rank_main(
    rank: int,
    port: int,
    out_dir: str,
    run_on_rank: Callable[[int], dict],
    parent_torch_ext_file: str,
    stack_dump_s: float,
    world_size: int,
) -> None:
    out = Path(out_dir)
    with open(out / f"rank{rank}.stacks", "w") as stack_dump:
        # Should the rank hang, the test reports where.
        faulthandler.dump_traceback_later(stack_dump_s, file=stack_dump)
        try:
            results = _run_in_process_group(rank, port, run_on_rank, parent_torch_ext_file, world_size)
        except BaseException:
            (out / f"rank{rank}.traceback").write_text(traceback.format_exc())
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
    torch.save(results, out / f"rank{rank}.pt")
    # Leave at once, without the interpreter's and C++'s exit-time teardown: a rank that had saved its result
    # still died there now and then ("terminate called without an active exception", a library's thread
    # still joinable at exit; seen in test_collectives' TORCH_EXT_CURRENT_NODE=off scheduling spawn, as
    # benchmarks/harness/hosts.py's leave_rank saw it in the benchmarks' ranks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
