"""torch_ext.integrations without ranks: importing it imports no library, and each switch refuses what it cannot
overlap, before anything runs. The switches themselves are tested against the libraries' own loops, bit for bit,
in tests/distributed/test_trainer_integrations.py."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import torch_ext.integrations.deepspeed

LIBRARIES = ("megatron", "deepspeed", "torchtitan")
NEEDS_MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="Megatron-core is not installed"
)
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")


def test_importing_the_integrations_imports_no_library():
    code = (
        "import sys\n"
        "import torch_ext, torch_ext.integrations, torch_ext.integrations.megatron, torch_ext.integrations.deepspeed\n"
        f"print(sorted({{name.partition('.')[0] for name in sys.modules}} & set({LIBRARIES!r})))\n"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


@NEEDS_MEGATRON
def test_megatron_switch_refuses_pipelined_schedules_and_unknown_rules():
    from megatron.core.pipeline_parallel import schedules

    import torch_ext.integrations.megatron

    for schedule in (
        schedules.forward_backward_pipelining_without_interleaving,
        schedules.forward_backward_pipelining_with_interleaving,
    ):
        with pytest.raises(ValueError, match=f"forward_backward_no_pipelining only, not {schedule.__name__}"):
            torch_ext.integrations.megatron.overlap_microbatches(schedule)
    with pytest.raises(ValueError, match="forward_collectives must be one of"):
        torch_ext.integrations.megatron.overlap_microbatches(
            schedules.forward_backward_no_pipelining, forward_collectives="at_once"
        )


class _EngineSettings:
    """What the DeepSpeed switch reads of an engine before wrapping it."""

    def __init__(self, stage: int, managed: bool) -> None:
        self.stage, self.managed = stage, managed

    def zero_optimization_stage(self) -> int:
        return self.stage

    def managed_gradient_accumulation(self) -> bool:
        return self.managed


@NEEDS_DEEPSPEED
def test_deepspeed_switch_refuses_what_it_cannot_hand_over():
    overlap_microbatches = torch_ext.integrations.deepspeed.overlap_microbatches
    with pytest.raises(ValueError, match="ZeRO stage 2 is not supported"):
        overlap_microbatches(_EngineSettings(2, managed=True))
    with pytest.raises(ValueError, match="managed_gradient_accumulation=False"):
        overlap_microbatches(_EngineSettings(0, managed=False))
    assert isinstance(
        overlap_microbatches(_EngineSettings(0, managed=True)), torch_ext.integrations.deepspeed.OverlappedEngine
    )


class _MicroStepEngine(torch.nn.Module):
    """What the overlapped engine calls of a DeepSpeed engine off the accumulation boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def is_gradient_accumulation_boundary(self) -> bool:
        return False


def test_deepspeed_micro_step_without_step_is_refused():
    """A micro-step without engine.step() (set_gradient_accumulation_boundary's loop, one step() a cycle) is refused
    at the next forward, not run wrong."""
    engine = torch_ext.integrations.deepspeed.OverlappedEngine(_MicroStepEngine(), "after_backward_collectives")
    try:
        engine.backward(engine(torch.ones(2)))
        with pytest.raises(RuntimeError, match=r"without engine.step\(\)"):
            engine(torch.ones(2))
    finally:
        engine.close()
    assert torch.equal(engine.weight.grad, torch.ones(2))
