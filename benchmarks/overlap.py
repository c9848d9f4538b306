"""Overlap of a backward all_to_all with the rest of backward: stock PyTorch against torch_ext.

The scenario is a recommendation model's step on 2 gloo ranks:

  sparse  embedding lookup -> all_to_all_single -> SPARSE_LAYERS cheap per-row layers -> pooled
  dense   an MLP (Linear(HIDDEN, HIDDEN) + ReLU) of the depth the sweep asks for, created after the sparse part
  over    concat(sparse, dense) -> Linear -> ReLU -> Linear -> sum

In backward, stock runs ready nodes by descending sequence number, so after the overarch it runs the
whole dense MLP (created later) before the sparse layers, and only then the all_to_all's backward,
whose communication is exposed at the end of the step. Boosting the all_to_all's node with
``grad_fn._set_sequence_nr`` (PyTorch PR #114120) does not help here: the node is not ready until
the sparse layers between it and the loss have run, and they keep their order. torch_ext propagates
the collective's automatic priority to every node on the path from the loss, launches the
all_to_all, runs the dense MLP while it is in flight and waits only at the embedding's backward.

Variants, each timed as the backward call alone (forward, which waits for its own all_to_all, is
not timed), the slowest rank's time counting for the step:

  stock              PyTorch's functional all_to_all (``all_to_all_single_autograd``), stock engine
  stock+seq_nr       the same, with the all_to_all's node boosted by ``_set_sequence_nr``
  torch_ext          ``torch_ext.ops.all_to_all_single`` on torch_ext's engine (automatic priority,
                     wait at first use)
  torch_ext(funcol)  PyTorch's functional all_to_all on torch_ext's engine: priority alone, the
                     functional op still waits inside its node
  torch_ext(funcol lane)  the same, its op declared with ``torch_ext.run_in_lane``: the node runs on its
                     group's lane beside the dense MLP
  compute            the same graph with the all_to_all replaced by a local copy (no communication),
                     stock engine: the compute of stock and stock+seq_nr
  compute(torch_ext) the same on torch_ext's engine: the compute of torch_ext and torch_ext(funcol)
                     (torch_ext's engine alone ran this graph's backward 2-7% faster than stock's)
  comm               the backward all_to_all alone, between the steps (reported; T_comm is stock's
                     wait with no dense layer: _common.calibrate_t_comm)

The all_to_all sends ``--payload-mib`` MiB to the other rank. The dense MLP's backward is swept over
multiples of T_comm (``--ratios``; full 0.25,0.5,1,1.5,2, quick 1 alone: the headline's point): the script measures T_comm and
one dense layer's backward (both ranks agree on the larger) and builds the depth that makes the dense
backward ``ratio`` x T_comm. At each point, per repetition, each rank's backward thread's blocked time is
measured (waiting for the all_to_all's bytes: ``_common.timed_blocking``); exposed communication = the
slowest rank's backward minus the longest time any rank spent unblocked in it
(``_common.exposed_past_the_slowest_rank``: a rank's wait for the other to arrive is not communication), and
overlap efficiency = 1 - exposed / T_comm (stock's wait with no dense layer, read the same way): 1 when the
communication is completely hidden, 0 when it is fully exposed. Beside it, the backward's excess over its
engine's compute variant (``over_compute_ms``): what the communication costs the step in all, noisier, and
from it the efficiency by step time, 1 - that / T_comm (``step_efficiency``). Each point reports the ratio it
measured, stock's compute variant's backward over T_comm, and its ideal is min(1, that): no more communication can
hide than there is compute beside it (the sweep asks for a ratio of dense layers, and the rest of backward computes
too). A quick run leaves out ``stock+seq_nr`` and ``torch_ext(funcol)`` (QUICK_LEFT_OUT).

On this machine's loopback, gloo's transfer is kernel memcpy on the same two cores the ranks compute
on, so nothing can overlap (docs/design.md, "Measuring overlap on this machine"). A real NIC moves bytes
without the CPU; to model one, the ranks run as two hosts (``_hosts.run_on_two_hosts``): two network
namespaces joined by a veth pair shaped to 1 Gbit/s with HTB, each rank started by ``torchrun
--nnodes 2 --rdzv-backend c10d`` in its own, as on two machines (needs root, iproute2 and util-linux).
What cannot be made falls back, said in the log and in the CSV's size column: to one namespace with a
shaped loopback, then to plain loopback, where no engine can show overlap.

Started by torchrun itself (on two real machines, README "Across machines"), the script is one rank:
rank 0 prints the table and writes the CSV.

With ``--timeline PNG``, after timing the point nearest ratio 1, both ranks run one more backward of stock
and one of torch_ext under a tracer (stock: ``torch.profiler``, converted by ``stock_backward_events``; torch_ext:
``torch_ext.trace()``), and rank 0 draws rank 0's two timelines one above the other with
``torch_ext.tracing.plot_timelines`` and writes their events beside the PNG (same name, ``.json``).

    python benchmarks/overlap.py [--quick] [--reps N] [--ratios 0.5,1,2] [--payload-mib M]
        [--network two-hosts|one-namespace|loopback] [--timeline PNG] [--out CSV]
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from _common import (
    CALIBRATION_S,
    Summary,
    SummaryRow,
    SweepConfig,
    calibrate_t_comm,
    csv_row,
    dense_layer_backward_s,
    exposure,
    git_sha,
    headline_over_stock,
    load_note,
    measured_ratio,
    measured_ratio_row,
    merge_ranks,
    parse_sweep_args,
    plot_efficiency_curves,
    print_load,
    print_t_comm,
    progress,
    run_sweep,
    scenario_and_link,
    step_efficiency,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_config,
    sweep_depth,
    sweep_parser,
    sweep_summary_row,
    timed_blocking,
    timed_repetitions,
    timed_variants,
    write_csv,
)
from _hosts import agreed_max
from torch import nn

import torch_ext
import torch_ext.ops

WORLD_SIZE = 2

BATCH = 256
FEATURES = 16  # embedding lookups per sample
# One dense layer's backward is ~1 ms here (2 ms with the other rank computing beside it), 1/20-1/40 of the
# 2 MiB all_to_all's ~40 ms: fine steps for the sweep. With 1024 (17-35 ms a layer) the x0.5 point was one
# layer, and the calibrated depth of the one-point benchmark jumped between 1 and 3 layers between runs.
HIDDEN = 256
SPARSE_LAYERS = 3
MAX_DENSE_LAYERS = 240
# _set_sequence_nr boost, as PR #114120 suggests: above every sequence number a forward makes.
SEQUENCE_NR_BOOST = 2**62

COLLECTIVE_VARIANTS = ("stock", "stock+seq_nr", "torch_ext", "torch_ext(funcol)", "torch_ext(funcol lane)")
VARIANTS = (*COLLECTIVE_VARIANTS, "compute", "compute(torch_ext)", "comm")
# Left out of a quick run's timing: the sequence-number boost and the functional all_to_all on torch_ext's engine
# without its lane. Neither can hide the transfer (stock's order keeps the boosted node behind the sparse layers; the
# functional op waits inside its node), and each read stock's efficiency within 0.15 at every point of every run in
# docs/benchmarks.md and on an Intel Xeon; a full run times them.
QUICK_LEFT_OUT = ("stock+seq_nr", "torch_ext(funcol)")
# The variants that declare PyTorch's functional all_to_all to a lane (process-wide, so toggled per step).
FUNCOL_LANE_VARIANTS = ("torch_ext(funcol lane)",)
FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single


@dataclass(frozen=True)
class Config(SweepConfig):
    # The timeline_png, if any, draws stock's and torch_ext's backward.
    payload_mib: float

    @property
    def embedding_dim(self) -> int:
        # Half of every rank's lookup rows go to the other rank: rows * dim * 4 bytes / 2 = payload.
        rows = BATCH * FEATURES
        return max(8, round(self.payload_mib * 2**20 * 2 / 4 / rows))


class Model(nn.Module):
    def __init__(self, dim: int, dense_layers: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(BATCH * FEATURES, dim) * 0.1)
        # Cheap per-row layers between the all_to_all and the loss: several nodes, little compute.
        self.sparse_scale = nn.ParameterList(nn.Parameter(torch.ones(dim)) for _ in range(SPARSE_LAYERS))
        self.sparse_shift = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(SPARSE_LAYERS))
        self.dense = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(dense_layers))
        self.over = nn.Sequential(nn.Linear(dim + HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, lookups: torch.Tensor, dense_in: torch.Tensor, exchange) -> torch.Tensor:
        rows = F.embedding(lookups, self.table)
        exchanged = exchange(rows)
        sparse = exchanged
        for scale, shift in zip(self.sparse_scale, self.sparse_shift, strict=True):
            sparse = torch.relu(sparse * scale + shift)
        pooled = sparse.view(BATCH, FEATURES, -1).sum(1)
        dense = dense_in
        for layer in self.dense:
            dense = torch.relu(layer(dense))
        return self.over(torch.cat([pooled, dense], dim=1)).sum()


def _funcol_exchange(rows: torch.Tensor) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(rows, None, None, dist.group.WORLD)


def _boosted_funcol_exchange(rows: torch.Tensor) -> torch.Tensor:
    exchanged = _funcol_exchange(rows)
    # The result's grad_fn is _c10d_functional::_wrap_tensor_autograd, an identity in front of the
    # all_to_all's own node; boosting only the wrapper would leave the collective at its own number.
    exchanged.grad_fn._set_sequence_nr(SEQUENCE_NR_BOOST)
    exchanged.grad_fn.next_functions[0][0]._set_sequence_nr(SEQUENCE_NR_BOOST)
    return exchanged


def _torch_ext_exchange(rows: torch.Tensor) -> torch.Tensor:
    return torch_ext.ops.all_to_all_single(rows)


def _local_exchange(rows: torch.Tensor) -> torch.Tensor:
    return rows * 1.0


EXCHANGES = {
    "stock": (_funcol_exchange, False),
    "stock+seq_nr": (_boosted_funcol_exchange, False),
    "torch_ext": (_torch_ext_exchange, True),
    "torch_ext(funcol)": (_funcol_exchange, True),
    "torch_ext(funcol lane)": (_funcol_exchange, True),
    "compute": (_local_exchange, False),
    "compute(torch_ext)": (_local_exchange, True),
}


def _declare_funcol_lane(variant: str) -> None:
    """run_in_lane for PyTorch's functional all_to_all for the variants that ask for it, undone for the others."""
    if variant in FUNCOL_LANE_VARIANTS:
        torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    else:
        torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)


