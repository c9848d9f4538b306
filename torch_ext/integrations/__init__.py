"""Overlap across microbatches inside the training loops of other libraries, one switch each
(docs/guides/in-your-trainer.md):

- :func:`torch_ext.integrations.megatron.overlap_microbatches` wraps the function Megatron-core's
  ``get_forward_backward_func()`` returns;
- :func:`torch_ext.integrations.deepspeed.overlap_microbatches` wraps the engine ``deepspeed.initialize`` returns;
- :class:`torch_ext.integrations.torchtitan.OverlappedTrainer` is a torchtitan ``Trainer`` subclass, built by name
  from the config a ``config_registry`` function returns.

``import torch_ext`` imports none of these libraries. The Megatron and DeepSpeed submodules import theirs only when
called; the torchtitan submodule imports torchtitan's ``Trainer``, which its class subclasses.
"""
