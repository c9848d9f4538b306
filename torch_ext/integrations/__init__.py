"""Overlap across microbatches inside the training loops of other libraries, one switch each
(docs/guides/in-your-trainer.md):

- :func:`torch_ext.integrations.megatron.overlap_microbatches` wraps the function Megatron-core's
  ``get_forward_backward_func()`` returns;
- :func:`torch_ext.integrations.deepspeed.overlap_microbatches` wraps the engine ``deepspeed.initialize`` returns.

Each submodule imports its library only when called, and ``import torch_ext`` imports none of them.
"""
