"""The threads torch_ext starts compute with their caller's numerics (csrc/engine/caller_thread_state.h).

The microbatch overlap's backward thread and the collective lanes run ATen ops that stock runs on the
caller's thread. What at::ThreadLocalState does not carry must follow too: MKL's and OpenMP's per-thread
thread counts (``torch.set_num_threads``) and the flush-denormal bits of MXCSR (``torch.set_flush_denormal``).
A gemm that splits its reduction over another number of threads rounds differently, on some CPUs only (an
Intel Xeon, not an AMD EPYC), so these tests read the settings themselves from a hook on each kind of thread,
through the same libraries ATen calls, and compare them with the caller's: that fails on any CPU.

Each step changes the settings after the threads started (the caller calls ``torch.set_num_threads`` between
steps), as training scripts do, and the next backward must use the new values, as stock's does.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import os
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_ext

_TORCH_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")


def _library_with(symbol: str, pattern: str) -> ctypes.CDLL | None:
    for path in sorted(glob.glob(os.path.join(_TORCH_LIB, pattern))):
        library = ctypes.CDLL(path)
        if hasattr(library, symbol):
            return library
    return None


# MKL is linked into libtorch_cpu.so on x86 builds; OpenMP is the runtime bundled beside it (libgomp on Linux).
_MKL = _library_with("mkl_get_max_threads", "libtorch_cpu.so")
_OPENMP = _library_with("omp_get_max_threads", "lib*omp*.so*")
_FLUSH_DENORMAL_SUPPORTED = torch.set_flush_denormal(False)


def numerics() -> dict[str, object]:
    """This thread's numeric settings, read without torch's lazy per-thread initialization (which
    ``torch.get_num_threads`` runs on a thread's first call, and which would hide a thread never set up)."""
    found: dict[str, object] = {}
    # The counts first: an ATen op on a thread that never ran one sets them from the last torch.set_num_threads.
    if _MKL is not None:
        found["mkl_threads"] = _MKL.mkl_get_max_threads()
    if _OPENMP is not None:
        found["openmp_threads"] = _OPENMP.omp_get_max_threads()
    # With denormals-are-zero set, a denormal input reads as zero.
    found["flush_denormal"] = (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() == 0.0
    return found


def _thread_counts() -> tuple[int, int]:
    """Two intra-op thread counts, the second chosen after the threads start; neither is a new thread's default
    (the core count), so a thread left at its default is seen."""
    default = os.cpu_count() or 1
    return 1, default + 1


@pytest.fixture
def restore_numerics() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


class ProbedExchange(torch.autograd.Function):
    """The identity on a one-rank group, through a real all_to_all in backward; backward records the numerics of
    the thread it runs on (a lane, once declared with ``torch_ext.run_in_lane``)."""

    seen: ClassVar[list[tuple[int, dict[str, object]]]] = []

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ProbedExchange.seen.append((threading.get_ident(), numerics()))
        exchanged = torch.empty_like(grad)
        ctx.group.alltoall_base(exchanged, grad.contiguous(), [], []).wait()
        return exchanged, None


@pytest.fixture
def lane() -> Iterator[dist.ProcessGroup]:
    ProbedExchange.seen.clear()
    torch_ext.run_in_lane(ProbedExchange)
    yield dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    torch_ext.unregister_collective_backward(ProbedExchange)


def _steps() -> list[tuple[int, bool]]:
    """(intra-op threads, flush denormals) of each step: both change between steps."""
    first, second = _thread_counts()
    steps = [(first, False), (second, False)]
    if _FLUSH_DENORMAL_SUPPORTED:
        steps.append((first, True))
    return steps


def _set(threads: int, flush_denormal: bool) -> dict[str, object]:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(flush_denormal)
    return numerics()


def test_the_probe_reads_what_torch_sets(restore_numerics):
    # The probe sees the settings change on this thread, and a new plain thread keeps its own: what the other
    # tests compare is real.
    first, second = _thread_counts()
    at_first, at_second = _set(first, False), _set(second, _FLUSH_DENORMAL_SUPPORTED)
    for key in ("mkl_threads", "openmp_threads"):
        if key in at_first:
            assert (at_first[key], at_second[key]) == (first, second)
    assert at_second["flush_denormal"] == _FLUSH_DENORMAL_SUPPORTED
    on_new_thread: list[dict[str, object]] = []
    thread = threading.Thread(target=lambda: on_new_thread.append(numerics()))
    thread.start()
    thread.join()
    assert on_new_thread[0] != at_second


def test_the_microbatch_backward_thread_has_the_callers_numerics(restore_numerics):
    model = nn.Linear(4, 4)
    seen: ClassVar[list[tuple[int, dict[str, object]]]] = []
    model.weight.register_hook(lambda grad: seen.append((threading.get_ident(), numerics())))
    expected = []
    with torch_ext.overlap_microbatches() as overlap:
        for threads, flush_denormal in _steps():
            expected.append(_set(threads, flush_denormal))
            overlap.backward(model(torch.randn(2, 4)).sum())
            overlap.wait()
    assert {thread for thread, _ in seen} != {threading.get_ident()}
    assert [found for _, found in seen] == expected


def test_a_lane_has_the_callers_numerics(restore_numerics, lane):
    expected = []
    for threads, flush_denormal in _steps():
        expected.append(_set(threads, flush_denormal))
        x = torch.randn(3, requires_grad=True)
        torch_ext.backward((ProbedExchange.apply(x, lane) * 2).sum())
    assert threading.get_ident() not in {thread for thread, _ in ProbedExchange.seen}
    assert [found for _, found in ProbedExchange.seen] == expected


def test_a_lane_of_an_overlapped_backward_has_the_callers_numerics(restore_numerics, lane):
    # The lane starts from the backward thread, which started from the caller's: both hand-overs carry them.
    expected = []
    with torch_ext.overlap_microbatches() as overlap:
        for threads, flush_denormal in _steps():
            expected.append(_set(threads, flush_denormal))
            x = torch.randn(3, requires_grad=True)
            overlap.backward((ProbedExchange.apply(x, lane) * 2).sum())
            overlap.wait()
    assert [found for _, found in ProbedExchange.seen] == expected


def test_the_backward_thread_gives_stocks_bits_where_the_thread_count_changes_them(restore_numerics):
    # grad_input of a Linear(256, 1024) on one row is a (1, 1024) @ (1024, 256) gemm: on an Intel Xeon with MKL,
    # two threads split its reduction and round differently from one. On CPUs where they do not, this still
    # checks the bits, but only the probes above see the mechanism.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stock, overlapped = nn.Linear(256, 1024), nn.Linear(256, 1024)
    overlapped.load_state_dict(stock.state_dict())
    batches = [torch.randn(1, 256, requires_grad=True) for _ in range(3)]
    stock_inputs = [x.detach().clone().requires_grad_() for x in batches]
    for x in stock_inputs:
        stock(x).square().sum().backward()
    with torch_ext.overlap_microbatches() as overlap:
        for x in batches:
            overlap.backward(overlapped(x).square().sum())
    for ours, theirs in zip(batches, stock_inputs, strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    assert torch.equal(overlapped.weight.grad, stock.weight.grad)
