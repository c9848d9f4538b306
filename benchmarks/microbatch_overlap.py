"""Overlap across microbatches (``torch_ext.overlap_microbatches``) on synchronous MoE all_to_alls: step time,
exposed communication and the activations held, against the stock loop, the lane alone, and the least exposure an
overlapped order of the same work could reach on this machine.

A training step here is gradient accumulation over N_MICROBATCHES microbatches and one SGD step, on 2 ranks as 2
hosts on the shaped link (``_hosts.run_on_two_hosts``), for two shapes of model (``SHAPES``):

  pre-path        one expert-parallel layer (CSV cases ``<library> x<ratio>``). A microbatch's forward: a dense
                  pre-path (a projection and Linear + ReLU layers over its tokens), the dispatch all_to_all, the
                  expert, the combine all_to_all, and a dense path after it (Linear + ReLU layers from the
                  pre-path's output, beside the expert's branch, as a shared expert is)
  dispatch-first  two MoE blocks and a head (cases ``<library> dispatch-first x<ratio>``), each block's forward
                  issuing its dispatch all_to_all before any dense compute, as many MoE models' do: a router
                  projection, the dispatch, the expert, the combine (gated by the projection), then a shared expert
                  of Linear + ReLU layers on the block's input, beside the routed path. A block's output is its
                  input plus both, a residual, so the second block reads values of the first's magnitude

The all_to_all is the library's synchronous ``_AllToAll``: Megatron-core's, or DeepSpeed's where only it is
installed. Its backward runs the gradient's all_to_all inside its node, so a MoE layer carries four all_to_alls a
microbatch, two in forward and two in backward: four a microbatch for pre-path, eight for dispatch-first.
Variants:

  compute             the stock loop with the all_to_alls replaced by the identity: the communication-free
                      reference
  compute_overlapped  the same communication-free microbatches under ``torch_ext.overlap_microbatches()``: the
                      compute on two threads, no collective at all; a part of the limit (below)
  stock               the stock loop, ``loss.backward()`` per microbatch on PyTorch's engine: every all_to_all
                      exposed
  lane                torch_ext's engine with ``torch_ext.run_in_lane(_AllToAll)``, the same sequential loop: the
                      backward's all_to_alls hide behind the dense path after (its backward runs beside them); the
                      forward's cannot
  overlap             the lane and ``torch_ext.overlap_microbatches()``: microbatch i's backward runs on the
                      backward thread while the caller runs microbatch i+1's forward, so each phase's all_to_alls
                      hide behind the other phase's compute (the forward's all_to_alls start once the backward's
                      have started)
  turns               the same with ``forward_collectives="in_turns_with_backward_collectives"``: the two phases'
                      all_to_alls take turns, the backward's first (pre-path: backward's combine gradient,
                      forward's dispatch, backward's dispatch gradient, forward's combine), so the forward's first
                      no longer waits for the backward's last, and the backward's k+1-th waits for the forward's
                      k-th
  twins               the same with ``forward_collectives="beside_backward_collectives"``: the backward's
                      all_to_alls go to a twin of their group (a gloo group of the same ranks), so neither phase's
                      wait for the other's

T_comm is how long stock waits for one microbatch's all_to_alls (forward and backward) with no dense layer, each
shape its own: that shape with no dense layer (``_common.calibrate_t_comm`` over one microbatch: its blocked time,
the median of 15 steps). The dense layers' backward per microbatch is swept over multiples of T_comm (--ratios),
split between the pre-path and the path after (dispatch-first: between the two blocks' shared experts); their
forward adds about half as much. (No efficiency against T_comm: a step's exposed communication measured as below
read 1.2-1.6 x N_MICROBATCHES x T_comm for stock, which is blocked time alone; the fraction of stock's exposed at
the same point is the comparison.)

Per point and repetition (the variants alternating, every metric the slower rank's): step time (zero_grad, the
microbatches, the SGD step); exposed communication = the step - the same repetition's ``compute`` step. For
stock and the lane, the exposure of each phase: the sum of the microbatches' forward (backward) times -
compute's. The overlap's phases run at once, so it has the total only. ``compute_overlapped``'s step - the same
repetition's ``compute`` step is what two threads cost the compute. Reported as medians, and the exposed
communication as a fraction of stock's at the same point.

The limit, per point (``exposure_limit``, which derives it): the least exposed communication an order that runs
two microbatches at once, the only kind that can hide a synchronous forward all_to_all, could reach on this
machine. The larger of two bounds, from parts measured at the point: the compute on two threads plus the edges
(microbatch 0's forward all_to_alls, with no backward beside them, and the last microbatch's backward ones, with
no forward after them: about 1 / N_MICROBATCHES of stock's exposure) plus the CPU time the communication itself
takes (stock's above its compute step, which any order of the same collectives spends on a rank's one core), and
the link's time for all the step's bytes (N_MICROBATCHES x T_comm), which at low compute outlasts the compute
beside it. Each rule (lane, overlap, turns, twins) is then read as the fraction of the gap between stock's exposure
and the limit it closes (``gap_closed``): 0 at stock's, 1 at the limit. On this 2-core machine two compute threads
per rank cost more than one, which the limit counts.

Traces (--timeline PNG): after timing the point nearest x1, each rank runs TRACED_STEPS more steps of each
overlapped rule it timed, under ``torch_ext.trace()`` with the forward thread's waits recorded (its all_to_alls,
the hand-overs, the close), and the table splits each rank's traced exposure (``_step_split``): the time some
compute thread (the forward's or the backward's) was busy above the rank's compute step, and the time both waited,
at the leading edge, the trailing edge and in between. Only the last is time an order of the same work could
still fill. Beside it, the compute threads' time on a core and ready with none free (the kernel's counts,
``/proc/self/task/*/schedstat``), and the other threads' time on a core (gloo's, the lanes': the process's CPU
time less the compute threads').
``trace +``, the traced step less the rank's untraced median, shows whether tracing changed the step. Rank 0
draws its first traced step of each rule.

CPU time: each variant's step also records the CPU time its process used (``time.process_time``, every thread),
and the table's ``cpu +ms`` is that above the same repetition's ``compute`` step's. With two ranks on two cores, a
rank has about one core: CPU time a variant adds cannot hide behind anything, only waiting can; the summary
prints that part of the exposure.

A quick run (--quick) times pre-path alone, without turns, twins and compute_overlapped (``QUICK_SHAPES``,
``QUICK_LEFT_OUT``), so it prints no limit; a full run times every shape and variant. --shapes picks the shapes;
--ratios 1 --dense-layers N times one point at a fixed depth, so that runs compare the same work: T_comm's
calibration on the shaped link reads one of two rates from run to run (dispatch-first: 62 or 129 ms a
microbatch in two runs minutes apart, the depth at x1 16 or 31 layers), though stock's exposure at either depth
read the same (741 and 750 ms a step).

The figures (each rule's runs, what was traced, the CPU costs) are in docs/benchmarks.md, "Overlap across
microbatches", and docs/guides/moe.md, with the runs that made them.

Peak memory: there are no allocator statistics on CPU, so one untimed step per variant counts the activations
held at once: a saved-tensors pack hook tallies the bytes of every distinct storage autograd saved (parameters and
the microbatches' inputs left out), each until the last saved reference to it is freed; the peak of that sum
over the step, against stock's, whose peak is one microbatch's graph (the overlap holds one more at most: the
next forward's, beside the backward in flight). Before timing, one step of each engine variant must give
torch.equal gradients to stock's.

    python benchmarks/microbatch_overlap.py [--quick] [--reps N] [--ratios 0.5,1,2] [--shapes pre-path,dispatch-first]
        [--dense-layers N] [--network ...] [--timeline PNG] [--out CSV]
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _common import (
    CALIBRATION_S,
    HEADLINE_RATIO,
    Summary,
    SummaryRow,
    SweepConfig,
    calibrate_t_comm,
    csv_cases,
    csv_row,
    dense_layer_backward_s,
    gc_paused,
    git_sha,
    headline_point,
    load_note,
    measured_ratio,
    measured_ratio_row,
    merge_ranks,
    parse_sweep_args,
    print_load,
    progress,
    run_sweep,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_config,
    sweep_depth,
    sweep_parser,
    timed_blocking,
    timed_repetitions,
    timed_variants,
    write_csv,
)
from _hosts import agreed_max
from _step_split import compute_thread_times, minus, split_step, threads_schedstat
from moe_sync import LIBRARY_NAMES, _identity, installed_libraries, library_all_to_all
from torch import nn

import torch_ext

NAME = "microbatch_overlap"
WORLD_SIZE = 2
# Microbatches a step: 8, as gradient accumulation commonly uses; the edges that no order hides are about 1 / this
# of stock's exposure (exposure_limit). Quick runs' figures, with 4 and with 8, are in docs/benchmarks.md.
N_MICROBATCHES = 8
# Tokens each rank sends each expert per microbatch, and their width: 512 x 256 floats = 0.5 MiB to the other
# rank per all_to_all, four all_to_alls a MoE layer a microbatch.
CAPACITY = 512
DIM = 256
# Tokens of a microbatch on a rank (every dense layer reads them all).
ROWS = WORLD_SIZE * CAPACITY
# Dense layers a MoE layer at most (a shape with two has twice as many): a cap on the sweep's depth.
MAX_DENSE_LAYERS = 64
ENGINE_VARIANTS = ("stock", "lane", "overlap", "turns", "twins")
# The variants whose all_to_alls are the identity: no collective at all.
COMPUTE_VARIANTS = ("compute", "compute_overlapped")
# The variants that overlap microbatches, and their rule for the forward's collectives (compute_overlapped has none
# to order: the default).
OVERLAPPED_VARIANTS = {
    "compute_overlapped": "after_backward_collectives",
    "overlap": "after_backward_collectives",
    "turns": "in_turns_with_backward_collectives",
    "twins": "beside_backward_collectives",
}
TIMED_VARIANTS = ("compute", "compute_overlapped", *ENGINE_VARIANTS)
# The rules read against the limit: the fraction of the gap between stock's exposure and the limit each closes.
RULES = ("lane", "overlap", "turns", "twins")
# Left out of a quick run's timing. The turns rule, not the default (its bits are still checked): it was a fifth of
# a quick run's steps, and the default rule's figures are the quick run's claim. compute_overlapped, which only the
# limit reads: at x1 of a full run here (456eb1e) the compute step took 563 ms of the quick variants' 2894 ms a
# repetition, so it would add about a fifth to this script's ~50 s quick run, where bench --quick (166-172 s) has
# 8-14 s left of its 3 minutes. A quick run prints no limit.
QUICK_LEFT_OUT = ("turns", "twins", "compute_overlapped")
# The variants whose forward and backward run one after the other, so that each phase has its own time.
PHASED_VARIANTS = ("compute", "stock", "lane")
# The table's variant column.
VARIANT_WIDTH = max(len(variant) for variant in TIMED_VARIANTS)
# The aims the summary measures against (the issue's): at the headline point, the overlap's exposed communication
# at most this fraction of stock's, and its step at most this fraction of stock's.
AIM_EXPOSED_FRACTION = 0.30
AIM_STEP_RATIO = 0.80


def installed_library() -> str | None:
    """Megatron-core if installed, else DeepSpeed, else None: one library is enough here."""
    return next(iter(installed_libraries()), None)


def _dense(layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(layers)])


class MoELayer(nn.Module):
    """pre-path's model, one microbatch's layer: the pre-path (a projection, then ``pre_layers`` dense layers),
    dispatch, expert, combine, and ``post_layers`` dense layers from the pre-path's output after it. With no dense
    layer, the all_to_alls have nothing to hide behind (T_comm's calibration)."""

    def __init__(self, all_to_all: Callable, pre_layers: int, post_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        # The projection makes the dispatched tokens need a gradient: the dispatch's backward all_to_all runs.
        self.pre = nn.Sequential(nn.Linear(DIM, DIM), _dense(pre_layers))
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.head = nn.Linear(DIM, 1)
        self.post = _dense(post_layers)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else _identity
        group = dist.group.WORLD
        hidden = self.pre(tokens)
        returned = all_to_all(group, self.expert(all_to_all(group, hidden)))
        loss = self.head(returned * torch.sigmoid(self.gate(hidden))).sum()
        if self.post:
            loss = loss + self.post(hidden).sum()
        return loss / N_MICROBATCHES


# MoE blocks a microbatch in dispatch-first: more than one, so that a forward's all_to_alls also come after dense
# work (the first block's shared expert), as in a model of many.
DISPATCH_FIRST_BLOCKS = 2


class DispatchFirstBlock(nn.Module):
    """One MoE block whose forward issues its dispatch all_to_all before any dense compute: a router projection,
    the dispatch, the expert, the combine gated by the projection, then a shared expert of ``shared_layers`` dense
    layers on the block's input. Its output is its input plus the routed path's and the shared expert's."""

    def __init__(self, shared_layers: int) -> None:
        super().__init__()
        # The projection makes the dispatched tokens need a gradient: the dispatch's backward all_to_all runs.
        self.router = nn.Linear(DIM, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.shared = _dense(shared_layers)

    def forward(self, tokens: torch.Tensor, all_to_all: Callable) -> torch.Tensor:
        group = dist.group.WORLD
        routed = self.router(tokens)
        returned = all_to_all(group, self.expert(all_to_all(group, routed)))
        # The residual keeps the second block's input at the first's magnitude: the routed path adds at most 1 a
        # value (tanh, gated), the shared expert's Linear + ReLU layers shrink what they read.
        output = tokens + returned * torch.sigmoid(self.gate(routed))
        if self.shared:
            output = output + self.shared(tokens)
        return output


class DispatchFirstModel(nn.Module):
    """dispatch-first's model: DISPATCH_FIRST_BLOCKS ``DispatchFirstBlock``s, their ``dense_layers`` split between
    their shared experts, and a head. With no dense layer, the all_to_alls have nothing to hide behind (T_comm's
    calibration)."""

    def __init__(self, all_to_all: Callable, dense_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        per_block = [dense_layers // DISPATCH_FIRST_BLOCKS] * DISPATCH_FIRST_BLOCKS
        per_block[-1] += dense_layers % DISPATCH_FIRST_BLOCKS
        self.blocks = nn.ModuleList(DispatchFirstBlock(layers) for layers in per_block)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else _identity
        hidden = tokens
        for block in self.blocks:
            hidden = block(hidden, all_to_all)
        return self.head(hidden).sum() / N_MICROBATCHES


def _pre_path_model(all_to_all: Callable, dense_layers: int) -> MoELayer:
    pre_layers = dense_layers // 2
    return MoELayer(all_to_all, pre_layers, dense_layers - pre_layers)


@dataclass(frozen=True)
class ModelShape:
    """A shape of model the sweep times."""

    # In the CSV's cases, after the library's name: ``<library>[ <case_name>] x<ratio>``; "" for pre-path, which
    # CSVs from before dispatch-first name by the library alone.
    case_name: str
    # In the table's and the summary's headings.
    title: str
    # MoE layers a microbatch, four all_to_alls each.
    moe_layers: int
    # (all_to_all, dense layers) -> the model.
    build: Callable[[Callable, int], nn.Module]

    @property
    def option_name(self) -> str:
        """Its name in ``--shapes``."""
        return self.case_name or "pre-path"

    def case_prefix(self, library: str) -> str:
        """The CSV's case of this shape's T_comm, and of its sweep points before `` x<ratio>``."""
        return f"{library} {self.case_name}" if self.case_name else library


PRE_PATH = ModelShape("", "pre-path", 1, _pre_path_model)
DISPATCH_FIRST = ModelShape(
    "dispatch-first", f"dispatch-first, {DISPATCH_FIRST_BLOCKS} MoE layers", DISPATCH_FIRST_BLOCKS, DispatchFirstModel
)
SHAPES = (PRE_PATH, DISPATCH_FIRST)
# A quick run leaves dispatch-first out, bits and all: its T_comm's calibration, bits check and steps would about
# double this script's part of bench --quick (twice the all_to_alls a microbatch, so twice the dense layers at a
# ratio), which (166-172 s) has 8-14 s left of its 3 minutes. The two shapes' figures are a full run's.
QUICK_SHAPES = (PRE_PATH,)


def _split_case_prefix(prefix: str) -> tuple[str, ModelShape]:
    """(library, shape) of a case's name before `` x<ratio>`` (``ModelShape.case_prefix``)."""
    library, _, case_name = prefix.partition(" ")
    return library, next(shape for shape in SHAPES if shape.case_name == case_name)


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The engine and declaration of ``variant``; the _AllToAll is back to undeclared afterwards. compute_overlapped
    runs on torch_ext's engine, as the overlap does, with no _AllToAll in its graph."""
    if variant in ("stock", "compute"):
        yield
        return
    torch_ext.run_in_lane(function)
    try:
        with torch_ext.enable():
            yield
    finally:
        torch_ext.unregister_collective_backward(function)


def _accumulate(model: nn.Module, batches: Sequence[torch.Tensor], variant: str) -> tuple[float, float]:
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


def _step(model: nn.Module, optimizer, batches, variant: str, function: type) -> dict[str, float]:
    """Seconds of a step (``step_s``: zero_grad, the microbatches, the SGD step), and for the phased variants of
    its forwards (``forward_s``) and backwards (``backward_s``), the ranks started together, Python's GC off."""
    dist.barrier()
    with gc_paused():
        start = time.perf_counter()
        cpu_start = time.process_time()
        optimizer.zero_grad(set_to_none=True)
        with variant_engine(variant, function):
            forward_s, backward_s = _accumulate(model, batches, variant)
        optimizer.step()
        step_s = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
    if variant not in PHASED_VARIANTS:
        return {"step_s": step_s, "cpu_s": cpu_s}
    return {"step_s": step_s, "cpu_s": cpu_s, "forward_s": forward_s, "backward_s": backward_s}


def _check_bits_and_memory(model: nn.Module, batches, function: type, rank: int, case: str) -> dict[str, dict]:
    """One step of each engine variant (no optimizer step), its activations counted (``_saved_peak``): its
    accumulated gradients must be torch.equal to stock's. Returns each variant's ``_saved_peak``."""
    grads, memory = {}, {}
    for variant in ENGINE_VARIANTS:
        memory[variant] = _saved_peak(model, batches, variant, function)
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


def _saved_peak(model: nn.Module, batches, variant: str, function: type) -> dict[str, float]:
    """One untimed step of ``variant`` (no optimizer step, the gradients left in ``.grad``) under a ``SavedBytes``
    pack hook: the peak bytes of activations held at once, and (the phased variants) the most one microbatch's
    forward saved."""
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *batches)}
    counter = SavedBytes(excluded)
    model.zero_grad(set_to_none=True)
    one_microbatch = 0
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), variant_engine(variant, function):
        if variant in OVERLAPPED_VARIANTS:
            _accumulate(model, batches, variant)
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


# --- traces (--timeline) ----------------------------------------------------------------------------------

# Steps traced per rule at the traced point: the split's parts are medians over them. Five: one step's exposure is
# not a figure to read (twins at x1 of dispatch-first, 10 timed steps: p20-p80 333-429 ms about a median of 391),
# and each rule's steps add about 8 s to a run.
TRACED_STEPS = 5


def _traced_step(model: nn.Module, optimizer, batches, variant: str, function: type) -> tuple[dict, list[dict]]:
    """One step of an overlapped ``variant`` as ``_step`` times it, under ``torch_ext.trace()``, with the forward
    thread's waits recorded (its all_to_alls, the hand-overs, the close): its ``_step_split.split_step``, its CPU
    time and its compute threads' (``_step_split.compute_thread_times``), in ms, and its events (the trace's, and the forward thread's as ``collective_wait`` spans and one
    ``node`` per busy stretch) for the timeline."""
    forward_waits: list[tuple[str, int, int]] = []
    all_to_all = model.all_to_all

    def timed_all_to_all(group, tokens):
        start = time.perf_counter_ns()
        try:
            return all_to_all(group, tokens)
        finally:
            forward_waits.append(("all_to_all", start, time.perf_counter_ns()))

    def waited(name: str, call: Callable[[], object]) -> int:
        start = time.perf_counter_ns()
        call()
        end = time.perf_counter_ns()
        forward_waits.append((name, start, end))
        return end

    model.all_to_all = timed_all_to_all
    dist.barrier()
    try:
        with gc_paused(), torch_ext.trace() as trace:
            start = time.perf_counter_ns()
            cpu_start = time.process_time()
            threads_at_start = threads_schedstat()
            optimizer.zero_grad(set_to_none=True)
            with variant_engine(variant, function):
                overlap = torch_ext.overlap_microbatches(OVERLAPPED_VARIANTS[variant])
                try:
                    for tokens in batches:
                        loss = model(tokens)
                        last_hand_over_end = waited("hand-over", lambda loss=loss: overlap.backward(loss))
                        del loss
                    waited("last backward", overlap.wait)
                    # The backward thread ends with the window: its counts now.
                    threads_before_close = threads_schedstat()
                    waited("close", overlap.close)
                finally:
                    overlap.close()
            optimizer.step()
            end = time.perf_counter_ns()
            # The kernel's counts inside the CPU clock's window, so that the compute threads' share of it is not
            # more than all of it.
            threads_at_end = threads_schedstat()
            cpu_s = time.process_time() - cpu_start
    finally:
        model.all_to_all = all_to_all
    events = [dict(event) for event in trace.events]
    calls = [e for e in events if e["kind"] == "backward"]
    backward_threads = {e["thread"] for e in calls}
    split = split_step(
        (start, end),
        [(s, e) for _, s, e in forward_waits],
        [(e["start_ns"], e["end_ns"]) for e in calls],
        [
            (e["start_ns"], e["end_ns"])
            for e in events
            if e["kind"] == "collective_wait" and e["thread"] in backward_threads
        ],
        last_hand_over_end,
    )
    forward_thread = threading.get_native_id()
    threads = compute_thread_times(
        threads_at_start, {**threads_before_close, **threads_at_end}, {forward_thread, *backward_threads}
    )
    events += [
        {"kind": "collective_wait", "name": name, "start_ns": s, "end_ns": e, "thread": forward_thread}
        for name, s, e in forward_waits
    ]
    events += [
        {"kind": "node", "name": "forward thread", "start_ns": s, "end_ns": e, "thread": forward_thread}
        for s, e in minus((start, end), [(s, e) for _, s, e in forward_waits])
    ]
    parts = {name.removesuffix("_ns") + "_ms": value / 1e6 for name, value in vars(split).items()}
    parts["cpu_ms"] = cpu_s * 1e3
    parts["compute_threads_on_core_ms"] = threads.on_core_ns / 1e6
    parts["compute_threads_ready_ms"] = threads.ready_ns / 1e6
    parts["other_threads_on_core_ms"] = parts["cpu_ms"] - parts["compute_threads_on_core_ms"]
    return parts, events


def _traced_rules(model, optimizer, batches, function, config: SweepConfig) -> tuple[dict, dict]:
    """TRACED_STEPS traced steps (``_traced_step``) of each overlapped rule this run times, the rules alternating:
    ``({rule: {part: [ms per step]}}, {rule: the first step's events})``."""
    rules = [v for v in timed_variants(config, RULES, QUICK_LEFT_OUT) if v in OVERLAPPED_VARIANTS]
    splits: dict[str, dict[str, list[float]]] = {rule: {} for rule in rules}
    first_events: dict[str, list[dict]] = {}
    for _ in range(TRACED_STEPS):
        for rule in rules:
            parts, events = _traced_step(model, optimizer, batches, rule, function)
            for name, value in parts.items():
                splits[rule].setdefault(name, []).append(value)
            first_events.setdefault(rule, events)
    return splits, first_events


def _write_timeline(first_events: dict[str, list[dict]], png_path: str, title: str) -> None:
    """Rank 0's first traced step of each rule, one row of threads each, as a PNG and its events beside it
    (``.json``)."""
    from torch_ext.tracing import plot_timelines

    directory = os.path.dirname(png_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    rows = list(first_events.items())
    with open(os.path.splitext(png_path)[0] + ".json", "w") as f:
        json.dump([{"label": label, "events": events} for label, events in rows], f, indent=1)
    plot_timelines(rows, png_path, title=title)
    progress(f"{NAME}: wrote {png_path} and its events beside it (.json)")


def _microbatches(rank: int, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(1000 * seed + rank)
    return [torch.randn(ROWS, DIM) for _ in range(N_MICROBATCHES)]


def _run_shape(
    library: str, shape: ModelShape, config: SweepConfig, t_layer: float, dense_layers_pinned: int | None
) -> dict:
    """``shape``'s T_comm, then its sweep: per point, the bits checked, the activations counted, the variants
    timed. ``dense_layers_pinned`` (--dense-layers): the one point's dense layers, whatever T_comm reads."""
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(library)
    batches = _microbatches(rank, 0)
    torch.manual_seed(rank)
    probe = shape.build(all_to_all, 0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)

    def probe_step() -> dict[str, float]:
        """One microbatch's forward and backward on stock, nothing to hide its all_to_alls behind."""
        dist.barrier()
        probe_optimizer.zero_grad(set_to_none=True)
        wall, blocked = timed_blocking(lambda: probe(batches[0]).backward())
        probe_optimizer.step()
        return {"backward_s": wall, "blocked_s": blocked}

    comm_s = calibrate_t_comm(probe_step)
    t_comm = statistics.median(comm_s)
    # --timeline traces the point nearest the headline's.
    traced_ratio = min(config.ratios, key=lambda r: abs(math.log(r / HEADLINE_RATIO)))
    points = []
    for ratio in config.ratios:
        dense_layers = dense_layers_pinned or sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS * shape.moe_layers)
        torch.manual_seed(rank)
        model = shape.build(all_to_all, dense_layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        memory = _check_bits_and_memory(model, batches, function, rank, sweep_case(shape.case_prefix(library), ratio))

        def measure(variant: str, _rep: int, model=model, optimizer=optimizer) -> dict[str, float]:
            return _step(model, optimizer, batches, variant, function)

        samples = timed_repetitions(
            timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT), measure, config.reps, config.warmup
        )
        point = {"ratio": ratio, "dense_layers": dense_layers, "samples": samples, "memory": memory}
        if config.timeline_png is not None and ratio == traced_ratio:
            point["trace"] = _trace_point(model, optimizer, batches, function, config, samples, shape, dense_layers)
        points.append(point)
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points}


def _trace_point(model, optimizer, batches, function, config: SweepConfig, samples, shape, dense_layers) -> dict:
    """--timeline at a point: each rule's traced steps (``_traced_rules``), with this rank's own compute step and
    its CPU time (medians, ms) to read them against; rank 0 draws its first step of each."""
    splits, first_events = _traced_rules(model, optimizer, batches, function, config)
    if dist.get_rank() == 0:
        stem, extension = os.path.splitext(config.timeline_png)
        png = config.timeline_png if shape is PRE_PATH else f"{stem}_{shape.case_name}{extension}"
        title = f"{shape.title}: one step a rule on rank 0 ({N_MICROBATCHES} microbatches, {dense_layers} dense layers)"
        try:
            _write_timeline(first_events, png, title)
        except OSError as error:
            progress(f"{NAME}: warning: could not write the timeline {png}: {error!r}")
    return {
        "splits": splits,
        "untraced_ms": {rule: statistics.median(samples[rule]["step_s"]) * 1e3 for rule in splits},
        "compute_ms": statistics.median(samples["compute"]["step_s"]) * 1e3,
        "compute_cpu_ms": statistics.median(samples["compute"]["cpu_s"]) * 1e3,
    }


def _run_rank(library: str, config: SweepConfig, shapes: Sequence[ModelShape], dense_layers_pinned: int | None) -> dict:
    """One rank's part, in the process group: its times per shape, sweep point and variant, under each shape's
    ``case_prefix``."""
    t_layer = agreed_max(dense_layer_backward_s(DIM, ROWS, config.calibration_reps, CALIBRATION_S))
    return {
        shape.case_prefix(library): _run_shape(library, shape, config, t_layer, dense_layers_pinned) for shape in shapes
    }


def _exposed(samples: dict, variant: str, metric: str) -> list[float]:
    """``variant``'s ``metric`` minus the same repetition's ``compute``'s, in seconds."""
    return [v - c for v, c in zip(samples[variant][metric], samples["compute"][metric], strict=True)]


def _ms(seconds: Sequence[float]) -> Summary:
    return summarize([s * 1e3 for s in seconds])


def _single(value: float) -> Summary:
    return Summary(value, value, value)


@dataclass(frozen=True)
class ExposureLimit:
    """A sweep point's limit (``exposure_limit``) and its parts, medians in ms."""

    # One microbatch's forward exposure and one's backward (the first's and the last's): what waits with nothing
    # to compute beside it.
    edges_ms: float
    # compute_overlapped's step - the same repetition's compute step: what two threads cost the compute.
    two_threads_ms: float
    # The CPU time the communication takes beyond the edges': stock's CPU time above its compute step's, less the
    # edges' share (1 / N_MICROBATCHES of it, in edges_ms already). 0 in a CSV from before CPU time was measured.
    comm_cpu_ms: float
    # N_MICROBATCHES x T_comm: the link's time for all the step's bytes.
    link_ms: float
    # The compute step, serial: what a step's exposure is measured from.
    compute_ms: float

    @property
    def exposed_ms(self) -> float:
        return max(self.edges_ms + self.two_threads_ms + self.comm_cpu_ms, self.link_ms - self.compute_ms)

    def parts(self) -> str:
        """How ``exposed_ms`` is made, for the table and the summary's notes."""
        return (
            f"max(edges {self.edges_ms:.1f} + two threads {self.two_threads_ms:.1f} + the communication's CPU "
            f"{self.comm_cpu_ms:.1f}, link {self.link_ms:.1f} - compute {self.compute_ms:.1f})"
        )


def exposure_limit(rows: dict, case: str) -> ExposureLimit | None:
    """The least exposed communication an order that runs two microbatches at once could reach at sweep point
    ``case``, from what its CSV ``rows`` (keyed as ``_common.read_csv`` keys them) measured; None where
    compute_overlapped was not timed (a quick run, a CSV from before it).

    Exposure is a step's time minus the same repetition's serial compute-only step, C (``compute``'s step). Only
    an order that runs two microbatches at once can hide a synchronous forward all_to_all (the forward's thread
    waits in it), and whatever else such an order does, two bounds hold:

    - Compute and edges. Its compute takes C2, the compute-only step on two threads (``compute_overlapped``: the
      overlap's threads, no collective). Beyond that, the edges wait with nothing to compute: microbatch 0's
      forward all_to_alls (no backward is in flight yet) and the last microbatch's backward ones (no forward comes
      after it). E = one microbatch's forward exposure + one microbatch's backward exposure, each phase's exposure
      over the step / N_MICROBATCHES, the lesser of stock's and the lane's (the lane hides a backward's
      all_to_alls behind its own dense path, which the last backward can do too). And the communication takes CPU
      time of its own (gloo's threads, the library's Python around each all_to_all, the lanes), which on a rank's
      one core no order can hide behind compute that already fills it: P, stock's CPU time above its compute
      step's (``cpu_added_ms``), less the edges' share, P / N_MICROBATCHES, which E holds already. Step >= C2 + E +
      P (N_MICROBATCHES - 1) / N_MICROBATCHES, so exposure >= E + (C2 - C) + P (N_MICROBATCHES - 1) /
      N_MICROBATCHES. (--timeline's traces of the rules at x1 found no other part: where both compute threads
      waited, between the edges, was under 0.01 of stock's exposure for twins.)
    - The link. Every byte of the step crosses it: L = N_MICROBATCHES x T_comm, T_comm the shape's wait for one
      microbatch's all_to_alls with no dense layer. Step >= L, so exposure >= L - C.

    The limit is the larger. What it leaves out would raise it: the compute before the first all_to_all and after
    the last (a projection's), and, in the link's bound, the communication's CPU time. What would lower it: P, if
    part of stock's CPU time above compute were not the communication's own (the all_to_alls are the only
    difference between the two steps), and in L, T_comm: timed one all_to_all at a time, it holds each one's
    latency, which two in flight at once could share.
    """
    if ("compute_overlapped", case, "added_ms") not in rows:
        return None

    def median(what: str, metric: str, of_case: str = case) -> float:
        return rows[(what, of_case, metric)]["median"]

    edges = sum(
        min(median(variant, f"{phase}_exposed_ms") for variant in ("stock", "lane"))
        for phase in ("forward", "backward")
    )
    comm_cpu = rows.get(("stock", case, "cpu_added_ms"))
    return ExposureLimit(
        edges_ms=edges / N_MICROBATCHES,
        two_threads_ms=median("compute_overlapped", "added_ms"),
        comm_cpu_ms=0.0 if comm_cpu is None else comm_cpu["median"] * (N_MICROBATCHES - 1) / N_MICROBATCHES,
        link_ms=N_MICROBATCHES * median("comm", "t_comm_ms", case.rpartition(" x")[0]),
        compute_ms=median("compute", "step_ms"),
    )


def gap_closed(stock_exposed_ms: float, exposed_ms: float, limit_exposed_ms: float) -> float:
    """The fraction of the gap between stock's exposure and the limit that ``exposed_ms`` closes: 0 at stock's, 1 at
    the limit; NaN where stock's is not above the limit (no gap to close)."""
    gap = stock_exposed_ms - limit_exposed_ms
    return (stock_exposed_ms - exposed_ms) / gap if gap > 0 else float("nan")


def _gaps_closed(rows: dict, case: str, limit: ExposureLimit) -> dict[str, float]:
    """Each timed rule's ``gap_closed`` at sweep point ``case``, from its CSV ``rows``."""
    stock = rows[("stock", case, "exposed_ms")]["median"]
    return {
        rule: gap_closed(stock, rows[(rule, case, "exposed_ms")]["median"], limit.exposed_ms)
        for rule in RULES
        if (rule, case, "exposed_ms") in rows
    }


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    for prefix in results[0]:
        library, shape = _split_case_prefix(prefix)
        first = results[0][prefix]
        comm = _ms(first["comm_s"])
        print(
            f"\n{NAME}, {LIBRARY_NAMES[library]}, {shape.title}: {N_MICROBATCHES} microbatches of {ROWS} tokens x "
            f"{DIM}d, {CAPACITY} per expert, {link}; T_comm {comm} ms a microbatch (stock's wait for its "
            f"{4 * shape.moe_layers} all_to_alls with no dense layer, {len(first['comm_s'])} steps), "
            f"{N_MICROBATCHES * comm.median:.1f} ms a step; one dense layer's backward {first['t_layer'] * 1e3:.2f} "
            "ms. gap: the fraction of stock's exposure above the limit (where compute_overlapped was timed) that a "
            "rule hides"
        )
        print(
            f"{'ratio':>5} {'layers':>6} {'variant':<{VARIANT_WIDTH}} {'step ms':>8} {'/stock':>6} {'exposed ms':>10} "
            f"{'/stock':>6} {'cpu +ms':>7} {'fwd exp':>7} {'bwd exp':>7} {'saved MiB':>9} {'/stock':>6} {'gap':>6}"
        )
        rows.append(csv_row("comm", prefix, f"{ROWS} tokens x {DIM}d a microbatch, {link}", "t_comm_ms", comm, sha))
        merged = merge_ranks([r[prefix]["points"] for r in results])
        for index, point in enumerate(merged):
            samples = point["samples"]
            # Each rank's activations are its own; the larger of the two ranks' (they hold the same shapes).
            memory = {
                variant: {
                    key: max(r[prefix]["points"][index]["memory"][variant][key] for r in results)
                    for key in ("saved_peak_bytes", "one_microbatch_bytes")
                }
                for variant in ENGINE_VARIANTS
            }
            case = sweep_case(prefix, point["ratio"])
            size = f"{ROWS} tokens x {DIM}d a microbatch, {point['dense_layers']} dense layers, {link}"
            stock_step = statistics.median(samples["stock"]["step_s"])
            stock_exposed = statistics.median(_exposed(samples, "stock", "step_s"))
            stock_saved = memory["stock"]["saved_peak_bytes"]
            one_microbatch = memory["stock"]["one_microbatch_bytes"]
            rows.append(csv_row("stock", case, size, "one_microbatch_mib", _single(one_microbatch / 2**20), sha))
            # Each variant's cells: printed once the point's limit is known.
            lines = []
            for variant in (v for v in TIMED_VARIANTS if v in samples):
                step = _ms(samples[variant]["step_s"])
                rows.append(csv_row(variant, case, size, "step_ms", step, sha))
                cells = [f"{step.median:8.1f}", f"{step.median / 1e3 / stock_step:6.2f}"]
                if variant in PHASED_VARIANTS:
                    for phase in ("forward", "backward"):
                        rows.append(
                            csv_row(variant, case, size, f"{phase}_ms", _ms(samples[variant][f"{phase}_s"]), sha)
                        )
                if variant == "compute":
                    cpu = _ms(samples[variant]["cpu_s"])
                    rows.append(csv_row(variant, case, size, "cpu_ms", cpu, sha))
                    lines.append((variant, [*cells, f"{'(cpu ms)':>17}", f"{cpu.median:7.1f}"]))
                    continue
                if variant == "compute_overlapped":
                    added = _ms(_exposed(samples, variant, "step_s"))
                    rows.append(csv_row(variant, case, size, "added_ms", added, sha))
                    lines.append((variant, [*cells, f"{'(+ms, 2 threads)':>17}", f"{added.median:7.1f}"]))
                    continue
                exposed_s = _exposed(samples, variant, "step_s")
                exposed = _ms(exposed_s)
                rows.append(csv_row(variant, case, size, "exposed_ms", exposed, sha))
                cpu_added = _ms(_exposed(samples, variant, "cpu_s"))
                rows.append(csv_row(variant, case, size, "cpu_added_ms", cpu_added, sha))
                cells += [
                    f"{exposed.median:10.1f}",
                    f"{exposed.median / 1e3 / stock_exposed:6.2f}",
                    f"{cpu_added.median:7.1f}",
                ]
                if variant in PHASED_VARIANTS:
                    for phase in ("forward", "backward"):
                        phase_exposed = _ms(_exposed(samples, variant, f"{phase}_s"))
                        rows.append(csv_row(variant, case, size, f"{phase}_exposed_ms", phase_exposed, sha))
                        cells.append(f"{phase_exposed.median:7.1f}")
                else:
                    cells.append(f"{'(phases overlap)':>15}")
                saved = memory[variant]["saved_peak_bytes"]
                rows.append(csv_row(variant, case, size, "saved_peak_mib", _single(saved / 2**20), sha))
                cells += [f"{saved / 2**20:9.1f}", f"{saved / stock_saved:6.2f}"]
                lines.append((variant, cells))
            # The ratio the point had: the communication-free step's backward over the step's T_comm.
            ratio = measured_ratio(samples["compute"]["backward_s"], N_MICROBATCHES * comm.median / 1e3)
            rows.append(measured_ratio_row(case, size, ratio, sha))
            point_rows = _rows_by_key(rows)
            limit = exposure_limit(point_rows, case)
            gaps = {} if limit is None else _gaps_closed(point_rows, case, limit)
            if limit is not None:
                for metric, value in (
                    ("edges_ms", limit.edges_ms),
                    ("comm_cpu_ms", limit.comm_cpu_ms),
                    ("link_ms", limit.link_ms),
                    ("limit_exposed_ms", limit.exposed_ms),
                ):
                    rows.append(csv_row("limit", case, size, metric, _single(value), sha))
                for rule, gap in gaps.items():
                    rows.append(csv_row(rule, case, size, "gap_closed", _single(gap), sha))
            for variant, cells in lines:
                gap = [f"{gaps[variant]:6.2f}"] if variant in gaps else []
                print(
                    f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<{VARIANT_WIDTH}} "
                    f"{' '.join([*cells, *gap])}"
                )
            print(f"{'':12} measured ratio (compute-only backward / T_comm) {ratio:.2f}")
            _print_trace_split([r[prefix]["points"][index].get("trace") for r in results], stock_exposed * 1e3)
            print(
                f"{'':12} one microbatch's activations {one_microbatch / 2**20:.1f} MiB: stock + one microbatch = "
                f"{(stock_saved + one_microbatch) / stock_saved:.2f} x stock's peak"
            )
            if limit is not None:
                print(
                    f"{'':12} limit: exposed {limit.exposed_ms:.1f} ms, {limit.exposed_ms / 1e3 / stock_exposed:.2f} "
                    f"of stock's = {limit.parts()}"
                )
    if load is not None:
        rows.append(csv_row("machine", NAME, link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")
    print_summary(summary_rows(_rows_by_key(rows)))


def _print_trace_split(traces: Sequence[dict | None], stock_exposed_ms: float) -> None:
    """--timeline's split of each rank's traced steps (``_step_split``), medians over the steps, in ms. A step's
    exposure (the traced step - the rank's own compute step) is the time some compute thread was busy above the
    compute step (``busy +``) and the time both compute threads waited: at the leading edge, in the middle, at the
    trailing edge. ``busy +`` in turn: the compute threads' time on a core above the compute step's CPU time (``on
    core +``), the other threads' (``others``: gloo's, the lanes'; the process's CPU time less the compute
    threads'), and the rest by difference (``rest``: a compute thread outside its recorded waits yet not on a
    core, blocked where the trace records no wait, or ready while a thread of the other rank ran). Beside them the
    compute threads' time ready with no core free (``ready``, the two threads' summed: while one runs the other
    is often ready, so it is not time lost) and the trace's own cost (``trace +``: the traced step - the rank's
    untraced median)."""
    if any(trace is None for trace in traces):
        return
    print(
        f"{'':12} traced ({TRACED_STEPS} steps a rule, medians, ms): exposed = the traced step - the rank's compute "
        "step = busy + + idle (leading, middle, trailing); busy + = on core + + others + rest"
    )
    print(
        f"{'':12} {'rank':>4} {'rule':<8} {'step':>7} {'trace +':>7} {'exposed':>7} {'/stock':>6} {'busy +':>6} "
        f"{'leading':>7} {'middle':>6} {'trailing':>8} {'on core +':>9} {'others':>6} {'rest':>6} {'ready':>6}"
    )
    for rank, trace in enumerate(traces):
        for rule, parts in trace["splits"].items():
            median = {name: statistics.median(values) for name, values in parts.items()}
            exposed = median["step_ms"] - trace["compute_ms"]
            busy_added = median["busy_ms"] - trace["compute_ms"]
            on_core_added = median["compute_threads_on_core_ms"] - trace["compute_cpu_ms"]
            print(
                f"{'':12} {rank:4d} {rule:<8} {median['step_ms']:7.1f} "
                f"{median['step_ms'] - trace['untraced_ms'][rule]:7.1f} {exposed:7.1f} {exposed / stock_exposed_ms:6.2f} "
                f"{busy_added:6.1f} {median['idle_leading_ms']:7.1f} {median['idle_middle_ms']:6.1f} "
                f"{median['idle_trailing_ms']:8.1f} {on_core_added:9.1f} {median['other_threads_on_core_ms']:6.1f} "
                f"{busy_added - on_core_added - median['other_threads_on_core_ms']:6.1f} "
                f"{median['compute_threads_ready_ms']:6.1f}"
            )


def print_summary(rows: Sequence[SummaryRow]) -> None:
    """The headline point's figures against stock, per case, and the overlap against the aims."""
    for case in dict.fromkeys(row.case for row in rows):
        of_case = {row.variant: row.values for row in rows if row.case == case}
        points = [
            key.removeprefix("exposed_fraction ") for key in of_case["stock"] if key.startswith("exposed_fraction x")
        ]
        headline = of_case["stock"]["headline_ratio"]
        print(f"\nsummary, {case}: at the headline point x{headline:g} (the sweep's points: {', '.join(points)})")
        print(
            f"{'variant':<8} {'exposed / stock':>15} {'step / stock':>12} {'saved peak / stock':>18} "
            f"{'cpu added / stock exposed':>25}"
        )
        for variant, values in of_case.items():
            print(
                f"{variant:<8} {values['exposed_fraction']:15.2f} {values['ratio']:12.2f} "
                f"{values['saved_peak_ratio']:18.2f} {values['cpu_added_fraction']:25.2f}"
            )
        overlap, lane = of_case["overlap"], of_case["lane"]
        below = [p for p in points if overlap[f"exposed_fraction {p}"] < lane[f"exposed_fraction {p}"]]
        print(
            f"overlap: exposed {overlap['exposed_fraction']:.2f} of stock's, {overlap['cpu_added_fraction']:.2f} of it "
            f"CPU time above the compute step's (aim <= {AIM_EXPOSED_FRACTION:.2f}: "
            f"{'met' if overlap['exposed_fraction'] <= AIM_EXPOSED_FRACTION else 'not met'}), step "
            f"{overlap['ratio']:.2f} x stock's (aim <= {AIM_STEP_RATIO:.2f}: "
            f"{'met' if overlap['ratio'] <= AIM_STEP_RATIO else 'not met'}), below the lane's exposed at "
            f"{len(below)}/{len(points)} points; saved activations' peak {overlap['saved_peak_ratio']:.2f} x stock's "
            f"(stock's + one microbatch's: {overlap['one_more_ratio']:.2f})"
        )
        for rule in ("turns", "twins"):
            values = of_case.get(rule)
            if values is None:
                continue
            by_point = ", ".join(
                f"{p} {values[f'exposed_fraction {p}']:.2f}/{overlap[f'exposed_fraction {p}']:.2f}" for p in points
            )
            print(
                f"{rule}: exposed {values['exposed_fraction']:.2f} of stock's, step {values['ratio']:.2f} x stock's; "
                f"exposed against the overlap's by point: {by_point}"
            )
        stock = of_case["stock"]
        if "limit_exposed_ms" in stock:
            gaps = ", ".join(f"{rule} {of_case[rule]['gap_closed']:.2f}" for rule in RULES if rule in of_case)
            print(
                f"limit: exposed {stock['limit_exposed_ms']:.1f} ms, {stock['limit_fraction']:.2f} of stock's; the gap "
                f"between stock's exposure and the limit closed: {gaps}"
            )


def _rows_by_key(rows: Sequence[dict]) -> dict:
    """Rows as ``_common.read_csv`` keys them, for summary_rows on what was just measured."""
    return {(row["what"], row["case"], row["metric"]): row for row in rows}


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        __doc__,
        NAME,
        quick_help="fewer repetitions and sweep points",
        timeline_help="after timing the point nearest x1, trace steps of each overlapped rule, print where their "
        "exposure goes and draw rank 0's first of each (dispatch-first's beside it, named _dispatch-first)",
    )
    parser.add_argument(
        "--shapes",
        type=_parse_shapes,
        help="the shapes to time, separated by commas: "
        f"{', '.join(shape.option_name for shape in SHAPES)} (default: {QUICK_SHAPES[0].option_name} in a quick "
        "run, both in a full one)",
    )
    parser.add_argument(
        "--dense-layers",
        type=int,
        metavar="N",
        help="with one ratio: N dense layers a microbatch, whatever T_comm's calibration reads, so that runs "
        "compare the same work (the link here reads one all_to_all at ~8 or ~16 ms from run to run)",
    )
    args = parse_sweep_args(parser, argv)
    if args.dense_layers is not None and (args.dense_layers < 1 or args.ratios is None or len(args.ratios) != 1):
        parser.error("--dense-layers takes a positive number of layers and one --ratios point, the one it names")
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    library = installed_library()
    if library is None:
        print(
            f"{NAME}: skipped: neither Megatron-core nor DeepSpeed is installed "
            "(pip install torch==2.13.0 megatron-core==0.16.1 deepspeed==0.19.8)"
        )
        return 0
    # 10 quick repetitions, not 6. On an Intel Xeon three quick runs of 6 (three points) read the overlap's
    # exposure 0.41-0.58 of stock's, three of 10 read 0.45-0.55. At the one point a quick run now sweeps, three
    # runs of 10 read 0.47-0.49, in ~50 s each.
    config = sweep_config(args, NAME, quick_reps=10, reps=15)
    announce = (
        f"{NAME}: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {library}, {N_MICROBATCHES} microbatches, "
        f"{', '.join(shape.option_name for shape in shapes)}, ratios {','.join(f'{r:g}' for r in config.ratios)}, "
        f"{config.reps} repetitions"
    )
    return run_sweep(
        __file__, args, argv, lambda: _run_rank(library, config, shapes, args.dense_layers), report, announce
    )


def _parse_shapes(text: str) -> tuple[ModelShape, ...]:
    """``--shapes``: shapes' ``option_name``s separated by commas (an argparse ``type``)."""
    import argparse

    by_name = {shape.option_name: shape for shape in SHAPES}
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in by_name]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown shape {', '.join(map(repr, unknown)) or repr(text)}; the shapes: {', '.join(by_name)}"
        )
    return tuple(dict.fromkeys(by_name[name] for name in names))


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def _per_point(rows: dict, variant: str, points, metric: str, over: str | None = "stock") -> list[float]:
    """``variant``'s ``metric`` at each point, over ``over``'s at the same point where given."""
    return [
        rows[(variant, case, metric)]["median"] / (1.0 if over is None else rows[(over, case, metric)]["median"])
        for _, case in points
    ]


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library, shape and engine variant: the headline is the exposed communication at the headline
    point (``_common.headline_point``) as a fraction of stock's there; the ratio column the step time over stock's
    there. The notes: per point, the exposed fraction and the step over stock's; the peak activations over
    stock's; the aims. Where compute_overlapped was timed at every point (a full run): stock's notes add the limit
    (``exposure_limit``), each rule's the fraction of the gap to it closed (``gap_closed``)."""
    summary = []
    for prefix in dict.fromkeys(case.rpartition(" x")[0] for case in csv_cases(rows, "exposed_ms")):
        library, shape = _split_case_prefix(prefix)
        points = [
            (r, case) for r, case in sweep_cases(rows, "stock", "exposed_ms") if case.rpartition(" x")[0] == prefix
        ]
        link = rows[("stock", points[0][1], "step_ms")]["size"].rpartition(", ")[2]
        t_comm = rows.get(("comm", prefix, "t_comm_ms"))
        headline_ratio, headline = headline_point(points)
        at_headline = points.index((headline_ratio, headline))
        lane_fractions = _per_point(rows, "lane", points, "exposed_ms")
        overlap_fractions = _per_point(rows, "overlap", points, "exposed_ms")
        stock_exposed_ms = _per_point(rows, "stock", points, "exposed_ms", over=None)
        limits = [exposure_limit(rows, case) for _, case in points]
        has_limit = all(limit is not None for limit in limits)
        # What "one more microbatch's activations" allows: stock's peak and one microbatch's, over stock's peak.
        one_more = (
            1
            + rows[("stock", headline, "one_microbatch_mib")]["median"]
            / rows[("stock", headline, "saved_peak_mib")]["median"]
        )
        shape_title = "" if shape is PRE_PATH else f", {shape.title}"
        for variant in ENGINE_VARIANTS:
            if (variant, points[0][1], "exposed_ms") not in rows:
                continue  # a CSV from before the variant was measured, or a quick run's
            fractions = _per_point(rows, variant, points, "exposed_ms")
            steps = _per_point(rows, variant, points, "step_ms")
            memory = _per_point(rows, variant, points, "saved_peak_mib")
            exposed_ms = _per_point(rows, variant, points, "exposed_ms", over=None)
            # CPU time above the communication-free step's, over stock's exposed communication (CSVs from before
            # it was measured lack it).
            cpu_added = rows.get((variant, headline, "cpu_added_ms"))
            values = {
                "cpu_added_fraction": float("nan")
                if cpu_added is None
                else cpu_added["median"] / rows[("stock", headline, "exposed_ms")]["median"],
                "exposed_fraction": fractions[at_headline],
                "ratio": steps[at_headline],
                "exposed_ms": exposed_ms[at_headline],
                "saved_peak_ratio": memory[at_headline],
                "headline_ratio": headline_ratio,
            }
            values.update({f"exposed_fraction x{ratio:g}": f for (ratio, _), f in zip(points, fractions, strict=True)})
            values.update({f"step_ratio x{ratio:g}": s for (ratio, _), s in zip(points, steps, strict=True)})
            per_point = ", ".join(
                f"x{ratio:g}: {f:.2f}/{s:.2f}" for (ratio, _), f, s in zip(points, fractions, steps, strict=True)
            )
            measured = f"exposed {values['exposed_fraction']:.2f} of stock's"
            notes = (
                f"headline at x{headline_ratio:g}; exposed/stock's and step/stock by dense/comm ratio {per_point}; "
                f"exposed {values['exposed_ms']:.1f} ms, of which CPU time above the compute step's "
                f"{values['cpu_added_fraction']:.2f} of "
                f"stock's exposed; saved activations' peak / stock's "
                f"{values['saved_peak_ratio']:.2f}"
            )
            if variant == "overlap":
                below_lane = sum(f < lane for f, lane in zip(fractions, lane_fractions, strict=True))
                values["one_more_ratio"] = one_more
                notes += (
                    f" (stock's + one microbatch's: {one_more:.2f}); below the lane's exposed at "
                    f"{below_lane}/{len(points)} points; aims: exposed <= {AIM_EXPOSED_FRACTION:.2f} of stock's "
                    f"({'met' if values['exposed_fraction'] <= AIM_EXPOSED_FRACTION else 'not met'}), step <= "
                    f"{AIM_STEP_RATIO:.2f} x stock's ({'met' if values['ratio'] <= AIM_STEP_RATIO else 'not met'})"
                )
            if variant in ("turns", "twins"):
                below_overlap = sum(f < o for f, o in zip(fractions, overlap_fractions, strict=True))
                notes += f"; below the overlap's exposed at {below_overlap}/{len(points)} points"
            if has_limit and variant == "stock":
                limit = limits[at_headline]
                limit_fractions = [lim.exposed_ms / s for lim, s in zip(limits, stock_exposed_ms, strict=True)]
                values["limit_exposed_ms"] = limit.exposed_ms
                values["limit_fraction"] = limit_fractions[at_headline]
                values.update(
                    {f"limit_fraction x{ratio:g}": f for (ratio, _), f in zip(points, limit_fractions, strict=True)}
                )
                notes += (
                    f"; limit of an overlapped order {limit.exposed_ms:.1f} ms, {values['limit_fraction']:.2f} of "
                    f"stock's exposed = {limit.parts()}, by ratio "
                    + ", ".join(f"x{ratio:g}: {f:.2f}" for (ratio, _), f in zip(points, limit_fractions, strict=True))
                )
            if has_limit and variant in RULES:
                gaps = [
                    gap_closed(s, e, lim.exposed_ms)
                    for s, e, lim in zip(stock_exposed_ms, exposed_ms, limits, strict=True)
                ]
                values["gap_closed"] = gaps[at_headline]
                values.update({f"gap_closed x{ratio:g}": g for (ratio, _), g in zip(points, gaps, strict=True)})
                measured += f", {values['gap_closed']:.2f} of the gap to the limit closed"
                notes += "; gap to the limit closed by ratio " + ", ".join(
                    f"x{ratio:g}: {g:.2f}" for (ratio, _), g in zip(points, gaps, strict=True)
                )
            if variant == "stock" and t_comm is not None:
                notes += f"; T_comm {t_comm['median']:.3g} ms a microbatch" + load_note(rows, NAME)
            summary.append(
                SummaryRow(
                    NAME,
                    f"{LIBRARY_NAMES.get(library, library)}{shape_title}, {N_MICROBATCHES} microbatches, {link}",
                    variant,
                    "stock",
                    measured,
                    f"{values['ratio']:.2f}",
                    notes,
                    values,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    """Per case: exposed communication over stock's (and the limit's, where measured), and step time over stock's,
    against dense / comm."""
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(len(cases), 2, squeeze=False)
    for (exposed_ax, step_ax), case in zip(axes, cases, strict=True):
        of_case = [r for r in rows if r.case == case]
        # The limit of an overlapped order, where a full run measured it (stock's values carry it).
        limit = sorted(
            (float(name.removeprefix("limit_fraction x")), value)
            for row in of_case
            if row.variant == "stock"
            for name, value in row.values.items()
            if name.startswith("limit_fraction x")
        )
        if limit:
            exposed_ax.plot(
                [r for r, _ in limit], [v for _, v in limit], color="black", linestyle=":", marker="x", label="limit"
            )
        for ax, key, ylabel in (
            (exposed_ax, "exposed_fraction x", "exposed communication / stock's"),
            (step_ax, "step_ratio x", "step time / stock's"),
        ):
            for row in of_case:
                curve = sorted(
                    (float(name.removeprefix(key)), value) for name, value in row.values.items() if name.startswith(key)
                )
                ax.plot([r for r, _ in curve], [v for _, v in curve], marker="o", label=row.variant)
            ax.axhline(1.0, color="grey", linewidth=0.6)
            ax.set_xlabel("dense backward / T_comm (a microbatch)")
            ax.set_ylabel(ylabel)
            # A line each for the library and the shape, the rest on the last.
            ax.set_title(case.replace(", ", "\n", max(1, case.count(", ") - 1)), fontsize=8)
            ax.legend(fontsize=8)
        exposed_ax.axhline(AIM_EXPOSED_FRACTION, color="black", linewidth=0.8, linestyle="--")
        step_ax.axhline(AIM_STEP_RATIO, color="black", linewidth=0.8, linestyle="--")
    figure.suptitle("Overlap across microbatches: the stock loop, the lane alone, the lane with the overlap (- - aims)")


if __name__ == "__main__":
    sys.exit(main())
