"""Peak tensor memory of one backward call: stock PyTorch's engine against torch_ext's.

torch_ext's engine releases a gradient as soon as its last reader has run (an input buffer when its
node has run, a node's outputs once delivered), so no graph should need more memory under it than
under stock's engine. Every graph (benchmarks/backward_memory.py's) is built twice from the same seed,
and one engine call runs on each copy: ``torch.autograd.backward``/``grad`` (stock) and
``torch_ext.backward``/``grad``. Asserted per graph: torch_ext's peak is at most stock's, and the
gradients are identical (torch_ext.testing.assert_identical); the same for the third call of a structure,
which replays the plan torch_ext cached from the first two. Two graphs given a priority exceed stock's peak by one gradient
(EXCEEDS_STOCK, marked xfail with the figures).

Method (torch_ext/memory.py): the CPU allocator's running total of live bytes, reported to the memory
profiler at every allocation and free from every thread; the graph is built under the tracker so the
forward's saved tensors that backward frees are counted. A call's peak is the most bytes above the
level at its start. Both engines run every CPU node on the calling thread (checked for these graphs
when this was written: every allocation event came from it, and the figures are the same with 1 and 2
intra-op threads). The profiler turns on RecordFunction callbacks for both engines alike. The figures
are exact byte counts and repeat run to run (checked below).
"""

from __future__ import annotations

import pytest
import torch

import torch_ext
from torch_ext import _C, bench
from torch_ext.memory import PeakMemory
from torch_ext.testing import assert_identical

# The graphs, the two engines and the measurement are the benchmark's (benchmarks/backward_memory.py).
backward_memory = bench.benchmark_module("backward_memory")
FIRST_REPLAY, PRIORITY = backward_memory.FIRST_REPLAY, backward_memory.PRIORITY
STOCK, TORCH_EXT = backward_memory.STOCK, backward_memory.TORCH_EXT
measure = backward_memory.measure
GRAPHS = {name: case.build for name, case in backward_memory.GRAPHS.items()}

# Graphs whose torch_ext peak exceeds stock's, with the measured figures: both come from a priority,
# through the order it asks for, or through summing in stock's order despite it.
EXCEEDS_STOCK = {
    "reused_intermediate_priority_exp": (
        "priorities reorder as asked, and the reordered schedule holds more: ExpBackward0 runs before "
        "TanhBackward0 and CosBackward0, and its 4 MiB output waits for its reader MulBackward0 meanwhile. "
        "Measured: stock 12,582,916 B, torch_ext 16,777,220 B (+4,194,304 B, one gradient)."
    ),
    "fan_in_priority_branch_0": (
        "bit-stable accumulation holds branch 0's gradient, which stock adds last, until the 63 others "
        "have been added (csrc/engine/plan/schedule_replay.h). Measured: stock 32,772 B, torch_ext 49,156 B "
        "(+16,384 B, one gradient; _held_gradient_stats peak_held_bytes 16,384)."
    ),
}
CASES = [
    pytest.param(
        build,
        id=name,
        marks=[pytest.mark.xfail(strict=False, reason=EXCEEDS_STOCK[name])] if name in EXCEEDS_STOCK else [],
    )
    for name, build in GRAPHS.items()
]
PRIORITY_GRAPHS = [name for name in GRAPHS if "priority" in name]


@pytest.fixture(scope="module", autouse=True)
def engines_warmed_up():
    # torch_ext's first call in a process allocates the 4-byte gradient its driver node is declared with
    # (driver_dummy_grad, csrc/engine/host/host_task.cpp), kept for the life of the process: a one-time cost that
    # would otherwise show in whichever call comes first.
    for engine in (STOCK, TORCH_EXT):
        x = torch.ones(2, requires_grad=True)
        engine.backward((x * 2).sum())


@pytest.fixture(autouse=True)
def fresh_plan_cache():
    # Every test starts with no plan kept, so that a torch_ext call discovers its plan unless the test
    # has made the same structure before.
    previous = _C._set_plan_cache(True)
    _C._clear_plan_cache()
    _C._plan_cache_stats(True)
    yield
    _C._set_plan_cache(previous)


