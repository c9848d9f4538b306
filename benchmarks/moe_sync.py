"""A synchronous MoE all_to_all (Megatron-core's and DeepSpeed's ``_AllToAll``): priority alone, and the lane.

Megatron-core and DeepSpeed write their expert all_to_all as an autograd Function whose backward runs the
gradient's all_to_all synchronously, inside its node. On 2 ranks as 2 hosts on the shaped link
(``_hosts.run_on_two_hosts``), an expert-parallel layer (tokens dispatched to one expert per rank at a fixed
capacity, combined back) beside a dense path, for each library:

  compute    stock's backward of the same layer with the all_to_all replaced by the identity (no communication)
  stock      the backward on PyTorch's engine: dense path first, then the all_to_all
  torch_ext  torch_ext with the _AllToAll undeclared, as a new user gets it: stock's order on its engine
  priority   torch_ext with the _AllToAll registered as a launch (torch_ext.register_collective_backward): the
             all_to_all first, still blocking the engine
  lane       torch_ext with torch_ext.run_in_lane(_AllToAll): the all_to_all dispatched first to its group's
             lane, the dense path run beside it
  checked    the lane with the collective order check on (torch_ext.check_collective_order): its cost

T_comm is how long stock's backward waits for the all_to_all in the same layer with no dense path, the median of
15 steps (``_common.calibrate_t_comm`` says why not the all_to_all timed alone). The dense path's backward is
swept over multiples of T_comm (--ratios). At each point, per repetition, each rank's backward thread's blocked
time is measured (``_common.timed_blocking``: waiting for the all_to_all inside the node, or for the lane's
result where the expert's backward needs it); exposed communication = the slowest rank's backward minus the
longest time any rank spent unblocked in it (``_common.exposed_past_the_slowest_rank``: a rank's wait for the
other to arrive is not communication), and overlap efficiency = 1 - exposed / T_comm. Beside it, the backward's
excess over the communication-free ``compute`` variant (``over_compute_ms``): what the communication costs the
step in all, the gap of two noisy times, and from it the efficiency by step time, 1 - that / T_comm
(``step_efficiency``). Each point reports the ratio it measured, the ``compute`` variant's backward over T_comm, and
its ideal is min(1, that). A quick run times one library and leaves out ``torch_ext`` and ``priority``
(QUICK_LEFT_OUT). Reported per library and ratio: backward and step time (forward, backward and an SGD
step) as medians of the slower rank, and the efficiency. Before timing, one backward of each engine variant must
give torch.equal gradients to stock's.

    python benchmarks/moe_sync.py [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...] [--out CSV]
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
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
    run_sweep,
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

WORLD_SIZE = 2
# Tokens each rank sends each expert, and their width: 2048 x 256 floats = 2 MiB to the other rank.
CAPACITY = 2048
DIM = 256
# The dense path reads this many of the tokens: one of its layers' backward is then ~3.2 ms here, a tenth of
# T_comm (~36 ms), fine enough a step for the sweep (all 4096 rows made a layer ~19 ms, the points 0.5 apart).
DENSE_ROWS = 1024
MAX_DENSE_LAYERS = 64
ENGINE_VARIANTS = ("stock", "torch_ext", "priority", "lane", "checked")
TIMED_VARIANTS = ("compute", *ENGINE_VARIANTS)
# Left out of a quick run's timing (their bits are still checked): torch_ext's engine without the lane, and with
# priority alone. Neither can hide the transfer (the node waits inside its collective either way): both read -0.08
# to 0.03 at every point of an Intel Xeon's quick run, like stock, and they were a third of its 148 s. A full run
# times them.
QUICK_LEFT_OUT = ("torch_ext", "priority")
LIBRARIES = ("megatron", "deepspeed")
LIBRARY_NAMES = {"megatron": "Megatron-core", "deepspeed": "DeepSpeed"}


def installed_libraries() -> list[str]:
    found = []
    for library, module in (("megatron", "megatron.core"), ("deepspeed", "deepspeed.moe")):
        if importlib.util.find_spec(library) is not None and importlib.util.find_spec(module) is not None:
            found.append(library)
    return found


def library_all_to_all(library: str) -> tuple[Callable, type]:
    """``all_to_all(group, tokens)`` through the library's ``_AllToAll``, and that Function class."""
    if library == "megatron":
        from megatron.core.tensor_parallel.mappings import _AllToAll, all_to_all

        return all_to_all, _AllToAll
    import deepspeed.comm
    from deepspeed.moe.sharded_moe import _AllToAll

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return _AllToAll.apply, _AllToAll


def _identity(group, tokens: torch.Tensor) -> torch.Tensor:
    return tokens


