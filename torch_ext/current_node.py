"""Which path torch_ext takes for the current autograd node while a node runs."""

from __future__ import annotations

import torch

from torch_ext._api import deprecated
from torch_ext._loader import _C


def is_current_node_supported() -> bool:
    """Whether torch_ext makes each node the current autograd node while it runs, as stock does.

    Stock PyTorch sets it with ``NodeGuard``, which libtorch does not export; on x86-64 torch_ext finds the
    thread-local slot behind ``torch::autograd::get_current_node()`` and validates it before use. Where it
    cannot (another architecture, another build of torch) or ``TORCH_EXT_CURRENT_NODE=off`` is set, the
    portable path runs: ``torch._C._current_autograd_node()`` reports torch_ext's driver node during
    backward, so TORCH_LOGS=autograd names the driver, a hook that a saved-tensor unpack hook registers on
    the current node lands on the driver, and anomaly mode's double-backward parent traceback is missing.
    Everything else (gradients, hooks, priorities, deferred collective waits, split backward) is the same
    on both paths.

    The answer is known after the process's first torch_ext backward; before it, this runs one on a
    one-node graph to find out.
    """
    state = _C._current_node_state()
    if state == "unknown":
        from torch_ext.engine import backward

        probe = torch.zeros((), requires_grad=True)
        backward(probe * 1.0)
        state = _C._current_node_state()
    return state == "available"


current_node_supported = deprecated(
    "torch_ext.current_node_supported", "torch_ext.is_current_node_supported", is_current_node_supported
)
