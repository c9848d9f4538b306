"""The activations each of microbatch_overlap's variants holds at once (one untimed step under a saved-tensors
hook: ``saved_peak``), and the bits every engine variant must share with stock's before anything is timed."""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch import nn

from . import COMPUTE_VARIANTS, ENGINE_VARIANTS, OVERLAPPED_VARIANTS
from .variants import accumulate, variant_engine


def check_bits_and_memory(model: nn.Module, batches, function: type, rank: int, case: str) -> dict[str, dict]:
    """One step of each engine variant (no optimizer step), its activations counted (``saved_peak``): its
    accumulated gradients must be torch.equal to stock's. Returns each variant's ``saved_peak``."""
    grads, memory = {}, {}
    for variant in ENGINE_VARIANTS:
        memory[variant] = saved_peak(model, batches, variant, function)
        grads[variant] = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for variant in ENGINE_VARIANTS[1:]:
        if not all(torch.equal(a, b) for a, b in zip(grads["stock"], grads[variant], strict=True)):
            raise AssertionError(f"rank {rank}, {case}: {variant}'s gradients differ from stock's")
    return memory


class _Saved:
    """What the pack hook returns for a counted tensor; its finalizer uncounts it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """Bytes of the distinct storages autograd holds saved at once, and their peak: a saved-tensors pack hook counts
    a storage at its first saved reference and uncounts it when its last one is freed (the backward releases a
    node's saved tensors as it runs it). Storages in ``excluded`` (parameters, inputs) are not counted. The hooks
    run on the forward thread and the release on whichever runs the backward: a lock."""

    def __init__(self, excluded: set[int]) -> None:
        self._excluded = excluded
        self._lock = threading.Lock()
        self._live: dict[int, list[int]] = {}  # storage address -> [saved references, bytes]
        self.total = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or address in self._excluded:
            return tensor
        with self._lock:
            entry = self._live.get(address)
            if entry is None:
                self._live[address] = [1, size]
                self.total += size
                self.peak = max(self.peak, self.total)
            else:
                entry[0] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, address)
        return saved

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, address: int) -> None:
        with self._lock:
            entry = self._live[address]
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[address]
                self.total -= entry[1]


def saved_peak(model: nn.Module, batches, variant: str, function: type) -> dict[str, float]:
    """One untimed step of ``variant`` (no optimizer step, the gradients left in ``.grad``) under a ``SavedBytes``
    pack hook: the peak bytes of activations held at once, and (the phased variants) the most one microbatch's
    forward saved."""
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *batches)}
    counter = SavedBytes(excluded)
    model.zero_grad(set_to_none=True)
    one_microbatch = 0
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), variant_engine(variant, function):
        if variant in OVERLAPPED_VARIANTS:
            accumulate(model, batches, variant)
        else:
            for tokens in batches:
                loss = model(tokens, variant not in COMPUTE_VARIANTS)
                one_microbatch = max(one_microbatch, counter.total)
                loss.backward()
                del loss
    gc.collect()
    if counter.total:
        raise AssertionError(f"{variant}: {counter.total} bytes of saved activations left after the step")
    return {"saved_peak_bytes": counter.peak, "one_microbatch_bytes": one_microbatch}