class Layer(nn.Module):
    """The expert-parallel layer beside ``dense_layers`` Linear + ReLU layers (the layer _common's calibration
    times); with none, the all_to_all has nothing to hide behind (T_comm's calibration)."""

    def __init__(self, all_to_all: Callable, dense_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(dense_layers)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else _identity
        group = dist.group.WORLD
        returned = all_to_all(group, self.expert(all_to_all(group, tokens)))
        moe = self.head(returned * torch.sigmoid(self.gate(tokens))).sum()
        if not self.dense:
            return moe
        return moe + self.dense(tokens[:DENSE_ROWS]).sum()


@contextlib.contextmanager
def variant_engine(variant: str, function: type):
    """The engine and declaration of ``variant``; the _AllToAll is back to undeclared afterwards."""
    if variant in ("stock", "compute"):
        yield
        return
    if variant == "torch_ext":
        with torch_ext.enable():
            yield
        return
    if variant == "priority":
        torch_ext.register_collective_backward(launches=function)
    else:
        torch_ext.run_in_lane(function)
    checked = variant == "checked"
    if checked:
        # Its group's mirror is made at the first checked backward, in _check_bits, before anything is timed.
        torch_ext.check_collective_order()
    try:
        with torch_ext.enable():
            yield
    finally:
        torch_ext.unregister_collective_backward(function)
        if checked:
            torch_ext.check_collective_order(False)


def _step(model: Layer, optimizer, tokens: torch.Tensor, variant: str, function: type) -> dict[str, float]:
    """Seconds of a forward, backward and SGD step (``step_s``), of its backward (``backward_s``) and blocked in
    the backward (``blocked_s``), the ranks started together."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, communicate=variant != "compute")
    with variant_engine(variant, function):
        backward_s, blocked_s = timed_blocking(loss.backward)
    optimizer.step()
    return {"step_s": time.perf_counter() - start, "backward_s": backward_s, "blocked_s": blocked_s}


def _check_bits(model: Layer, tokens: torch.Tensor, function: type, rank: int, library: str) -> None:
    grads = {}
    for variant in ENGINE_VARIANTS:
        model.zero_grad(set_to_none=True)
        loss = model(tokens)
        with variant_engine(variant, function):
            loss.backward()
        grads[variant] = [p.grad.clone() for p in model.parameters()]
    for variant in ENGINE_VARIANTS[1:]:
        if not all(torch.equal(a, b) for a, b in zip(grads["stock"], grads[variant], strict=True)):
            raise AssertionError(f"rank {rank}, {library}: {variant}'s gradients differ from stock's")


def _run_library(library: str, config: SweepConfig, t_layer: float) -> dict:
    rank = dist.get_rank()
    all_to_all, function = library_all_to_all(library)
    torch.manual_seed(rank)
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    probe = Layer(all_to_all, 0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)
    comm_s = calibrate_t_comm(lambda: _step(probe, probe_optimizer, tokens, "stock", function))
    t_comm = statistics.median(comm_s)
    points = []
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        model = Layer(all_to_all, dense_layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        _check_bits(model, tokens, function, rank, library)

        def measure(variant: str, _rep: int, model=model, optimizer=optimizer) -> dict[str, float]:
            return _step(model, optimizer, tokens, variant, function)

        variants = timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT)
        samples = timed_repetitions(variants, measure, config.reps, config.warmup)
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples})
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points}


def _run_rank(libraries: Sequence[str], config: SweepConfig) -> dict:
    """One rank's part, in the process group: its times per library, sweep point and variant."""
    # Once, for every library, before any is imported.
    t_layer = agreed_max(dense_layer_backward_s(DIM, DENSE_ROWS, config.calibration_reps, CALIBRATION_S))
    return {library: _run_library(library, config, t_layer) for library in libraries}


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    for library in results[0]:
        first = results[0][library]
        # comm_s is already each step's, from both ranks' times (_calibrate_comm): the same on every rank.
        comm = summarize([t * 1e3 for t in first["comm_s"]])
        t_comm = comm.median / 1e3
        name = LIBRARY_NAMES[library]
        print(
            f"\nmoe_sync, {name}: {CAPACITY} tokens x {DIM}d per expert, {link}; T_comm {comm} ms (stock's wait with "
            f"no dense path, {len(first['comm_s'])} steps), one dense layer {first['t_layer'] * 1e3:.2f} ms"
        )
        print(
            f"{'ratio':>5} {'layers':>6} {'variant':<9} {'backward ms':>12} {'/stock':>7} {'step ms':>9} "
            f"{'/stock':>7} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>6} {'- compute ms':>12}"
        )
        rows.append(csv_row("comm", library, f"{CAPACITY} tokens x {DIM}d per expert, {link}", "t_comm_ms", comm, sha))
        for point in merge_ranks([r[library]["points"] for r in results]):
            samples = point["samples"]
            compute = samples["compute"]["backward_s"]
            case = sweep_case(library, point["ratio"])
            size = f"{CAPACITY} tokens x {DIM}d per expert, {point['dense_layers']} dense layers, {link}"
            stock_backward = statistics.median(samples["stock"]["backward_s"])
            stock_step = statistics.median(samples["stock"]["step_s"])
            # The ratio the point had: the communication-free backward over T_comm. Its ideal is min(1, that).
            ratio = measured_ratio(compute, t_comm)
            ideal = min(1.0, ratio)
            rows.append(measured_ratio_row(case, size, ratio, sha))
            for variant in (v for v in TIMED_VARIANTS if v in samples):
                backward = samples[variant]["backward_s"]
                backward_summary = summarize([t * 1e3 for t in backward])
                step_summary = summarize([t * 1e3 for t in samples[variant]["step_s"]])
                rows.append(csv_row(variant, case, size, "backward_ms", backward_summary, sha))
                rows.append(csv_row(variant, case, size, "step_ms", step_summary, sha))
                exposed_text = efficiency_text = by_step_text = over_text = ""
                if variant != "compute":
                    exposed_ms, efficiency = exposure(samples[variant]["exposed_s"], t_comm)
                    # The same repetition's communication-free backward: what the step costs beyond it.
                    over = summarize([(b - c) * 1e3 for b, c in zip(backward, compute, strict=True)])
                    by_step = step_efficiency(backward, compute, t_comm)
                    rows.append(csv_row(variant, case, size, "exposed_ms", exposed_ms, sha))
                    rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
                    rows.append(csv_row(variant, case, size, "step_efficiency", by_step, sha))
                    rows.append(csv_row(variant, case, size, "over_compute_ms", over, sha))
                    exposed_text, efficiency_text = f"{exposed_ms.median:.1f}", f"{efficiency.median:.2f}"
                    by_step_text, over_text = f"{by_step.median:.2f}", f"{over.median:.1f}"
                print(
                    f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<9} {backward_summary.median:12.1f} "
                    f"{backward_summary.median / 1e3 / stock_backward:7.2f} {step_summary.median:9.1f} "
                    f"{step_summary.median / 1e3 / stock_step:7.2f} {exposed_text:>10} {efficiency_text:>10} "
                    f"{by_step_text:>7} {ideal:6.2f} {over_text:>12}"
                )
            print(f"{point['ratio']:5g} measured ratio (compute-only backward / T_comm) {ratio:.2f}")
    if load is not None:
        rows.append(csv_row("machine", "moe_sync", link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, "moe_sync", quick_help="fewer repetitions and sweep points")
    args = parse_sweep_args(parser, argv)
    libraries = installed_libraries()
    if not libraries:
        print(
            "moe_sync: skipped: neither Megatron-core nor DeepSpeed is installed "
            "(pip install torch==2.13.0 megatron-core==0.16.1 deepspeed==0.19.8)"
        )
        return 0
    config = sweep_config(args, "moe_sync", quick_reps=8, reps=15)
    if config.quick:
        # One library in a quick run: both run their _AllToAll on the same lane, and their lanes read within 0.05 of
        # each other in every run of docs/benchmarks.md; a full run times both.
        libraries = libraries[:1]
    announce = (
        f"moe_sync: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {', '.join(libraries)}, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    return run_sweep(__file__, args, argv, lambda: _run_rank(libraries, config), report, announce)


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library and engine variant. The headline is the overlap efficiency at the headline point
    (``_common.headline_point``), beside its ideal, and backward and step time against stock there."""
    libraries = dict.fromkeys(case.rpartition(" x")[0] for _, case in sweep_cases(rows, "stock", "efficiency"))
    summary = []
    for library in libraries:
        points = [(r, case) for r, case in sweep_cases(rows, "stock", "efficiency") if case.startswith(library + " x")]
        link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")[2]
        t_comm = rows.get(("comm", library, "t_comm_ms"))
        stock_note = "" if t_comm is None else f"; T_comm {t_comm['median']:.3g} ms" + load_note(rows, "moe_sync")
        for variant in (v for v in ENGINE_VARIANTS if (v, points[0][1], "efficiency") in rows):
            step = headline_over_stock(rows, variant, points, "step_ms")
            summary.append(
                sweep_summary_row(
                    "moe_sync",
                    f"{LIBRARY_NAMES.get(library, library)}, {link}",
                    variant,
                    rows,
                    points,
                    {"step_ratio": step, "ratio": headline_over_stock(rows, variant, points, "backward_ms")},
                    lead=f"step / stock {step:.2f}; ",
                    exposed=False,
                    stock_note=stock_note,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases, strict=True):
        plot_efficiency_curves(ax, [r for r in rows if r.case == case], case)
    figure.suptitle("Synchronous MoE all_to_all: stock, priority alone, the collective lane")


if __name__ == "__main__":
    sys.exit(main())
