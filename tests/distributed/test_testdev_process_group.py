"""``testdev_gloo`` (tests/testdev/distributed.py), the test device's collective backend, on 2 ranks.

Each rank re-initialises its default group as a user would, ``"cpu:gloo,testdev:testdev_gloo"``, and works on
its own device (``testdev:rank``). Every collective, and the functional collectives waited with ``wait_tensor``,
gives gloo's bits on CPU. A collective is asynchronous on the streams, as on NCCL: issued behind a held current
stream it returns at once, reads its input only after the stream's earlier work, ``work.wait()`` returns without
blocking the host yet orders later reads after the collective. The work's future, a barrier, gloo's errors and a
DDP step are checked too.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import COLLECTIVE_TIMEOUT_S, assert_identical, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

pytestmark = pytest.mark.distributed  # the ranks load the test device; this process does not

BACKEND = "cpu:gloo,testdev:testdev_gloo"
INIT_METHOD_ENV = "TESTDEV_PG_TEST_INIT_METHOD"
# Long enough that the checks made while the stream is held cannot race its end on a loaded machine.
HOLD_MS = 300
C10D_FUNCTIONAL = torch.ops._c10d_functional


def _collectives(rank: int, device: torch.device) -> dict:
    """Every collective the backend supports, on ``device``; each result as a CPU tensor (or list of them)."""
    group = dist.group.WORLD
    name = group.group_name

    def base(dtype=torch.float32) -> torch.Tensor:
        return (torch.arange(8, dtype=dtype) * (rank + 1) + 10 * rank).to(device)

    out: dict = {}
    for op_name, op, dtype in [
        ("sum", dist.ReduceOp.SUM, torch.float32),
        ("avg", dist.ReduceOp.AVG, torch.float32),
        ("max", dist.ReduceOp.MAX, torch.int64),
    ]:
        t = base(dtype)
        dist.all_reduce(t, op=op)
        out[f"all_reduce_{op_name}"] = t.cpu()

    # The CPU alias gloo works on has the tensor's own offset and strides.
    t = base()
    dist.all_reduce(t[2:6])
    out["all_reduce_offset_view"] = t.cpu()
    t = base().reshape(2, 4).t()
    dist.all_reduce(t)
    out["all_reduce_transposed"] = t.cpu()
    t = base(torch.bfloat16)
    dist.all_reduce(t)
    out["all_reduce_bfloat16"] = t.cpu()

    gathered = [torch.empty(8, device=device) for _ in range(2)]
    dist.all_gather(gathered, base())
    out["all_gather"] = [t.cpu() for t in gathered]

    gathered = torch.empty(16, device=device)
    dist.all_gather_single(gathered, base())
    out["all_gather_into_tensor"] = gathered.cpu()

    scattered = torch.empty(4, device=device)
    dist.reduce_scatter(scattered, list(base().chunk(2)))
    out["reduce_scatter"] = scattered.cpu()

    scattered = torch.empty(4, device=device)
    dist.reduce_scatter_single(scattered, base())
    out["reduce_scatter_tensor"] = scattered.cpu()

    exchanged = torch.empty(8, device=device)
    dist.all_to_all_single(exchanged, base())
    out["all_to_all_single"] = exchanged.cpu()

    # Uneven splits: rank 0 sends 3 to itself and 5 to rank 1; rank 1 sends 2 and 6.
    input_splits = [3, 5] if rank == 0 else [2, 6]
    output_splits = [3, 2] if rank == 0 else [5, 6]
    exchanged = torch.empty(sum(output_splits), device=device)
    dist.all_to_all_single(exchanged, base(), output_splits, input_splits)
    out["all_to_all_single_splits"] = exchanged.cpu()

    t = base()
    dist.broadcast(t, src=1)
    out["broadcast"] = t.cpu()

    # The functional collectives, as DTensor and torchtitan issue them: ops returning a new tensor, waited with
    # wait_tensor.
    out["funcol_all_reduce"] = C10D_FUNCTIONAL.wait_tensor(C10D_FUNCTIONAL.all_reduce(base(), "sum", name)).cpu()
    out["funcol_all_to_all_single"] = C10D_FUNCTIONAL.wait_tensor(
        C10D_FUNCTIONAL.all_to_all_single(base(), output_splits, input_splits, name)
    ).cpu()
    out["funcol_all_gather_into_tensor"] = C10D_FUNCTIONAL.wait_tensor(
        C10D_FUNCTIONAL.all_gather_into_tensor(base(), 2, name)
    ).cpu()
    out["funcol_reduce_scatter_tensor"] = C10D_FUNCTIONAL.wait_tensor(
        C10D_FUNCTIONAL.reduce_scatter_tensor(base(), "sum", 2, name)
    ).cpu()
    pair = [base(), base()[:4] * 2]
    for op_name, outputs in [
        ("all_reduce_coalesced", C10D_FUNCTIONAL.all_reduce_coalesced(pair, "sum", name)),
        ("all_gather_into_tensor_coalesced", C10D_FUNCTIONAL.all_gather_into_tensor_coalesced(pair, 2, name)),
        ("reduce_scatter_tensor_coalesced", C10D_FUNCTIONAL.reduce_scatter_tensor_coalesced(pair, "sum", 2, name)),
    ]:
        out[f"funcol_{op_name}"] = [C10D_FUNCTIONAL.wait_tensor(t).cpu() for t in outputs]
    # The Python wrappers' AsyncCollectiveTensor waits on first use.
    out["funcol_wrapper_all_reduce"] = (funcol.all_reduce(base(), "sum", group) + 0).cpu()
    return out


def _asynchrony(rank: int, device: torch.device) -> dict:
    """A collective issued behind a held current stream: what the host saw, and the values."""
    import testdev

    result: dict = {}
    t = torch.zeros(1024, device=device)
    # The input is written after the hold: a collective that did not wait for the current stream reads zeros.
    testdev.hold(HOLD_MS)
    t.fill_(rank + 1)
    start = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    result["call_s"] = time.perf_counter() - start
    result["completed_after_call"] = work.is_completed()
    start = time.perf_counter()
    work.wait()
    result["wait_s"] = time.perf_counter() - start
    result["completed_after_wait"] = work.is_completed()
    # A read issued after wait() on the current stream runs after the collective.
    result["value"] = t.cpu()
    result["completed_after_read"] = work.is_completed()

    # The same through a functional collective and wait_tensor.
    x = torch.zeros(4, device=device)
    testdev.hold(HOLD_MS)
    x.fill_(rank + 1)
    start = time.perf_counter()
    reduced = C10D_FUNCTIONAL.wait_tensor(C10D_FUNCTIONAL.all_reduce(x, "sum", dist.group.WORLD.group_name))
    result["funcol_call_and_wait_s"] = time.perf_counter() - start
    result["funcol_value"] = reduced.cpu()
    return result


def _future(rank: int, device: torch.device) -> dict:
    t = torch.full((4,), float(rank + 1), device=device)
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    doubled = future.then(lambda f: f.value()[0] * 2)
    return {
        "value": [v.cpu() for v in future.wait()],
        "then": doubled.wait().cpu(),
        "result": [v.cpu() for v in work.result()],
    }


def _barrier(rank: int, device: torch.device) -> dict:
    """The backend's barrier blocks the host until every rank's stream reached it: rank 0 holds its stream."""
    import testdev

    backend = dist.group.WORLD._get_backend(device)
    dist.all_reduce(torch.zeros(1, device=device))  # the ranks start level
    if rank == 0:
        testdev.hold(HOLD_MS)
    start = time.perf_counter()
    backend.barrier().wait()
    return {"wait_s": time.perf_counter() - start, "backend": type(backend).__name__}


def _errors(rank: int, device: torch.device) -> dict:
    """gloo's error (an invalid root, refused on every rank alike) reaches the work and its future."""
    backend = dist.group.WORLD._get_backend(device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 5
    work = backend.broadcast([torch.ones(2, device=device)], opts)
    result: dict = {}
    try:
        work.wait(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        result["wait"] = None
    except RuntimeError as error:
        result["wait"] = str(error)
    try:
        work.get_future().wait()
        result["future"] = None
    except RuntimeError as error:
        result["future"] = str(error)
    result["is_success"] = work.is_success()
    # The backend goes on working.
    t = torch.ones(2, device=device)
    dist.all_reduce(t)
    result["after"] = t.cpu()
    return result


def _ddp(rank: int) -> dict:
    """One DDP step of the same model on CPU (gloo) and on the rank's device: the gradients DDP averaged."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    models = {"gloo_on_cpu": model, "testdev": copy.deepcopy(model).to(torch.device("testdev", rank))}
    tokens = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    grads = {}
    for name, replica in models.items():
        device = next(replica.parameters()).device
        ddp = DistributedDataParallel(replica, device_ids=[rank] if device.type == "testdev" else None)
        ddp(tokens.to(device)).square().sum().backward()
        grads[name] = [param.grad.cpu() for param in replica.parameters()]
    return grads


def _run(rank: int) -> dict:
    import testdev
    import testdev.distributed

    testdev.distributed.register_backend()
    testdev.distributed.register_backend()  # idempotent
    # The harness's group is gloo alone: start over as a user of testdev_gloo does.
    dist.destroy_process_group()
    dist.init_process_group(
        BACKEND,
        rank=rank,
        world_size=2,
        init_method=os.environ[INIT_METHOD_ENV],
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    torch.testdev.set_device(rank)
    device = torch.device("testdev", rank)
    return {
        "gloo_on_cpu": _collectives(rank, torch.device("cpu")),
        "testdev": _collectives(rank, device),
        "asynchrony": _asynchrony(rank, device),
        "future": _future(rank, device),
        "barrier": _barrier(rank, device),
        "errors": _errors(rank, device),
        "ddp": _ddp(rank),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    testdev = pytest.importorskip("testdev")
    if not testdev.is_available():
        pytest.skip("testdev cannot be built here (no C++ compiler or ninja)")
    testdev.load()  # built once here, not by both ranks at once
    out_dir = tmp_path_factory.mktemp("testdev_process_group")
    init_method = f"file://{out_dir / 'init_store'}"
    return run_ranks(_run, out_dir, env={INIT_METHOD_ENV: init_method})


def test_every_collective_gives_gloos_bits_on_cpu(results):
    for rank, result in enumerate(results):
        assert result["testdev"].keys() == result["gloo_on_cpu"].keys()
        for name, expected in result["gloo_on_cpu"].items():
            assert_identical(result["testdev"][name], expected, f"rank {rank} {name}")


def test_ddp_averages_gradients_as_on_cpu(results):
    for rank, result in enumerate(results):
        assert_identical(result["ddp"]["testdev"], result["ddp"]["gloo_on_cpu"], f"rank {rank}")


def test_a_collective_is_asynchronous_on_the_streams(results):
    hold_s = HOLD_MS / 1000
    for rank, result in enumerate(results):
        run = result["asynchrony"]
        assert run["call_s"] < hold_s / 3 and run["wait_s"] < hold_s / 3, (rank, run)
        assert not run["completed_after_call"] and not run["completed_after_wait"], (rank, run)
        assert run["completed_after_read"], rank
        assert torch.equal(run["value"], torch.full((1024,), 3.0)), rank
        assert run["funcol_call_and_wait_s"] < hold_s / 3, (rank, run)
        assert torch.equal(run["funcol_value"], torch.full((4,), 3.0)), rank


def test_the_future_completes_with_the_outputs(results):
    for rank, result in enumerate(results):
        future = result["future"]
        assert_identical(future["value"], [torch.full((4,), 3.0)], f"rank {rank}")
        assert_identical(future["result"], [torch.full((4,), 3.0)], f"rank {rank}")
        assert_identical(future["then"], torch.full((4,), 6.0), f"rank {rank}")


def test_a_barrier_waits_for_every_ranks_stream(results):
    for rank, result in enumerate(results):
        assert result["barrier"]["backend"] == "ProcessGroupTestdev"
        # Rank 1 waits for rank 0's held stream; rank 0 for its own.
        assert result["barrier"]["wait_s"] > HOLD_MS / 1000 / 2, (rank, result["barrier"])


def test_gloos_errors_reach_the_work_and_its_future(results):
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "invalid root rank" in (errors["wait"] or ""), (rank, errors)
        assert "invalid root rank" in (errors["future"] or ""), (rank, errors)
        assert not errors["is_success"], rank
        assert torch.equal(errors["after"], torch.full((2,), 2.0)), rank
