"""One switch in the libraries' own loops (``torch_ext.integrations``): exposed communication of a training step
with the switch on, over the library's own loop without it, at a dense backward about as long as the
communication (compute/comm ~1).

A step is gradient accumulation over N_MICROBATCHES microbatches and an optimizer step, on 2 ranks as 2 hosts on the
shaped link (``harness.hosts.run_on_two_hosts``), run by the library's own loop:

  megatron   Megatron-core's ``forward_backward_no_pipelining`` (what ``get_forward_backward_func()`` returns with
             no pipeline), then SGD; the switch: ``torch_ext.integrations.megatron.overlap_microbatches``
  deepspeed  ``deepspeed.initialize``'s engine (ZeRO stage 0, gradient_accumulation_steps N_MICROBATCHES), the
             loop ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` per microbatch; the switch:
             ``torch_ext.integrations.deepspeed.overlap_microbatches``
  torchtitan ``Trainer.train_step`` with N_MICROBATCHES gradient-accumulation steps (data parallel 2 for its meshes;
             the model is not wrapped, so no gradient is reduced), its AdamW; the switch:
             ``torch_ext.integrations.torchtitan.OverlappedTrainer``. The trainer is made as its test makes it,
             ``Trainer.__new__`` and what ``train_step`` reads (a full one needs a tokenizer, a dataset and a
             registered model); its model takes the other library's ``_AllToAll`` (torchtitan's own MoE dispatch
             needs stand-ins for its meshes on CPU)

The model is microbatch_overlap's pre-path MoE layer (``benchmarks/moe_layer.py``: a dense pre-path, the dispatch all_to_all, an expert, the
combine all_to_all, a dense path after it), its all_to_all the library's synchronous ``_AllToAll``, declared with
``torch_ext.run_in_lane`` for the switch. The dense layers are sized so that their backward takes about T_comm,
how long stock waits for one microbatch's all_to_alls with no dense layer (``harness.calibration.calibrate_t_comm``).

Variants, alternating within each repetition (every metric the slower rank's):

  compute   the library's own loop with the all_to_alls replaced by the identity: the communication-free reference
  own       the library's own loop on PyTorch's engine: every all_to_all exposed
  switch    the same loop with the library's one switch on (each microbatch's backward beside the next forward,
            ``forward_collectives`` "after_backward_collectives", the default), under ``torch_ext.enable()``

Exposed communication = a step - the same repetition's ``compute`` step. The headline per library: the switch's
exposed communication over its own loop's (lower is better; 1 is no gain). Before timing, one step of each loop
checks that the switch's gradients equal the own loop's bit for bit.

A full run's benchmark: ``--quick`` (bench --quick, the README's main job) skips it, as its three libraries' steps
would take about 90 s more of a run held to 3 minutes.

    python -m benchmarks.trainer_overlap [--reps N] [--network ...] [--out CSV]
"""

NAME = "trainer_overlap"
WORLD_SIZE = 2
# microbatch_overlap's sizes, so that the two read alike: 8 microbatches a step, each 1,024 tokens of width 256 on a
# rank (512 to each expert: 0.5 MiB to the other rank per all_to_all), the dense layers capped at 64.
N_MICROBATCHES = 8
DIM = 256
ROWS = 1024
MAX_DENSE_LAYERS = 64
LIBRARIES = ("megatron", "deepspeed", "torchtitan")
LIBRARY_NAMES = {"megatron": "Megatron-core", "deepspeed": "DeepSpeed", "torchtitan": "torchtitan"}
VARIANTS = ("compute", "own", "switch")
