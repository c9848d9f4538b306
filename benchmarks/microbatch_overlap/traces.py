"""--timeline: at the point nearest x1, steps of each overlapped rule under ``torch_ext.trace()``, the forward
thread's waits recorded, their time split (.step_split) and rank 0's first of each drawn."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

import torch_ext

from ..harness.results import progress
from ..harness.sweep import SweepConfig, timed_variants
from ..harness.timing import gc_paused
from . import N_MICROBATCHES, NAME, OVERLAPPED_VARIANTS, QUICK_LEFT_OUT, RULES, TRACED_STEPS
from .shapes import PRE_PATH
from .step_split import compute_thread_times, minus, split_step, threads_schedstat
from .variants import variant_engine


def traced_step(model: nn.Module, optimizer, batches, variant: str, function: type) -> tuple[dict, list[dict]]:
    """One step of an overlapped ``variant`` as ``variants.step`` times it, under ``torch_ext.trace()``, with the
    forward thread's waits recorded (its all_to_alls, the hand-overs, the close): its ``step_split.split_step``, its
    CPU time and its compute threads' (``step_split.compute_thread_times``), in ms, and its events (the trace's, and
    the forward thread's as ``collective_wait`` spans and one ``node`` per busy stretch) for the timeline."""
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


def traced_rules(model, optimizer, batches, function, config: SweepConfig) -> tuple[dict, dict]:
    """TRACED_STEPS traced steps (``traced_step``) of each overlapped rule this run times, the rules alternating:
    ``({rule: {part: [ms per step]}}, {rule: the first step's events})``."""
    rules = [v for v in timed_variants(config, RULES, QUICK_LEFT_OUT) if v in OVERLAPPED_VARIANTS]
    splits: dict[str, dict[str, list[float]]] = {rule: {} for rule in rules}
    first_events: dict[str, list[dict]] = {}
    for _ in range(TRACED_STEPS):
        for rule in rules:
            parts, events = traced_step(model, optimizer, batches, rule, function)
            for name, value in parts.items():
                splits[rule].setdefault(name, []).append(value)
            first_events.setdefault(rule, events)
    return splits, first_events


def write_timeline(first_events: dict[str, list[dict]], png_path: str, title: str) -> None:
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


def trace_point(model, optimizer, batches, function, config: SweepConfig, samples, shape, dense_layers) -> dict:
    """--timeline at a point: each rule's traced steps (``traced_rules``), with this rank's own compute step and
    its CPU time (medians, ms) to read them against; rank 0 draws its first step of each."""
    splits, first_events = traced_rules(model, optimizer, batches, function, config)
    if dist.get_rank() == 0:
        stem, extension = os.path.splitext(config.timeline_png)
        png = config.timeline_png if shape is PRE_PATH else f"{stem}_{shape.case_name}{extension}"
        title = f"{shape.title}: one step a rule on rank 0 ({N_MICROBATCHES} microbatches, {dense_layers} dense layers)"
        try:
            write_timeline(first_events, png, title)
        except OSError as error:
            progress(f"{NAME}: warning: could not write the timeline {png}: {error!r}")
    return {
        "splits": splits,
        "untraced_ms": {rule: statistics.median(samples[rule]["step_s"]) * 1e3 for rule in splits},
        "compute_ms": statistics.median(samples["compute"]["step_s"]) * 1e3,
        "compute_cpu_ms": statistics.median(samples["compute"]["cpu_s"]) * 1e3,
    }