def _baseline(variant: str) -> str:
    """The compute variant whose backward, on the same engine, is ``variant``'s without communication."""
    return "compute(torch_ext)" if EXCHANGES[variant][1] else "compute"


def _backward(loss: torch.Tensor, on_torch_ext: bool) -> None:
    if on_torch_ext:
        torch_ext.backward(loss)
    else:
        loss.backward()


def _timed_backward(loss: torch.Tensor, on_torch_ext: bool) -> dict[str, float]:
    """Seconds of the backward call and blocked in it, the ranks started together."""
    dist.barrier()
    backward_s, blocked_s = timed_blocking(lambda: _backward(loss, on_torch_ext))
    return {"backward_s": backward_s, "blocked_s": blocked_s}


def _comm_only(dim: int) -> dict[str, float]:
    rows = torch.randn(BATCH * FEATURES, dim, requires_grad=True)
    exchanged = _funcol_exchange(rows)
    loss = (exchanged * 1.0).sum()
    return {"backward_s": _timed_backward(loss, on_torch_ext=False)["backward_s"]}


def _step(model: Model, inputs, variant: str, dim: int) -> dict[str, float]:
    if variant == "comm":
        return _comm_only(dim)
    exchange, on_torch_ext = EXCHANGES[variant]
    _declare_funcol_lane(variant)
    model.zero_grad(set_to_none=True)
    loss = model(*inputs, exchange)
    return _timed_backward(loss, on_torch_ext)


