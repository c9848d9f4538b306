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
  compute            the same graph with the all_to_all replaced by a local copy (no communication),
                     stock engine: the compute of stock and stock+seq_nr
  compute(torch_ext) the same on torch_ext's engine: the compute of torch_ext and torch_ext(funcol)
                     (torch_ext's engine alone ran this graph's backward 2-7% faster than stock's)
  comm               the backward all_to_all alone, between the steps (reported; T_comm is stock's
                     wait with no dense layer: _common.slowest_rank_samples)

The all_to_all sends ``--payload-mib`` MiB to the other rank. The dense MLP's backward is swept over
multiples of T_comm (``--ratios``; quick 0.5,1,2, full 0.25,0.5,1,1.5,2): the script times the all_to_all
alone and one dense layer's backward (both ranks agree on the larger) and builds the depth that makes
the dense backward ``ratio`` x T_comm. At each point, per repetition, exposed communication = the time the
backward's thread was blocked (waiting for the all_to_all's bytes: ``_common.timed_blocking``), the slower
rank's, and overlap efficiency = 1 - exposed / T_comm (stock's wait with no dense layer): 1 when the
communication is completely hidden, 0 when it is fully exposed. Beside it, the backward's excess over its
engine's compute variant (``over_compute_ms``): what the communication costs the step in all, noisier.
Only the dense MLP can hide it (the embedding's backward needs its result), so the ideal is
min(1, ratio).

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

import argparse
import datetime
import importlib.util
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
    Summary,
    SummaryRow,
    csv_row,
    dense_layer_backward_s,
    git_sha,
    parse_ratios,
    plot_efficiency_curves,
    progress,
    runnable_tasks,
    slowest_rank_samples,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_depth,
    timed_blocking,
    write_csv,
)
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    agreed_max,
    leave_rank,
    run_on_two_hosts,
    write_rank_result,
)
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
# The dense backward as multiples of T_comm. Quick: three points, enough to see the curve bend.
RATIOS = (0.25, 0.5, 1.0, 1.5, 2.0)
QUICK_RATIOS = (0.5, 1.0, 2.0)
# T_comm: how long stock's backward waits for the all_to_all with no dense layer to hide it behind, the slower
# rank's (_common.slowest_rank_samples): the median of this many steps, after a few untimed ones (a process's first
# all_to_all is slower: 1.5x in moe_sync.py). ~2 s.
WARMUP_STEPS = 3
# Seconds of calls one dense layer's calibration takes at least (_common.dense_layer_backward_s).
CALIBRATION_S = 2.0
COMM_CALIBRATION_REPS = 15
# _set_sequence_nr boost, as PR #114120 suggests: above every sequence number a forward makes.
SEQUENCE_NR_BOOST = 2**62

VARIANTS = ("stock", "stock+seq_nr", "torch_ext", "torch_ext(funcol)", "compute", "compute(torch_ext)", "comm")
COLLECTIVE_VARIANTS = ("stock", "stock+seq_nr", "torch_ext", "torch_ext(funcol)")


@dataclass(frozen=True)
class Config:
    payload_mib: float
    ratios: tuple[float, ...]
    reps: int
    warmup: int
    calibration_reps: int
    # Where rank 0 draws the stock and torch_ext timelines (None: not traced).
    timeline_png: str | None = None

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
    "compute": (_local_exchange, False),
    "compute(torch_ext)": (_local_exchange, True),
}


def _baseline(variant: str) -> str:
    """The compute variant whose backward, on the same engine, is ``variant``'s without communication."""
    return "compute(torch_ext)" if EXCHANGES[variant][1] else "compute"


def _backward(loss: torch.Tensor, on_torch_ext: bool) -> None:
    if on_torch_ext:
        torch_ext.backward(loss)
    else:
        loss.backward()


def _timed_backward(loss: torch.Tensor, on_torch_ext: bool) -> tuple[float, float]:
    """(seconds, seconds blocked) of the backward call, the ranks started together."""
    dist.barrier()
    return timed_blocking(lambda: _backward(loss, on_torch_ext))


