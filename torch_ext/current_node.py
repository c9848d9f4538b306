"""Which path torch_ext takes for the current autograd node while a node runs."""

from __future__ import annotations

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

    The answer is settled once per process, by the first question (this one, or the first torch_ext backward),
    without running anything: the engine checks that ``get_current_node()`` reports a probe node held in the
    calling thread's slot for an instant, then puts back what the slot held. Asking changes nothing, under
    any grad mode, inference mode, dispatch mode or :func:`torch_ext.trace` block.
    """
    return _C._current_node_state() == "available"