def _check_same_gradients(model: Model, inputs) -> None:
    """Every collective variant computes the same gradients, bit for bit."""
    reference = None
    for variant in COLLECTIVE_VARIANTS:
        exchange, on_torch_ext = EXCHANGES[variant]
        _declare_funcol_lane(variant)
        model.zero_grad(set_to_none=True)
        _backward(model(*inputs, exchange), on_torch_ext)
        grads = [p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference = grads
        elif not all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)):
            raise AssertionError(f"{variant} computed different gradients from stock")


def _run_rank(config: Config) -> dict:
    """One rank's part, in the process group: its times per sweep point and variant (the step takes as long as the
    slowest rank: _common.merge_ranks)."""
    rank = dist.get_rank()
    dim = config.embedding_dim
    torch.manual_seed(rank)
    probe, inputs = Model(dim, 0), (torch.randperm(BATCH * FEATURES), torch.randn(BATCH, HIDDEN))
    comm_s = calibrate_t_comm(lambda: _step(probe, inputs, "stock", dim))
    t_comm = statistics.median(comm_s)
    t_layer = agreed_max(dense_layer_backward_s(HIDDEN, BATCH, config.calibration_reps, CALIBRATION_S))
    # The timeline is of the point nearest ratio 1, where the two orders differ most.
    traced_ratio = min(config.ratios, key=lambda ratio: abs(ratio - 1.0))
    # What bit-stable accumulation holds back while the engine runs producers out of stock's order.
    torch_ext._C._held_gradient_stats(True)
    points, timelines = [], None
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        model = Model(dim, dense_layers)
        inputs = (torch.randperm(BATCH * FEATURES), torch.randn(BATCH, HIDDEN))
        _check_same_gradients(model, inputs)

        def measure(variant: str, _rep: int, model=model, inputs=inputs) -> dict[str, float]:
            return _step(model, inputs, variant, dim)

        samples = timed_repetitions(
            timed_variants(config, VARIANTS, QUICK_LEFT_OUT), measure, config.reps, config.warmup
        )
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples})
        if config.timeline_png is not None and ratio == traced_ratio and timelines is None:
            timelines = (_traced_timelines(model, inputs), dense_layers)
    held = torch_ext._C._held_gradient_stats(True)
    # Both ranks are past their last collective: a failure here must not leave the other waiting in one.
    dist.barrier()
    if rank == 0 and timelines is not None:
        try:
            _write_timelines(timelines[0], config.timeline_png, timelines[1], dim)
        except Exception as error:  # noqa: BLE001 - the picture is optional, the timings are not
            progress(f"overlap: warning: could not write the timeline {config.timeline_png}: {error!r}")
    return {
        "points": points,
        "dim": dim,
        "calibration": {"comm_s": comm_s, "dense_layer_s": t_layer},
        "held": held,
    }


