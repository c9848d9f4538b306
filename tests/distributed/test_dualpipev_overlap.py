"""``ScheduleDualPipeV`` with ``torch_ext.pipelining.overlap_f_b`` as its OVERLAP_F_B function trains to the bits of
the default, which runs each overlapped step's forward and then its backward.

Two gloo ranks run a 4-stage V pipeline (rank r holds stages r and 3 - r) with dropout in every stage, several
AdamW steps, each step seeded alike in both runs: every loss, gradient and parameter must be equal bit for bit.
The overlapped run also shows its forward and backward running at the same time: in its first OVERLAP_F_B action
the forward's pre-hook and the backward's gradient hook meet at a barrier, which a forward-then-backward run
could never pass. Errors in either sub-action surface in ``step()`` naming the sub-action, leaving no thread
behind; those cases run on single-rank subgroups, whose V holds both stages and needs no send or receive.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from _harness import assert_identical, ran_on_torch_ext, run_ranks
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
from torch.distributed.pipelining.schedules import OVERLAP_F_B

import torch_ext
import torch_ext.pipelining

pytestmark = pytest.mark.distributed

STEPS = 3
MICROBATCHES = 6
NUM_STAGES = 4
WIDTH = 8
BATCH = 12
# Long enough for a busy machine; the barrier is passed at once when the two sub-actions run together.
MEETING_TIMEOUT_S = 30
BACKWARD_THREAD = "torch_ext-microbatch-backward"


def _stage_module(stage_index: int) -> nn.Module:
    torch.manual_seed(100 + stage_index)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Dropout(0.25), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def _loss(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return ((output - target) ** 2).mean() * scale


class Meeting:
    """Where the first OVERLAP_F_B action's forward (at its stage's forward pre-hook) and backward (at its first
    gradient hook off the calling thread) wait for each other."""

    def __init__(self) -> None:
        self.in_overlap_action = False
        self.barrier = threading.Barrier(2, timeout=MEETING_TIMEOUT_S)
        self.threads: dict[str, str] = {}

    def forward_started(self) -> None:
        if self.in_overlap_action and "forward" not in self.threads:
            self.threads["forward"] = threading.current_thread().name
            self.barrier.wait()

    def backward_running(self) -> None:
        if threading.current_thread() is not threading.main_thread() and "backward" not in self.threads:
            self.threads["backward"] = threading.current_thread().name
            self.barrier.wait()


def _watch(modules: dict[int, nn.Module], meeting: Meeting) -> None:
    """The same hooks in both runs; they wait only in an OVERLAP_F_B action and off the calling thread."""

    def on_output(module, args, output):
        if output.requires_grad:
            output.register_hook(lambda grad: meeting.backward_running())

    for module in modules.values():
        module.register_forward_pre_hook(lambda module, args: meeting.forward_started())
        module.register_forward_hook(on_output)


def _schedule(
    stages: list[PipelineStage], overlapped: bool, meeting: Meeting, n_microbatches: int = MICROBATCHES
) -> ScheduleDualPipeV:
    schedule = ScheduleDualPipeV(stages, n_microbatches=n_microbatches, loss_fn=_loss)
    if overlapped:
        torch_ext.pipelining.use_overlapped_f_b(schedule)
        assert schedule._comp_type_to_function_map[OVERLAP_F_B] is torch_ext.pipelining.overlap_f_b

        # Marks the action's duration for the forward's hook.
        def overlap_f_b(action, ctx):
            meeting.in_overlap_action = True
            try:
                torch_ext.pipelining.overlap_f_b(action, ctx)
            finally:
                meeting.in_overlap_action = False

        schedule._comp_type_to_function_map[OVERLAP_F_B] = overlap_f_b
    return schedule


def _train(rank: int, overlapped: bool) -> dict:
    indices = (rank, NUM_STAGES - 1 - rank)
    modules = {index: _stage_module(index) for index in indices}
    meeting = Meeting()
    _watch(modules, meeting)
    stages = [PipelineStage(modules[index], index, NUM_STAGES, torch.device("cpu")) for index in indices]
    schedule = _schedule(stages, overlapped, meeting)
    optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=0.01)
    generator = torch.Generator().manual_seed(0)
    losses, grads, outputs, engines = [], [], [], []
    for step in range(STEPS):
        # Every rank draws the same data; the first stage reads the inputs, the last the targets.
        inputs = torch.randn(BATCH, WIDTH, generator=generator)
        target = torch.randn(BATCH, WIDTH, generator=generator)
        optimizer.zero_grad()
        # Dropout's masks: the same draws, in the same order, in both runs.
        torch.manual_seed(1000 * step + rank)
        step_losses: list[torch.Tensor] = []
        with torch.profiler.profile() as profile:
            if rank == 0:  # holds the first and the last stage; the loss's keyword arguments go with the forward
                output = schedule.step(inputs, target=target, losses=step_losses, loss_kwargs={"scale": 0.75})
            else:
                output = schedule.step()
        engines.append(ran_on_torch_ext(profile.events()))
        outputs.append(output)
        losses.append([loss.detach().clone() for loss in step_losses])
        grads.append({f"stage{i}.{n}": p.grad.clone() for i, m in modules.items() for n, p in m.named_parameters()})
        optimizer.step()
    dist.barrier()
    params = {f"stage{i}.{n}": p.detach().clone() for i, m in modules.items() for n, p in m.named_parameters()}
    return {
        "bits": {"losses": losses, "grads": grads, "params": params, "outputs": outputs},
        "ran_on_torch_ext": engines,
        "meeting": meeting.threads,
        "threads_after": sorted(t.name for t in threading.enumerate()),
    }


# -- errors, on a single-rank V ---------------------------------------------------------------------------------


def _error_case(group: dist.ProcessGroup, where: str) -> dict:
    """One step on a single-rank V whose first overlapped forward or backward raises."""
    modules = {index: _stage_module(index) for index in (0, 1)}
    meeting = Meeting()

    def fail() -> None:
        if where not in meeting.threads:
            meeting.threads[where] = threading.current_thread().name
            raise ValueError(f"the {where} failed")

    def forward_pre_hook(module, args) -> None:
        if meeting.in_overlap_action:
            fail()

    def gradient_hook(grad: torch.Tensor) -> None:
        if threading.current_thread() is not threading.main_thread():
            fail()

    def forward_hook(module, args, output) -> None:
        if output.requires_grad:
            output.register_hook(gradient_hook)

    for module in modules.values():
        if where == "forward":
            module.register_forward_pre_hook(forward_pre_hook)
        else:
            module.register_forward_hook(forward_hook)
    stages = [PipelineStage(modules[index], index, 2, torch.device("cpu"), group=group) for index in (0, 1)]
    schedule = _schedule(stages, True, meeting, n_microbatches=3)
    try:
        schedule.step(torch.randn(BATCH, WIDTH), target=torch.randn(BATCH, WIDTH))
        raised = None
    except Exception as error:  # noqa: BLE001 - returned to the test
        # The stage wraps its backward's errors in a RuntimeError.
        causes = []
        cause: BaseException | None = error
        while cause is not None:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        raised = (causes, getattr(error, "__notes__", []))
    # The overlap's window was closed: another may open.
    with torch_ext.overlap_microbatches():
        pass
    return {
        "raised": raised,
        "thread": meeting.threads.get(where),
        "threads_after": sorted(t.name for t in threading.enumerate()),
    }


def _run(rank: int) -> dict:
    results = {"default": _train(rank, overlapped=False), "overlapped": _train(rank, overlapped=True)}
    # Every rank makes every group, in the same order.
    own_group = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    for where in ("backward", "forward"):
        results[f"{where}_fails"] = _error_case(own_group, where)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, tmp_path_factory.mktemp("dualpipev_overlap"), timeout_s=180)


def test_overlapped_f_b_trains_to_the_defaults_bits(results):
    for rank, result in enumerate(results):
        assert_identical(result["overlapped"]["bits"], result["default"]["bits"], f"rank {rank}")
        # The overlapped backwards ran on torch_ext's engine, the default's on stock's.
        assert result["overlapped"]["ran_on_torch_ext"] == [True] * STEPS, rank
        assert result["default"]["ran_on_torch_ext"] == [False] * STEPS, rank
    assert len(results[0]["default"]["bits"]["losses"][0]) == MICROBATCHES
    assert results[0]["default"]["bits"]["outputs"][0].shape == (BATCH, WIDTH)


def test_forward_and_backward_ran_at_the_same_time(results):
    for rank, result in enumerate(results):
        threads = result["overlapped"]["meeting"]
        assert threads.get("forward") == "MainThread", (rank, threads)
        assert threads.get("backward") not in (None, "MainThread"), (rank, threads)
        # The default never ran a backward off the calling thread, nor a forward in an OVERLAP_F_B function.
        assert result["default"]["meeting"] == {}, (rank, result["default"]["meeting"])
        assert BACKWARD_THREAD not in result["overlapped"]["threads_after"], (rank, result)


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_an_error_in_either_sub_action_surfaces_naming_it(results, where):
    for rank, result in enumerate(results):
        case = result[f"{where}_fails"]
        assert case["raised"] is not None, (rank, case)
        causes, notes = case["raised"]
        assert f"ValueError: the {where} failed" in causes, (rank, case)
        assert any(f"in the {where} " in note and "overlap_f_b" in note for note in notes), (rank, notes)
        assert (case["thread"] == "MainThread") == (where == "forward"), (rank, case)
        assert BACKWARD_THREAD not in case["threads_after"], (rank, case)
