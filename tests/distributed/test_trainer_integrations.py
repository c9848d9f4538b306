"""One switch in the libraries' own loops (``torch_ext.integrations``), on 2 gloo ranks: 2 optimizer steps of 4
microbatches each (gradient accumulation), dropout in the model, an MoE layer whose all_to_all runs in a lane. Every
loss, every step's gradients and the final parameters must equal the library's own loop's, without the switch, bit
for bit, on both ranks; and every microbatch's backward but each step's last must have run on torch_ext's backward
thread, so that a switch that does nothing fails. Each switch runs with the default rule for the next forward's
collectives and with them beside the backward's on twin groups (gloo).

- Megatron-core 0.16.1: the function ``get_forward_backward_func()`` returns (``forward_backward_no_pipelining``)
  on Megatron's ``MoELayer`` (dropless alltoall dispatcher, expert parallel 2, its ``_AllToAll``) inside Megatron's
  ``DistributedDataParallel`` with ``overlap_grad_reduce`` (data parallel 2), set up as Megatron-LM's trainer sets
  it: ``config.no_sync_func`` is DDP's ``no_sync`` and ``config.finalize_model_grads_func`` Megatron's
  ``finalize_model_grads``. From the second step on, DDP's backward hooks start the gradient all-reduce during the
  last microbatch's backward. Each backward reads, at its last node, whether DDP's ``no_sync`` is entered: in both
  loops, in every backward but each step's last. The model's CPU stand-ins are test_microbatch_overlap_libraries'
  (``_megatron_on_cpu``), plus :class:`_CudaTensorsOnCpu` for the schedule's one tensor made on "cuda".
- Megatron's pipelined schedule, which the switch refuses (a backward's input gradient goes to the previous stage at
  once): ``forward_backward_pipelining_without_interleaving`` under ``torch_ext.enable()`` against stock's engine
  (no switch). Over two stages, one a rank; and over two stages of two ranks each (pipeline 2 x expert parallel 2,
  4 ranks), each stage dispatching its tokens and combining them back through Megatron's ``_AllToAll`` on its
  expert-parallel group, declared to a lane: its backward must run on another thread than the stage's dense path.
- DeepSpeed 0.19.8: ``deepspeed.initialize``'s engine (ZeRO stage 0, gradient_accumulation_steps 4, its
  ``deepspeed.moe`` layer with top-2 gating, which all-reduces the capacity in forward) in DeepSpeed's loop,
  ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` for every microbatch.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from _harness import assert_identical, node_threads, ran_on_torch_ext, run_ranks
from test_microbatch_overlap_libraries import (
    BATCH,
    DIM,
    ENGINE_CONFIG,
    MICROBATCHES,
    NEEDS_DEEPSPEED,
    NEEDS_MEGATRON,
    SEQUENCE,
    DeepSpeedModel,
    MegatronModel,
    _deepspeed_comm,
    _megatron_on_cpu,
    _record_thread,
)
from torch.overrides import TorchFunctionMode

import torch_ext

pytestmark = pytest.mark.distributed

STEPS = 2
TWINS = "beside_backward_collectives"
# Each run of a library's loop: None is the library's own, the others the switch with that forward_collectives.
RUNS = {"own_loop": None, "switch": "after_backward_collectives", "switch_twins": TWINS}
BACKWARD_THREAD = "torch_ext-microbatch-backward"
# The profiler's name for the backward node of Megatron's _AllToAll.
ALL_TO_ALL_BACKWARD = "_AllToAllBackward"


def _check(results: list[dict], also: tuple[str, ...] = ()) -> None:
    """Each switched run gave the library's own loop's bits on both ranks (and its ``also`` results); the own loop
    ran every backward on the caller's thread, the switch every one but each step's last on torch_ext's backward
    thread."""
    switched_threads = [
        "MainThread" if i % MICROBATCHES == MICROBATCHES - 1 else BACKWARD_THREAD for i in range(STEPS * MICROBATCHES)
    ]
    for rank, result in enumerate(results):
        own = result["own_loop"]
        assert own["threads"] == ["MainThread"] * (STEPS * MICROBATCHES), (rank, own["threads"])
        for run in RUNS:
            if run == "own_loop":
                continue
            switched = result[run]
            assert switched["threads"] == switched_threads, (rank, run, switched["threads"])
            for what in ("losses", "grads", "params", *also):
                assert_identical(switched[what], own[what], f"rank {rank} {run} {what}")


# -- Megatron-core ------------------------------------------------------------------------------------------------


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Makes a tensor asked for on "cuda" on the CPU: ``forward_backward_no_pipelining`` counts the step's tokens in
    ``torch.zeros([], dtype=torch.int, device="cuda")``. Around both runs' calls alike."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class MegatronTrainerModel(MegatronModel):
    """The MoE model as Megatron's schedule takes one: a model type, and ``set_input_tensor`` (no pipeline: the
    input is the data)."""

    def __init__(self) -> None:
        from megatron.core.enums import ModelType

        super().__init__(dropless=True)
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor) -> None:
        pass


def _train_megatron(rank: int, rule: str | None) -> dict:
    """STEPS AdamW steps through Megatron's forward_backward function, switched on with ``rule`` (None: Megatron's
    own loop)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import torch_ext.integrations.megatron

    torch.manual_seed(rank)
    module = MegatronTrainerModel()
    config = module.moe.config
    model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    result: dict = {"losses": [], "grads": [], "threads": [], "in_no_sync": []}
    inside_no_sync = False

    @contextlib.contextmanager
    def no_sync():
        """DDP's no_sync, as Megatron-LM's trainer sets it, telling the hook below whether it is entered."""
        nonlocal inside_no_sync
        with model.no_sync():
            inside_no_sync = True
            try:
                yield
            finally:
                inside_no_sync = False

    config.no_sync_func = no_sync
    config.finalize_model_grads_func = finalize_model_grads
    # Whether each backward ran all of its DDP hooks inside DDP's no_sync, read at its last node (the first layer's
    # weight): Megatron's own loop runs every microbatch's but the last inside it, and so must the switch.
    module.pre[0].weight.register_post_accumulate_grad_hook(lambda param: result["in_no_sync"].append(inside_no_sync))
    forward_backward = get_forward_backward_func()
    if rule is not None:
        forward_backward = torch_ext.integrations.megatron.overlap_microbatches(
            forward_backward, forward_collectives=rule
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def loss_func(output: torch.Tensor):
        loss = output.square().mean()
        return loss, {"loss": loss.detach().clone()}  # Megatron scales the loss in place after this

    def forward_step(data_iterator, model):
        output = model(next(data_iterator))
        _record_thread(output, result["threads"])
        return output, loss_func

    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)  # the data, then dropout's draws, in forward order
        batches = [torch.randn(SEQUENCE, BATCH, DIM) for _ in range(MICROBATCHES)]
        with _CudaTensorsOnCpu():
            reduced = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=model,
                num_microbatches=MICROBATCHES,
                seq_length=SEQUENCE,
                micro_batch_size=BATCH,
            )
        result["losses"].append([entry["loss"] for entry in reduced])
        # DDP accumulates into main_grad, reduced by finalize_model_grads.
        result["grads"].append({name: p.main_grad.clone() for name, p in module.named_parameters()})
        for param in model.parameters():
            param.grad = param.main_grad
        optimizer.step()
        optimizer.zero_grad()
        model.zero_grad_buffer()
    result["params"] = {name: p.detach().clone() for name, p in module.named_parameters()}
    return result