@pytest.mark.parametrize("build", CASES)
def test_peak_is_at_most_stocks(build):
    stock = measure(build, STOCK)
    ours = measure(build, TORCH_EXT)
    assert_identical(ours.gradients, stock.gradients, "gradients")
    assert ours.peak_bytes <= stock.peak_bytes, (ours.peak_bytes, stock.peak_bytes)


@pytest.mark.parametrize("build", CASES)
def test_replayed_plan_peak_is_at_most_stocks(build):
    stock = measure(build, STOCK)
    for call in range(1, FIRST_REPLAY + 1):
        hits = _C._plan_cache_stats(False)["hits"]
        ours = measure(build, TORCH_EXT)
        replayed = _C._plan_cache_stats(False)["hits"] > hits
        assert replayed == (call == FIRST_REPLAY), call
        assert_identical(ours.gradients, stock.gradients, f"call {call}'s gradients")
        assert ours.peak_bytes <= stock.peak_bytes, (call, ours.peak_bytes, stock.peak_bytes)


@pytest.mark.parametrize("build", GRAPHS.values(), ids=GRAPHS.keys())
def test_measurement_repeats_exactly(build):
    # With the plan cache off, each torch_ext call takes the same path (discovery) as the one before.
    _C._set_plan_cache(False)
    for engine in (STOCK, TORCH_EXT):
        peaks = [measure(build, engine).peak_bytes for _ in range(3)]
        assert peaks[0] > 0 and peaks.count(peaks[0]) == 3, (engine.name, peaks)


@pytest.mark.parametrize("name", PRIORITY_GRAPHS)
def test_priorities_reorder(name):
    # A priority graph measures a reordered schedule only if its priority changes torch_ext's order.
    graph = GRAPHS[name]()
    priorities = {graph.priority_target: PRIORITY}
    plain = torch_ext.debug.execution_order(graph.loss)
    assert torch_ext.debug.execution_order(graph.loss, priorities=priorities) != plain


def test_peak_memory_counts_a_known_allocation():
    # 1000 float32 elements held at once: 4000 bytes above the level at the region's start, while an
    # allocation freed before the region does not count.
    with PeakMemory() as memory:
        before = torch.empty(5000)
        del before
        with memory.region():
            held = torch.empty(1000)
            del held
    assert memory.peak_bytes == 4000


def test_peak_memory_sees_frees_only_of_tensors_made_under_it():
    # Freeing 4000 bytes and then allocating 4000 stays at the starting level, if the freed block was
    # allocated under the tracker; one allocated before it is invisible to the reporter.
    made_before = torch.empty(1000)
    with PeakMemory() as memory:
        made_under = torch.empty(1000)
        with memory.region():
            del made_under
            replacement = torch.empty(1000)
    assert memory.peak_bytes == 0
    # A new name: rebinding `replacement` would also free the first block's tensor in the region, right
    # after this allocation, and the profiler's timestamps can put that free first (the region then read 0).
    with PeakMemory() as memory, memory.region():
        del made_before
        second_replacement = torch.empty(1000)
    assert memory.peak_bytes == 4000
    del replacement, second_replacement


def test_peak_memory_ignores_frees_of_blocks_an_earlier_profiler_saw_allocated():
    # c10's reporter keeps the size of a block allocated under any earlier memory profiler (or, the same, a
    # stale entry at a reused address) and reports its free: the block was made before this tracker, so the
    # free must not count. Unfiltered, such a free took the test above's region from 4000 bytes to 0 in
    # full-suite runs, after other tests had profiled memory.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        made_before = torch.empty(1000)
    with PeakMemory() as memory, memory.region():
        del made_before
        replacement = torch.empty(1000)
    assert memory.peak_bytes == 4000
    del replacement


def test_peak_memory_rejects_misuse():
    memory = PeakMemory()
    with pytest.raises(RuntimeError, match="must be entered inside"), memory.region():
        pass
    with pytest.raises(RuntimeError, match="no region"), PeakMemory():
        pass
    with pytest.raises(RuntimeError, match="one region"), PeakMemory() as memory:
        with memory.region():
            pass
        with memory.region():
            pass