def _comm_only(dim: int) -> float:
    rows = torch.randn(BATCH * FEATURES, dim, requires_grad=True)
    exchanged = _funcol_exchange(rows)
    loss = (exchanged * 1.0).sum()
    return _timed_backward(loss, on_torch_ext=False)[0]


def _step(model: Model, inputs, variant: str, dim: int) -> tuple[float, float]:
    if variant == "comm":
        return _comm_only(dim), 0.0
    exchange, on_torch_ext = EXCHANGES[variant]
    model.zero_grad(set_to_none=True)
    loss = model(*inputs, exchange)
    return _timed_backward(loss, on_torch_ext)


def _check_same_gradients(model: Model, inputs) -> None:
    """Every collective variant computes the same gradients, bit for bit."""
    reference = None
    for variant in COLLECTIVE_VARIANTS:
        exchange, on_torch_ext = EXCHANGES[variant]
        model.zero_grad(set_to_none=True)
        _backward(model(*inputs, exchange), on_torch_ext)
        grads = [p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference = grads
        elif not all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True)):
            raise AssertionError(f"{variant} computed different gradients from stock")


def _time_point(model: Model, inputs, dim: int, config: Config) -> dict[str, dict[str, list[float]]]:
    """At one sweep point, ``config.reps`` repetitions after the warm-up: ``times``, each variant's backward seconds;
    ``blocked``, each collective variant's seconds blocked in them (its exposed communication)."""
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    blocked: dict[str, list[float]] = {variant: [] for variant in COLLECTIVE_VARIANTS}
    for rep in range(config.warmup + config.reps):
        # Alternate the variants within each repetition, rotating which goes first, so drift
        # in the machine's load spreads evenly over them.
        for variant in VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]:
            elapsed, waited = _step(model, inputs, variant, dim)
            if rep >= config.warmup:
                times[variant].append(elapsed)
                if variant in blocked:
                    blocked[variant].append(waited)
    return {"times": times, "blocked": blocked}


def _run_rank(config: Config) -> list[dict]:
    """One rank's part, started by torchrun (the process group from its environment): every rank's times per
    sweep point and variant, in rank order (the step takes as long as the slowest rank: ``slowest_rank``)."""
    torch.set_num_threads(1)  # two ranks may share two cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        dim = config.embedding_dim
        torch.manual_seed(rank)
        probe, inputs = Model(dim, 0), (torch.randperm(BATCH * FEATURES), torch.randn(BATCH, HIDDEN))
        for _ in range(WARMUP_STEPS):
            _step(probe, inputs, "stock", dim)
        comm_s = slowest_rank_samples(lambda: _step(probe, inputs, "stock", dim)[1], COMM_CALIBRATION_REPS)
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
            points.append({"ratio": ratio, "dense_layers": dense_layers, **_time_point(model, inputs, dim, config)})
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
        result = {
            "points": points,
            "dim": dim,
            "calibration": {"comm_s": comm_s, "dense_layer_s": t_layer},
            "held": held,
        }
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def slowest_rank(results: list[dict]) -> dict:
    """The ranks' results as one: each run takes as long as its slowest rank (the ranks run each together)."""
    first = results[0]
    points = []
    for index, point in enumerate(first["points"]):
        merged = {}
        for key in ("times", "blocked"):
            per_rank = [result["points"][index][key] for result in results]
            merged[key] = {
                name: [max(samples) for samples in zip(*(runs[name] for runs in per_rank), strict=True)]
                for name in per_rank[0]
            }
        points.append({**point, **merged})
    return {**first, "points": points}


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