def _run_megatron(rank: int) -> dict:
    _megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import _AllToAll

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, create_gloo_process_groups=False)
    torch_ext.run_in_lane(_AllToAll)
    results = {run: _train_megatron(rank, rule) for run, rule in RUNS.items()}
    parallel_state.destroy_model_parallel()
    return results


@NEEDS_MEGATRON
def test_megatron_forward_backward_switched_bits_equal_megatrons_own(tmp_path):
    results = run_ranks(_run_megatron, tmp_path)
    _check(results, also=("in_no_sync",))
    every_one_but_the_last = [i % MICROBATCHES != MICROBATCHES - 1 for i in range(STEPS * MICROBATCHES)]
    for rank, result in enumerate(results):
        assert result["own_loop"]["in_no_sync"] == every_one_but_the_last, rank


class PipelineStage(torch.nn.Module):
    """One stage of a two-stage pipeline for Megatron's pipelined schedule: Linear, dropout, Tanh, on the data
    (the first stage) or on the activation Megatron received from the stage before (``set_input_tensor``)."""

    def __init__(self, config) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.layers = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Dropout(0.25), torch.nn.Tanh())
        self.received: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor) -> None:
        self.received = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens if self.received is None else self.received)


class ExpertParallelStage(PipelineStage):
    """A :class:`PipelineStage` whose output goes on through an expert-parallel layer: each rank's tokens (its
    SEQUENCE rows, half to each rank of the stage's expert-parallel group) dispatched by Megatron's
    ``all_to_all``, the rank's expert, combined back by another; plus a dense path beside it."""

    def __init__(self, config) -> None:
        from megatron.core import parallel_state

        super().__init__(config)
        self.group = parallel_state.get_expert_model_parallel_group()
        self.expert = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.Tanh(), torch.nn.Linear(2 * DIM, DIM))
        self.dense = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import all_to_all

        hidden = super().forward(tokens)
        dispatched = all_to_all(self.group, hidden)
        combined = all_to_all(self.group, self.expert(dispatched))
        return combined + self.dense(hidden)


