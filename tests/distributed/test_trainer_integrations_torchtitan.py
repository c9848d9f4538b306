"""torchtitan's one switch (``torch_ext.integrations.torchtitan.OverlappedTrainer``) on 2 gloo ranks: 2 steps of
torchtitan 0.3.0's ``Trainer.train_step`` with 4 gradient-accumulation steps, on a model with dropout and
torchtitan's MoE (expert parallel 2, its ``AllToAllTokenDispatcher``, whose all_to_all-v runs in a lane). Every
loss torchtitan logs, every step's gradients (after its clipping) and the final parameters must equal the plain
``Trainer``'s bit for bit, on both ranks; and every microbatch's backward but each step's last must have run on
torch_ext's backward thread, so that a switch that does nothing fails. The switch runs with the default rule for the
next forward's collectives and with them beside the backward's on twin groups (gloo).

Both trainers are made with ``Trainer.__new__`` and given, by hand, what ``train_step`` reads: a full ``Trainer``
needs a tokenizer, a dataset and a registered model. What ``train_step`` runs is torchtitan's own: its
``forward_backward_step``, ``post_dataloading_process`` and ``_forward_backward_body`` (``self.fwd_bwd_fn``), its
loss (``CrossEntropyLoss`` over the step's valid tokens, all-reduced over the batch mesh), its
``clip_grad_norm_``, its optimizer and LR scheduler containers, built from their configs, and its loss all-reduce
for logging; the metrics processor and the checkpointer are stand-ins that record what is logged and stage nothing.
The model and torchtitan's meshes on CPU are test_microbatch_overlap_torchtitan's (``_moe``,
``_torchtitan_on_cpu``), with an embedding in front and a vocabulary head behind.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from _harness import assert_identical, run_ranks
from test_microbatch_overlap_torchtitan import DIM, _moe, _torchtitan_on_cpu
from torch import nn

import torch_ext

pytest.importorskip(
    "torchtitan.trainer",
    reason="torchtitan's Trainer needs torchdata, tensorboard and datasets (the [test] extra installs them)",
)

pytestmark = pytest.mark.distributed

STEPS = 2
ACCUMULATION = 4
VOCAB = 24
BATCH = 2
SEQUENCE = 6
TWINS = "beside_backward_collectives"
# Each run of torchtitan's train_step: None is the plain Trainer's, the others the switch with that rule.
RUNS = {"trainer": None, "switch": "after_backward_collectives", "switch_twins": TWINS}
BACKWARD_THREAD = "torch_ext-microbatch-backward"


class TitanLM(nn.Module):
    """Embedding, Linear, dropout, torchtitan's MoE with a residual, a vocabulary head."""

    def __init__(self, parallel_dims) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pre = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.25), nn.Tanh())
        self.moe = _moe(parallel_dims)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(self.embed(tokens))
        return self.head(self.moe(hidden) + hidden)


class _Metrics:
    """torchtitan's metrics processor, as ``train_step`` calls it: logs every step, recording the losses."""

    def __init__(self) -> None:
        self.logged: list[tuple[float, float, float]] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None) -> None:
        self.logged.append((global_avg_loss, global_max_loss, grad_norm))


class _Checkpointer:
    def maybe_wait_for_staging(self) -> None:
        pass


def _trainer(trainer_class, parallel_dims, rule: str | None):
    """A torchtitan trainer of ``trainer_class`` with what ``train_step`` reads, set as ``Trainer.__init__`` sets
    it."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed import utils as dist_utils

    config_kwargs = {} if rule is None else {"overlap_forward_collectives": rule}
    config = trainer_class.Config(**config_kwargs)
    config.training.disable_cuda_graphs = True
    config.training.max_norm = 0.1  # clips: the test's gradient norms are about 0.25
    config.optimizer.implementation = "foreach"
    config.optimizer.param_groups = [
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1})
    ]
    config.lr_scheduler.warmup_steps = 1

    trainer = trainer_class.__new__(trainer_class)
    trainer.config = config
    # torchtitan's meshes, with ep reported off so that clip_grad_norm_ takes its plain path: its EP path wants the
    # DTensor parameters of fully_shard, which this model does not apply (the MoE still runs expert parallel 2).
    trainer.parallel_dims = copy.copy(parallel_dims)
    trainer.parallel_dims.ep = 1
    trainer.device = torch.device("cpu")
    trainer.model_config = None  # not a Decoder: no attention masks
    torch.manual_seed(0)  # the same weights on both ranks (each keeps its experts' shard), in every run
    trainer.model_parts = [TitanLM(parallel_dims)]
    trainer.loss_fn = CrossEntropyLoss.Config().build()
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=STEPS)
    trainer.metrics_processor = _Metrics()
    trainer.checkpointer = _Checkpointer()
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    trainer.gradient_accumulation_steps = ACCUMULATION
    trainer.num_pipeline_parallel_microbatches = 1
    trainer.step = 0
    trainer.ntokens_seen = 0
    return trainer


def _batches(rank: int, step: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """A step's microbatches as torchtitan's dataloader yields them: ``({"input": tokens}, labels)``, some labels
    ignored, so that the valid-token count differs across microbatches and ranks."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    batches = []
    for _ in range(ACCUMULATION):
        tokens = torch.randint(VOCAB, (BATCH, SEQUENCE), generator=generator)
        labels = torch.randint(VOCAB, (BATCH, SEQUENCE), generator=generator)
        labels[torch.rand(BATCH, SEQUENCE, generator=generator) < 0.2] = -100
        batches.append(({"input": tokens}, labels))
    return batches


