"""trainer_overlap's loops: each library's own loop over one step's microbatches, with its one switch as a variant
("compute" and "own" run the library's loop as it is; "switch" with torch_ext's switch on)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import DIM, N_MICROBATCHES, WORLD_SIZE


class _TorchMakingCudaTensorsOnCpu:
    """torch as Megatron's schedules module sees it in this benchmark: ``forward_backward_no_pipelining`` counts the
    step's tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``, made on the CPU here; every other name is
    torch's own. A stand-in for that one module rather than a TorchFunctionMode around the call (the tests' way),
    which would put a Python call in front of every op of the timed forwards."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return torch.zeros(*args, **kwargs)


class _MegatronLoop:
    """Megatron's loop over one step's microbatches: its ``forward_backward_no_pipelining``, then SGD."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
        from megatron.core.transformer.transformer_config import TransformerConfig

        import torch_ext.integrations.megatron

        self.model = model
        # What the schedule reads of a model: its config and type, and set_input_tensor (no pipeline: a no-op).
        model.config = TransformerConfig(num_layers=1, hidden_size=DIM, num_attention_heads=1)
        model.model_type = ModelType.encoder_or_decoder
        model.set_input_tensor = lambda tensor: None
        self._optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        schedules.torch = _TorchMakingCudaTensorsOnCpu()
        own = get_forward_backward_func()
        self.loops = {
            "compute": own,
            "own": own,
            "switch": torch_ext.integrations.megatron.overlap_microbatches(own),
        }

    def step(self, batches: Sequence[torch.Tensor], variant: str) -> None:
        communicate = variant != "compute"

        def forward_step(data_iterator, model):
            loss = model(next(data_iterator), communicate)
            return loss, lambda output: (output, {"loss": output.detach()})

        self._optimizer.zero_grad(set_to_none=True)
        self.loops[variant](
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=self.model,
            num_microbatches=len(batches),
            seq_length=1,
            micro_batch_size=1,
        )
        self._optimizer.step()

    def optimizer(self, variant: str) -> torch.optim.Optimizer:
        return self._optimizer


class _DeepSpeedLoop:
    """DeepSpeed's loop over one step's microbatches: ``engine(batch)``, ``engine.backward(loss)``,
    ``engine.step()`` each, the optimizer stepping at the accumulation boundary."""

    def __init__(self, model: torch.nn.Module) -> None:
        import deepspeed

        import torch_ext.integrations.deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": N_MICROBATCHES,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        switched = torch_ext.integrations.deepspeed.overlap_microbatches(engine)
        self.engines = {"compute": engine, "own": engine, "switch": switched}

    def step(self, batches: Sequence[torch.Tensor], variant: str) -> None:
        engine = self.engines[variant]
        communicate = variant != "compute"
        for tokens in batches:
            loss = engine(tokens, communicate)
            engine.backward(loss)
            engine.step()

    def optimizer(self, variant: str):
        return self.engines["own"].optimizer


class _TitanMetrics:
    """torchtitan's metrics processor as ``train_step`` calls it: logs nothing (the loss all-reduces are left out
    of every variant alike)."""

    def should_log(self, step: int) -> bool:
        return False


class _TitanCheckpointer:
    def maybe_wait_for_staging(self) -> None:
        pass


class _TorchtitanLoop:
    """torchtitan's ``Trainer.train_step`` over one step's microbatches (its gradient accumulation), made as
    tests/distributed/test_trainer_integrations_torchtitan.py makes it: ``Trainer.__new__`` and what ``train_step``
    reads (a full Trainer needs a tokenizer, a dataset and a registered model). Data parallel 2 for torchtitan's
    meshes (the valid-token count is all-reduced over them each step); the model is not wrapped, so no gradient is
    reduced. The model's loss is the loss: ``loss_fn`` passes it through."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig
        from torchtitan.distributed import parallel_dims as titan_parallel_dims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.trainer import Trainer

        from torch_ext.integrations.torchtitan import OverlappedTrainer

        titan_parallel_dims.device_type = "cpu"
        parallel_dims = titan_parallel_dims.ParallelDims(
            dp_replicate=WORLD_SIZE, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=WORLD_SIZE
        )
        parallel_dims.build_mesh()
        self.trainers = {}
        for variant, trainer_class in (("compute", Trainer), ("own", Trainer), ("switch", OverlappedTrainer)):
            config = trainer_class.Config()
            config.training.disable_cuda_graphs = True
            config.training.max_norm = 1e9
            config.optimizer.param_groups = [
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4, "weight_decay": 0.0}
                )
            ]
            trainer = trainer_class.__new__(trainer_class)
            trainer.config = config
            trainer.parallel_dims = parallel_dims
            trainer.device = torch.device("cpu")
            trainer.model_config = None  # not a Decoder: no attention masks
            trainer.model_parts = [model]
            trainer.loss_fn = lambda pred, labels, global_valid_tokens: (pred, None)
            trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
            trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=10**6)
            trainer.metrics_processor = _TitanMetrics()
            trainer.checkpointer = _TitanCheckpointer()
            trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
            trainer.fwd_bwd_fn = trainer._forward_backward_body
            trainer.gradient_accumulation_steps = N_MICROBATCHES
            trainer.num_pipeline_parallel_microbatches = 1
            trainer.step = 1
            trainer.ntokens_seen = 0
            self.trainers[variant] = trainer

    def step(self, batches: Sequence[torch.Tensor], variant: str) -> None:
        communicate = variant != "compute"
        labels = torch.zeros(1, dtype=torch.int64)
        # The model's second argument, passed by torchtitan as an extra keyword from the input dict.
        microbatches = [({"input": tokens, "communicate": communicate}, labels) for tokens in batches]
        self.trainers[variant].train_step(iter(microbatches))

    def optimizer(self, variant: str):
        return self.trainers[variant].optimizers


LOOPS = {"megatron": _MegatronLoop, "deepspeed": _DeepSpeedLoop, "torchtitan": _TorchtitanLoop}