def _train_megatron_pipelined(rank: int, on_torch_ext: bool, stage_class: type[PipelineStage]) -> dict:
    """STEPS AdamW steps through Megatron's 1F1B schedule over two stages, on stock's engine or under
    ``torch_ext.enable()``. ``deallocate_pipeline_outputs``: Megatron runs each stage's backward through
    ``Variable._execution_engine.run_backward`` itself. Also returns the threads each step's backward ran
    Megatron's ``_AllToAll`` and the dense path's matmuls on (:func:`node_threads`), over all steps."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=DIM,
        num_attention_heads=1,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,  # its batch_isend_irecv ends in torch.cuda.synchronize()
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=True,
    )
    torch.manual_seed(rank)
    stage = stage_class(config)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=0.01)
    forward_backward = get_forward_backward_func()
    result: dict = {
        "losses": [],
        "grads": [],
        "schedule": forward_backward.__name__,
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "driver_ran": False,
        "threads": {"all_to_all": set(), "dense": set()},
    }

    def loss_func(output: torch.Tensor):
        loss = output.square().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        return model(next(data_iterator)), loss_func

    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        batches = [torch.randn(SEQUENCE, BATCH, DIM) for _ in range(MICROBATCHES)]
        with (
            _CudaTensorsOnCpu(),
            torch_ext.enable() if on_torch_ext else contextlib.nullcontext(),
            torch.profiler.profile() as profile,
        ):
            reduced = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[stage],
                num_microbatches=MICROBATCHES,
                seq_length=SEQUENCE,
                micro_batch_size=BATCH,
            )
        events = profile.events()
        result["driver_ran"] |= ran_on_torch_ext(events)
        for path, threads in node_threads(events, lambda name: name == ALL_TO_ALL_BACKWARD).items():
            result["threads"][path] |= threads
        result["losses"].append([entry["loss"] for entry in reduced])  # the last stage's; none on the first
        result["grads"].append({name: p.grad.clone() for name, p in stage.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = {name: p.detach().clone() for name, p in stage.named_parameters()}
    return result


def _run_megatron_pipelined(rank: int, stage_class: type[PipelineStage] = PipelineStage) -> dict:
    _megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import _AllToAll

    expert_parallel = 1 if stage_class is PipelineStage else 2
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, expert_model_parallel_size=expert_parallel, create_gloo_process_groups=False
    )
    torch_ext.run_in_lane(_AllToAll)
    results = {
        "stock": _train_megatron_pipelined(rank, False, stage_class),
        "torch_ext": _train_megatron_pipelined(rank, True, stage_class),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "expert_group": torch.distributed.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()),
    }
    parallel_state.destroy_model_parallel()
    return results


def _run_megatron_pipelined_expert_parallel(rank: int) -> dict:
    return _run_megatron_pipelined(rank, ExpertParallelStage)


def _check_pipelined(results: list[dict]) -> None:
    """On every rank: the 1F1B schedule ran, on stock's engine and then on torch_ext's, with the same bits; the
    last stage's ranks, and only they, have each microbatch's loss."""
    for rank, result in enumerate(results):
        stock, ours = result["stock"], result["torch_ext"]
        assert stock.pop("schedule") == ours.pop("schedule") == "forward_backward_pipelining_without_interleaving"
        assert (stock.pop("driver_ran"), ours.pop("driver_ran")) == (False, True), rank
        last_stage = stock["last_stage"]
        assert [len(losses) for losses in stock["losses"]] == [MICROBATCHES * last_stage] * STEPS, rank
        assert_identical(ours, stock, f"rank {rank}")


@NEEDS_MEGATRON
def test_megatron_pipelined_schedule_on_torch_ext_bits_equal_stocks(tmp_path):
    """The switch refuses the pipelined schedules; torch_ext's engine still runs each stage's backward inside them:
    forward_backward_pipelining_without_interleaving over 2 gloo ranks, one a stage, stock's bits. Its stages hold
    no collective (two ranks leave none for expert parallelism): the next test has lanes in each stage."""
    results = run_ranks(_run_megatron_pipelined, tmp_path)
    assert [result["stage"] for result in results] == [0, 1]
    for result in results:
        for run in ("stock", "torch_ext"):
            assert result[run].pop("threads")["all_to_all"] == set()
    _check_pipelined(results)


@NEEDS_MEGATRON
def test_megatron_pipelined_schedule_runs_each_stages_all_to_all_in_a_lane(tmp_path):
    """forward_backward_pipelining_without_interleaving on 4 gloo ranks, pipeline 2 x expert parallel 2: each stage's
    two ranks exchange tokens through Megatron's _AllToAll, declared to a lane. Under enable() each stage's
    backward gives stock's bits, and ran _AllToAll's backward on another thread than the dense path's (stock: the
    same thread), so that a lane that does not run fails."""
    results = run_ranks(_run_megatron_pipelined_expert_parallel, tmp_path, world_size=4)
    # Megatron's grouping on 4 ranks: ranks 0 and 1 are the first stage, 2 and 3 the second, each pair an
    # expert-parallel group.
    assert [result["stage"] for result in results] == [0, 0, 1, 1]
    assert [result["expert_group"] for result in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for rank, result in enumerate(results):
        stock, ours = result["stock"].pop("threads"), result["torch_ext"].pop("threads")
        assert len(stock["all_to_all"]) == 1 and stock["all_to_all"] == stock["dense"], (rank, stock)
        assert ours["all_to_all"] and ours["dense"], (rank, ours)
        assert ours["all_to_all"].isdisjoint(ours["dense"]), (rank, ours)
    _check_pipelined(results)


# -- DeepSpeed ----------------------------------------------------------------------------------------------------


def _train_deepspeed(rank: int, rule: str | None) -> dict:
    """STEPS optimizer steps of DeepSpeed's loop, the engine switched on with ``rule`` (None: DeepSpeed's own)."""
    import deepspeed

    import torch_ext.integrations.deepspeed

    torch.manual_seed(rank)
    model = DeepSpeedModel(k=2, drop_tokens=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(ENGINE_CONFIG))
    if rule is not None:
        engine = torch_ext.integrations.deepspeed.overlap_microbatches(engine, forward_collectives=rule)
    result: dict = {"losses": [], "grads": [], "threads": []}
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        for i in range(MICROBATCHES):
            loss = engine(torch.randn(SEQUENCE, BATCH, DIM))
            result["losses"].append(loss.detach())
            _record_thread(loss, result["threads"])
            engine.backward(loss)
            if i + 1 == MICROBATCHES:
                # The boundary's backward all-reduced the gradients: what step() applies.
                result["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
            engine.step()
    assert engine.global_steps == STEPS
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def _run_deepspeed(rank: int) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    _deepspeed_comm()
    from deepspeed.moe.sharded_moe import _AllToAll

    torch_ext.run_in_lane(_AllToAll)
    return {run: _train_deepspeed(rank, rule) for run, rule in RUNS.items()}


@NEEDS_DEEPSPEED
def test_deepspeed_engine_switched_bits_equal_deepspeeds_own_loop(tmp_path):
    # DeepSpeed finds no accelerator here and picks its CPU one by itself; DS_ACCELERATOR=cpu says so.
    _check(run_ranks(_run_deepspeed, tmp_path, env={"DS_ACCELERATOR": "cpu"}))
