"""How each of microbatch_overlap's variants runs a step: its engine and declaration, its microbatches
(sequential, or overlapped under its rule), and the step timed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import torch_ext

from ..harness.timing import gc_paused
from ..moe_libraries import in_lane_on_torch_ext
from . import COMPUTE_VARIANTS, OVERLAPPED_VARIANTS, PHASED_VARIANTS


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The engine and declaration of ``variant``; the _AllToAll is back to undeclared afterwards. compute_overlapped
    runs on torch_ext's engine, as the overlap does, with no _AllToAll in its graph."""
    if variant in ("stock", "compute"):
        yield
        return
    with in_lane_on_torch_ext(function):
        yield


def accumulate(model: nn.Module, batches: Sequence[torch.Tensor], variant: str) -> tuple[float, float]:
    """The microbatches' forwards and backwards, gradients accumulated, under the variant's engine (entered by the
    caller); (forward seconds, backward seconds) summed over the microbatches, both 0 for the overlapped ones."""
    communicate = variant not in COMPUTE_VARIANTS
    if variant in OVERLAPPED_VARIANTS:
        with torch_ext.overlap_microbatches(OVERLAPPED_VARIANTS[variant]) as overlap:
            for tokens in batches:
                overlap.backward(model(tokens, communicate))
        return 0.0, 0.0
    forward_s = backward_s = 0.0
    for tokens in batches:
        start = time.perf_counter()
        loss = model(tokens, communicate)
        middle = time.perf_counter()
        loss.backward()
        forward_s += middle - start
        backward_s += time.perf_counter() - middle
    return forward_s, backward_s


def step(model: nn.Module, optimizer, batches, variant: str, function: type) -> dict[str, float]:
    """Seconds of a step (``step_s``: zero_grad, the microbatches, the SGD step), and for the phased variants of
    its forwards (``forward_s``) and backwards (``backward_s``), the ranks started together, Python's GC off."""
    dist.barrier()
    with gc_paused():
        start = time.perf_counter()
        cpu_start = time.process_time()
        optimizer.zero_grad(set_to_none=True)
        with variant_engine(variant, function):
            forward_s, backward_s = accumulate(model, batches, variant)
        optimizer.step()
        step_s = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
    if variant not in PHASED_VARIANTS:
        return {"step_s": step_s, "cpu_s": cpu_s}
    return {"step_s": step_s, "cpu_s": cpu_s, "forward_s": forward_s, "backward_s": backward_s}