def report(result: dict, link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    calibration = result["calibration"]
    print(
        f"\noverlap: {result['dim']}d x {BATCH * FEATURES} rows, {link}; calibration: T_comm "
        f"{statistics.median(calibration['comm_s']) * 1e3:.1f} ms, one dense layer "
        f"{calibration['dense_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<18} {'backward ms: median [p20-p80]':<30} {'/stock':>6} "
        f"{'exposed ms':>10} {'efficiency':>10} {'ideal':>5} {'- compute ms':>12}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (_common.slowest_rank_samples says why not the
    # comm variant).
    comm = summarize([t * 1e3 for t in calibration["comm_s"]])
    t_comm = comm.median / 1e3
    rows = [csv_row("comm", "overlap", f"{result['dim']}d x {BATCH * FEATURES} rows, {link}", "t_comm_ms", comm, sha)]
    for point in result["points"]:
        times = point["times"]
        stock = statistics.median(times["stock"])
        ideal = min(1.0, point["ratio"])
        case = sweep_case("overlap", point["ratio"])
        size = f"{result['dim']}d x {BATCH * FEATURES} rows, {point['dense_layers']} dense layers, {link}"
        for variant in VARIANTS:
            backward = summarize([t * 1e3 for t in times[variant]])
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            exposed_text = efficiency_text = ideal_text = over_text = ""
            if variant in COLLECTIVE_VARIANTS:
                exposed = point["blocked"][variant]
                exposed_ms = summarize([e * 1e3 for e in exposed])
                efficiency = summarize([1 - e / t_comm for e in exposed])
                # The same repetition's compute-only backward on the same engine: what the step costs beyond it,
                # the communication's exposed part and the slowdown it causes (noisy: two backward times' gap).
                compute = times[_baseline(variant)]
                over_compute = summarize([(b - c) * 1e3 for b, c in zip(times[variant], compute, strict=True)])
                rows.append(csv_row(variant, case, size, "exposed_ms", exposed_ms, sha))
                rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
                rows.append(csv_row(variant, case, size, "over_compute_ms", over_compute, sha))
                exposed_text, efficiency_text = f"{exposed_ms.median:.1f}", f"{efficiency.median:.2f}"
                ideal_text, over_text = f"{ideal:.2f}", f"{over_compute.median:.1f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<18} {backward!s:<30} "
                f"{backward.median / 1e3 / stock:6.2f} {exposed_text:>10} {efficiency_text:>10} {ideal_text:>5} "
                f"{over_text:>12}"
            )
    if load is not None:
        rows.append(csv_row("machine", "overlap", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print(
        f"T_comm {comm} ms (stock's wait with no dense layer, {len(calibration['comm_s'])} steps; "
        "efficiency = 1 - exposed / its median)"
    )
    if load is not None:
        print(f"runnable tasks while the ranks ran: {load} (the ranks make 2; more: other processes on the 2 cores)")
    held = result.get("held")
    if held is not None:
        # Gradients that reached a buffer ahead of stock's order wait there for their turn (issue #12).
        print(
            f"bit-stable sums (rank 0, every torch_ext backward): {held['ordered_calls']} calls in stock's "
            f"delivery order, {held['held_gradients']} gradients held back, at most "
            f"{held['peak_held_bytes'] / 2**10:.1f} KiB at once"
        )
    print(f"wrote {out}")


def _config(args: argparse.Namespace) -> Config:
    timeline_png = None
    if args.timeline is not None:
        if importlib.util.find_spec("matplotlib") is None:
            progress("overlap: --timeline skipped: matplotlib is not installed (pip install 'torch_ext[bench]')")
        else:
            timeline_png = os.path.abspath(args.timeline)
    return Config(
        payload_mib=args.payload_mib or (2.0 if args.quick else 4.0),
        ratios=args.ratios or (QUICK_RATIOS if args.quick else RATIOS),
        reps=args.reps or (12 if args.quick else 20),
        warmup=1 if args.quick else 2,
        # Calls of the calibration's stack of layers at least (_common.dense_layer_backward_s).
        calibration_reps=25 if args.quick else 31,
        timeline_png=timeline_png,
    )


def _rank_main(args: argparse.Namespace) -> None:
    """A rank, started by torchrun: by run_on_two_hosts (``--rank-results``), or by a user on two machines,
    where rank 0 reports."""
    results = _run_rank(_config(args))
    if args.rank_results is not None:
        write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
    elif os.environ["RANK"] == "0":
        report(slowest_rank(results), f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
    # An exception above still exits with its traceback and status 1.
    leave_rank()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller payload, fewer repetitions and sweep points")
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant at every sweep point")
    parser.add_argument("--ratios", type=parse_ratios, help="dense backward / T_comm to sweep, e.g. 0.5,1,2")
    parser.add_argument("--payload-mib", type=float, help="MiB each rank sends the other (default 4; quick 2)")
    parser.add_argument(
        "--network",
        choices=MODES,
        default=MODES[0],
        help="where the 2 ranks run (default two-hosts; what cannot be made falls back to the next)",
    )
    parser.add_argument("--out", default="results/overlap.csv", help="long-format CSV to write")
    parser.add_argument("--timeline", metavar="PNG", help="draw one traced backward of stock and of torch_ext")
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)  # set by the launcher on each rank
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    # Started by torchrun (it sets TORCHELASTIC_RUN_ID): one of the ranks.
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        _rank_main(args)

    config = _config(args)
    progress(
        f"overlap: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {config.payload_mib:g} MiB each way, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions of {len(VARIANTS)} variants"
    )
    forwarded = sys.argv[1:] if argv is None else list(argv)
    with runnable_tasks() as load:
        run = run_on_two_hosts(__file__, forwarded, mode=args.network)
    report(slowest_rank(run.results), run.network.label, args.out, load())
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant with a collective. The headline is the sweep's mean overlap efficiency, beside the
    ideal's mean; backward time against stock is the median over the sweep."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "<dim>d x <rows> rows, <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, _, link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")
    scenario = scenario.rpartition(", ")[0]
    ideal = statistics.mean(min(1.0, ratio) for ratio, _ in points)
    t_comm = rows[("comm", "overlap", "t_comm_ms")]["median"]
    summary = []
    for variant in (v for v in COLLECTIVE_VARIANTS if (v, points[0][1], "efficiency") in rows):
        efficiencies = [rows[(variant, case, "efficiency")]["median"] for _, case in points]
        exposed = [rows[(variant, case, "exposed_ms")]["median"] for _, case in points]
        backward_ratios = [
            rows[(variant, case, "backward_ms")]["median"] / rows[("stock", case, "backward_ms")]["median"]
            for _, case in points
        ]
        mean_efficiency = statistics.mean(efficiencies)
        values = {
            "efficiency": mean_efficiency,
            "ideal_efficiency": ideal,
            "exposed_ms": statistics.mean(exposed),
            "ratio": statistics.median(backward_ratios),
            # The curve, for the plot.
            **{f"efficiency x{ratio:g}": eff for (ratio, _), eff in zip(points, efficiencies, strict=True)},
        }
        per_point = ", ".join(f"x{ratio:g}: {eff:.2f}" for (ratio, _), eff in zip(points, efficiencies, strict=True))
        notes = f"efficiency by dense/comm ratio {per_point}; exposed {values['exposed_ms']:.1f} ms on average"
        if variant == "stock":
            notes += f"; T_comm {t_comm:.3g} ms, {scenario}"
            load = rows.get(("machine", "overlap", "runnable_tasks"))
            if load is not None:
                notes += f"; runnable tasks {load['median']:g} (the ranks: 2)"
        summary.append(
            SummaryRow(
                "overlap",
                link,
                variant,
                "stock",
                f"efficiency {mean_efficiency:.2f} (ideal {ideal:.2f})",
                f"{values['ratio']:.2f}",
                notes,
                values,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("Overlap of a backward all_to_all with a dense MLP on 2 gloo ranks")


if __name__ == "__main__":
    sys.exit(main())
