"""Which path torch_ext takes for the current autograd node while a node runs."""

from __future__ import annotations

import threading

import torch

from torch_ext._loader import _C
from torch_ext.engine import backward

# Held while the first backward settles the answer, so that concurrent first questions run one probe.
_probe_lock = threading.Lock()


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

    The engine settles the answer once per process, at its first backward, and this reads it. Asked before
    any torch_ext backward, it runs that first backward itself, once: a one-node graph on a thread of its own,
    which the caller's grad mode, inference mode, dispatch modes and saved-tensor hooks do not reach (inside a
    :func:`torch_ext.trace` block it is recorded, as any backward is).
    """
    if _C._current_node_state() == "unknown":
        with _probe_lock:
            if _C._current_node_state() == "unknown":
                _settle_current_node_path()
    return _C._current_node_state() == "available"


def _settle_current_node_path() -> None:
    """Runs one torch_ext backward, which settles the current-node path.

    Nothing else can: the engine trusts the slot it found only once the slot holds the node that stock's
    NodeGuard made current, which happens inside a backward (csrc/engine/run/current_node.cpp).
    """
    failure: list[Exception] = []

    def probe() -> None:
        try:
            leaf = torch.zeros((), requires_grad=True)
            backward(leaf * 1.0)
        except Exception as e:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=probe, name="torch_ext current-node probe")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