def _train(parallel_dims, rank: int, rule: str | None) -> dict:
    """STEPS calls of torchtitan's ``train_step``: the plain Trainer's (``rule`` None) or the switch's."""
    from torchtitan.trainer import Trainer

    from torch_ext.integrations.torchtitan import OverlappedTrainer

    trainer = _trainer(Trainer if rule is None else OverlappedTrainer, parallel_dims, rule)
    model = trainer.model_parts[0]
    result: dict = {"grads": [], "threads": []}

    def record_thread(module, args, logits: torch.Tensor) -> None:
        """Which thread ran each backward: a hook on the logits' gradient, the backward's first."""
        logits.register_hook(lambda grad: result["threads"].append(threading.current_thread().name))

    model.head.register_forward_hook(record_thread)
    # Each step's gradients, after torchtitan's clip_grad_norm_: read by the optimizer's pre-hook.
    trainer.optimizers.register_step_pre_hook(
        lambda *_: result["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
    )
    for step in range(STEPS):
        torch.manual_seed(7 + step)  # dropout's draws, in forward order
        trainer.step = step + 1
        trainer.train_step(iter(_batches(rank, step)))
    result["losses"] = trainer.metrics_processor.logged
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def _run(rank: int) -> dict:
    from spmd_types._collectives import _AllToAllUneven

    parallel_dims = _torchtitan_on_cpu()
    torch_ext.run_in_lane(_AllToAllUneven, group_of=lambda ctx: ctx.axis)
    return {run: _train(parallel_dims, rank, rule) for run, rule in RUNS.items()}


def test_torchtitan_train_step_switched_bits_equal_torchtitans_own(tmp_path):
    results = run_ranks(_run, tmp_path)
    switched_threads = [
        "MainThread" if i % ACCUMULATION == ACCUMULATION - 1 else BACKWARD_THREAD for i in range(STEPS * ACCUMULATION)
    ]
    for rank, result in enumerate(results):
        own = result["trainer"]
        assert own["threads"] == ["MainThread"] * (STEPS * ACCUMULATION), (rank, own["threads"])
        assert len(own["losses"]) == len(own["grads"]) == STEPS, rank
        for run in RUNS:
            if run == "trainer":
                continue
            switched = result[run]
            assert switched["threads"] == switched_threads, (rank, run, switched["threads"])
            assert switched["losses"] == own["losses"], (rank, run)
            for what in ("grads", "params"):
                assert_identical(switched[what], own[what], f"rank {rank} {run} {what}")


def _unstarted_trainer(pipeline_degree: int):
    """An OverlappedTrainer with only what train_step reads before its first microbatch."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    from torch_ext.integrations.torchtitan import OverlappedTrainer

    trainer = OverlappedTrainer.__new__(OverlappedTrainer)
    trainer.config = OverlappedTrainer.Config()
    trainer.parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=pipeline_degree, ep=1, world_size=pipeline_degree
    )
    trainer.gradient_accumulation_steps = ACCUMULATION
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def test_torchtitan_switch_refuses_what_it_cannot_overlap():
    from torch_ext.integrations.torchtitan import OverlappedTrainer

    with pytest.raises(ValueError, match="forward_collectives must be one of"):
        OverlappedTrainer.Config(overlap_forward_collectives="after_forward")
    with pytest.raises(ValueError, match="pipeline parallelism"):
        _unstarted_trainer(pipeline_degree=2).train_step(iter(()))
    captured = _unstarted_trainer(pipeline_degree=1)
    captured.fwd_bwd_fn = lambda *args: None  # what wrap_with_cuda_graph returns on CUDA: not the eager body
    with pytest.raises(ValueError, match="CUDA graph"):
        captured.train_step(iter(()))