# --- timelines ----------------------------------------------------------------------------------

# The profiler's name for one node run by the stock engine.
PROFILER_NODE_PREFIX = "autograd::engine::evaluate_function: "
# A process group's ops (c10d::alltoall_base_, c10d::allreduce_, ...): a node inside which one runs
# launched a collective.
PROFILER_COLLECTIVE_PREFIX = "c10d::"
# Where a functional collective blocks for its result (inside the collective's own backward node).
PROFILER_WAIT_OPS = ("_c10d_functional::wait_tensor",)
# Node._sequence_nr() of a node without one (AccumulateGrad) is UINT64_MAX; the trace format has -1.
FIRST_INVALID_SEQUENCE_NR = 2**63


def stock_backward_events(loss: torch.Tensor) -> list[dict]:
    """``loss.backward()`` on the stock engine, under torch.profiler, as a timeline in the event format
    of ``torch_ext.trace()``: one ``backward`` event for the call, one ``node`` event per node the
    engine ran (``collective`` when a process-group op ran inside it) and one ``collective_wait``
    per functional collective's wait, with ``wait_for`` the ``id`` of the collective node's event it
    waits in. Events are sorted by start (enclosing spans first) and ``id`` is the index in the list;
    ``sequence_nr`` is -1 for nodes without one (AccumulateGrad). Stock has no priorities:
    ``priority`` is 0, ``priority_from`` None.

    Times are on ``time.perf_counter_ns``'s clock, as torch_ext's: the profiler stamps events with
    wall-clock (Unix) time, so they are shifted by the two clocks' difference, read back to back.
    (Anchoring on a ``record_function`` mark instead was off by up to 0.8 ms: its start is stamped
    before the first call's dispatch overhead, measured here.)
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start_ns = time.perf_counter_ns()
        loss.backward()
        end_ns = time.perf_counter_ns()
    to_perf_counter = _perf_counter_minus_wall_clock_ns()
    events = profile.profiler.kineto_results.events()
    nodes = sorted((e for e in events if e.name().startswith(PROFILER_NODE_PREFIX)), key=lambda e: e.start_ns())

    def innermost_node(event):
        enclosing = [
            node
            for node in nodes
            if node.start_thread_id() == event.start_thread_id()
            and node.start_ns() <= event.start_ns()
            and event.end_ns() <= node.end_ns()
        ]
        return max(enclosing, key=lambda node: node.start_ns(), default=None)

    def sequence_nr(node) -> int:
        number = node.sequence_nr()
        return -1 if number < 0 or number >= FIRST_INVALID_SEQUENCE_NR else number

    launched_in = {id(innermost_node(e)) for e in events if e.name().startswith(PROFILER_COLLECTIVE_PREFIX)}
    backward_thread = nodes[0].start_thread_id() if nodes else None
    timeline = [_timeline_event("backward", "backward", -1, start_ns, end_ns, backward_thread, False)]
    event_of_node = {}
    for node in nodes:
        event = _timeline_event(
            "node",
            node.name().removeprefix(PROFILER_NODE_PREFIX),
            sequence_nr(node),
            node.start_ns() + to_perf_counter,
            node.end_ns() + to_perf_counter,
            node.start_thread_id(),
            id(node) in launched_in,
        )
        event_of_node[id(node)] = event
        timeline.append(event)
    # (wait event, the collective node's event it waits in, or None)
    waits = []
    for wait in (e for e in events if e.name() in PROFILER_WAIT_OPS):
        node = innermost_node(wait)
        event = _timeline_event(
            "collective_wait",
            wait.name(),
            -1 if node is None else sequence_nr(node),
            wait.start_ns() + to_perf_counter,
            wait.end_ns() + to_perf_counter,
            wait.start_thread_id(),
            True,
        )
        launch = event_of_node.get(id(node)) if node is not None else None
        waits.append((event, launch if launch is not None and launch["collective"] else None))
        timeline.append(event)
    # As torch_ext.trace() orders its events: by start, enclosing spans first among equal starts.
    timeline.sort(key=lambda event: (event["start_ns"], -event["end_ns"]))
    for index, event in enumerate(timeline):
        event["id"] = index
    for event, launch in waits:
        event["wait_for"] = None if launch is None else launch["id"]
    return timeline


def _perf_counter_minus_wall_clock_ns() -> int:
    before = time.perf_counter_ns()
    wall = time.time_ns()
    after = time.perf_counter_ns()
    return (before + after) // 2 - wall


def _timeline_event(kind, name, sequence_nr, start_ns, end_ns, thread, collective) -> dict:
    return {
        "id": None,  # the index in the sorted list, set by stock_backward_events
        "kind": kind,
        "name": name,
        "sequence_nr": sequence_nr,
        "priority": 0,
        "priority_from": None,
        "priority_origin": None,
        "start_ns": start_ns,
        "end_ns": end_ns,
        "thread": thread,
        "backward_id": 0,
        "collective": collective,
        "wait_for": None,
    }


TIMELINE_ROWS = (("stock PyTorch", "stock"), ("torch_ext", "torch_ext"))


def _traced_timelines(model: Model, inputs) -> list[tuple[str, list[dict]]]:
    """One traced backward of each of TIMELINE_ROWS' variants; every rank runs them (the collectives
    need both), each tracing its own."""
    rows = []
    for label, variant in TIMELINE_ROWS:
        exchange, on_torch_ext = EXCHANGES[variant]
        model.zero_grad(set_to_none=True)
        loss = model(*inputs, exchange)
        dist.barrier()
        if on_torch_ext:
            with torch_ext.trace() as trace:
                torch_ext.backward(loss)
            events = [dict(event) for event in trace.events]
        else:
            events = stock_backward_events(loss)
        rows.append((label, events))
    return rows


def _write_timelines(rows: list[tuple[str, list[dict]]], png_path: str, dense_layers: int, dim: int) -> None:
    from torch_ext.tracing import plot_timelines

    directory = os.path.dirname(png_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    json_path = os.path.splitext(png_path)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump([{"label": label, "events": events} for label, events in rows], f, indent=1)
    title = f"backward of the overlap scenario on rank 0 ({dim}d all_to_all, {dense_layers} dense layers)"
    plot_timelines(rows, png_path, title=title)
    print(f"wrote {png_path} and {json_path}")


# --- report -------------------------------------------------------------------------------------


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV from every rank's result; ``load``: the runnable tasks while the ranks
    ran, where known."""
    sha = git_sha()
    # The calibration is the same on every rank (agreed, or from every rank's times); the held gradients rank 0's.
    result = results[0]
    calibration = result["calibration"]
    print(
        f"\noverlap: {result['dim']}d x {BATCH * FEATURES} rows, {link}; calibration: T_comm "
        f"{statistics.median(calibration['comm_s']) * 1e3:.1f} ms, one dense layer "
        f"{calibration['dense_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<18} {'backward ms: median [p20-p80]':<30} {'/stock':>6} "
        f"{'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>5} {'- compute ms':>12}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (_common.calibrate_t_comm says why not the comm
    # variant).
    comm = summarize([t * 1e3 for t in calibration["comm_s"]])
    t_comm = comm.median / 1e3
    rows = [csv_row("comm", "overlap", f"{result['dim']}d x {BATCH * FEATURES} rows, {link}", "t_comm_ms", comm, sha)]
    for point in merge_ranks([r["points"] for r in results]):
        samples = point["samples"]
        stock = statistics.median(samples["stock"]["backward_s"])
        case = sweep_case("overlap", point["ratio"])
        size = f"{result['dim']}d x {BATCH * FEATURES} rows, {point['dense_layers']} dense layers, {link}"
        # The ratio the point had: stock's communication-free backward over T_comm. Its ideal is min(1, that).
        ratio = measured_ratio(samples["compute"]["backward_s"], t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in (v for v in VARIANTS if v in samples):
            times = samples[variant]["backward_s"]
            backward = summarize([t * 1e3 for t in times])
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            exposed_text = efficiency_text = by_step_text = ideal_text = over_text = ""
            if variant in COLLECTIVE_VARIANTS:
                exposed_ms, efficiency = exposure(samples[variant]["exposed_s"], t_comm)
                # The same repetition's compute-only backward on the same engine: what the step costs beyond it,
                # the communication's exposed part and the slowdown it causes (noisy: two backward times' gap).
                compute = samples[_baseline(variant)]["backward_s"]
                over_compute = summarize([(b - c) * 1e3 for b, c in zip(times, compute, strict=True)])
                by_step = step_efficiency(times, compute, t_comm)
                rows.append(csv_row(variant, case, size, "exposed_ms", exposed_ms, sha))
                rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
                rows.append(csv_row(variant, case, size, "step_efficiency", by_step, sha))
                rows.append(csv_row(variant, case, size, "over_compute_ms", over_compute, sha))
                exposed_text, efficiency_text = f"{exposed_ms.median:.1f}", f"{efficiency.median:.2f}"
                by_step_text, ideal_text = f"{by_step.median:.2f}", f"{ideal:.2f}"
                over_text = f"{over_compute.median:.1f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<18} {backward!s:<30} "
                f"{backward.median / 1e3 / stock:6.2f} {exposed_text:>10} {efficiency_text:>10} {by_step_text:>7} "
                f"{ideal_text:>5} {over_text:>12}"
            )
        print(
            f"{point['ratio']:5g} {point['dense_layers']:6d} measured ratio (compute-only backward / T_comm) {ratio:.2f}"
        )
    if load is not None:
        rows.append(csv_row("machine", "overlap", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print_t_comm(comm, len(calibration["comm_s"]))
    print_load(load)
    held = result.get("held")
    if held is not None:
        # Gradients that reached a buffer ahead of stock's order wait there for their turn (issue #12).
        print(
            f"bit-stable sums (rank 0, every torch_ext backward): {held['ordered_calls']} calls in stock's "
            f"delivery order, {held['held_gradients']} gradients held back, at most "
            f"{held['peak_held_bytes'] / 2**10:.1f} KiB at once"
        )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        __doc__,
        "overlap",
        quick_help="smaller payload, fewer repetitions and sweep points",
        timeline_help="draw one traced backward of stock and of torch_ext",
    )
    parser.add_argument("--payload-mib", type=float, help="MiB each rank sends the other (default 4; quick 2)")
    args = parse_sweep_args(parser, argv)
    config = Config(
        **dataclasses.asdict(sweep_config(args, "overlap", quick_reps=12, reps=20)),
        payload_mib=args.payload_mib or (2.0 if args.quick else 4.0),
    )
    announce = (
        f"overlap: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {config.payload_mib:g} MiB each way, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions of {len(VARIANTS)} variants"
    )
    return run_sweep(__file__, args, argv, lambda: _run_rank(config), report, announce)


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant with a collective. The headline is the overlap efficiency at the headline point
    (``_common.headline_point``), beside its ideal, and backward time against stock there."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "<dim>d x <rows> rows, <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, link = scenario_and_link(rows[("stock", points[0][1], "backward_ms")]["size"])
    t_comm = rows[("comm", "overlap", "t_comm_ms")]["median"]
    stock_note = f"; T_comm {t_comm:.3g} ms, {scenario}" + load_note(rows, "overlap")
    return [
        sweep_summary_row(
            "overlap",
            link,
            variant,
            rows,
            points,
            {"ratio": headline_over_stock(rows, variant, points, "backward_ms")},
            stock_note=stock_note,
        )
        for variant in COLLECTIVE_VARIANTS
        if (variant, points[0][1], "efficiency") in rows
    ]


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("Overlap of a backward all_to_all with a dense MLP on 2 gloo ranks")


if __name__ == "__main__":
    sys.exit(main())
