"""Backward and grad() wall time per autograd node: stock PyTorch's engine against torch_ext's.

Graphs (in the first two every node works on 4 elements, so what is measured is per-node cost:
the engine's bookkeeping plus each node's own dispatch and allocations, which perf put at 30-46% of
either engine's time; the MLP shows how much of the difference survives next to real kernels):

  chain  10,000 ops on one 4-element tensor, cycling ``x * 1.0001``, ``x + 0.001``, ``x.sin()``.
         Three node types rather than one: AddBackward0 saves nothing and launches no kernel (pure
         engine cost), MulBackward0 saves the scalar as a 0-dim tensor, SinBackward0 saves its input and launches two
         kernels, so the figure covers saved-variable unpacking and release as well. 4 elements
         rather than 0-dim so that no op takes a 0-dim-only path (0-dim tensors are special in type
         promotion); the ops cost the same either way (1.6-4.4 us each, measured here). The sin
         keeps values and gradients bounded.
  fanin  1,000 branches ``x * c_i`` from one 4-element leaf, stacked and summed: StackBackward0
         makes all 1,000 branches ready at once (a 1,000-deep ready queue), and all of them deliver
         into the leaf's AccumulateGrad (one node with 1,000 incoming edges, its input buffer
         summing 1,000 gradients). The c_i differ, so the summation order shows in the bits and
         the torch.equal check below also checks the execution order.
  mlp    32 x (Linear(64, 64) + tanh), batch 8, loss = output.sum().
  fixed_cost  ``(x * 2).sin().sum()`` on 4 elements: 4 nodes, so what is measured is the cost of one
         call (reported per call in bench's summary).

What each engine is asked to do, per graph:

  chain, fanin, mlp    ``backward(loss)``: every node runs.
  mlp_grad_x           ``grad(loss, x)`` with the MLP's input x requiring grad: the pruning case.
                       Only the nodes on a path to x run (no AccumulateGrad of a weight or bias, no
                       TBackward0), each AddmmBackward0 skips its weight and bias gradients
                       (task_should_compute_output), and x's AccumulateGrad only captures.
  mlp_double           ``grad(loss, weights and biases, create_graph=True)``, then ``backward`` of
                       the squared gradient norm (sum of ``g.pow(2).sum()``): the first call records
                       its backward pass, the second runs that double-backward graph, whose nodes
                       also reach back into the forward graph. The two calls are timed and summed;
                       building the norm between them (the same ops for both engines) is not timed.

Method: stock (``torch.autograd.backward`` / ``torch.autograd.grad``) and torch_ext
(``torch_ext.backward`` / ``torch_ext.grad``) alternate in one process, stock first in every
repetition, torch_ext twice: ``torch_ext`` with its plan cache on (every timed call replays the plan
of the structure the previous repetitions built, as a training loop's steps do) and
``torch_ext_first`` with it off (every call discovers and plans afresh, as a structure's first call
does), after warmup repetitions that are not recorded. The graph is rebuilt (forward,
untimed) before every timed call and leaf gradients are reset to None, so every timed call does the
same work; only the engine calls are timed (time.perf_counter_ns), with Python's cyclic GC disabled
during them and re-enabled between calls. The graph is freed after the timer stops. Before timing,
both engines must give torch.equal results on every graph (the leaves' .grad after backward, the
returned gradients of grad(), both for mlp_double), or the script fails. Nodes are counted once per
graph by walking grad_fn.next_functions (unique nodes, AccumulateGrad included): for backward, every
node reachable from the loss; for grad(), the nodes on a path from the loss to an input (those that
run or capture); for mlp_double, those of the grad() call plus every node reachable from the
squared norm. Reported per graph: median, 20th and 80th percentile of us/node for each engine, and
the torch_ext/stock ratio (of the medians in the table; of each stock/torch_ext pair in the CSV's
``torch_ext/stock`` rows, whose spread shows how much the noise cancels between neighbours).

    python -m benchmarks.engine_overhead [--quick] [--reps N] [--out results/engine_overhead.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch

import torch_ext

from .graphs import DOUBLE_BACKWARD, GRAD, MLP, CallResult, Case, Chain, EngineApi, FanIn, FixedCost, Graph, fresh_graph
from .harness.report import SummaryRow, bar_chart
from .harness.results import csv_cases, csv_row, git_sha, print_columns, progress, write_csv
from .harness.timing import Summary, summarize

# Every repetition rebuilds a graph of the same structure, as a training step does: with the plan cache
# on, torch_ext's timed calls replay the plan (from the third call on, all inside the warmup); with it
# off, every call plans afresh, as the first call of a structure does.
ENGINES: tuple[EngineApi, ...] = (
    EngineApi("stock", torch.autograd.backward, torch.autograd.grad),
    EngineApi("torch_ext", torch_ext.backward, torch_ext.grad, plan_cache=True),
    EngineApi("torch_ext_first", torch_ext.backward, torch_ext.grad, plan_cache=False),
)
TORCH_EXT_ENGINES = tuple(engine.name for engine in ENGINES if engine.plan_cache is not None)


def use_engine(engine: EngineApi) -> None:
    """Sets what the engine's calls need, outside the timed region."""
    if engine.plan_cache is not None:
        torch_ext._C._set_plan_cache(engine.plan_cache)


# Unrecorded repetitions (of each engine) before timing: the first backward on a new graph shape
# pays for allocator growth and cold caches.
WARMUP_REPS = 3
QUICK_WARMUP_REPS = 1
# Both engines run every CPU node on the calling thread, so intra-op threads only change the
# kernels. With 2 threads on the shared 2-core machine (other jobs running), OpenMP barriers in the
# 64-wide matmuls stalled: mlp forward 355 ms instead of 1 ms, backward median 6.9 ms instead of
# 1.3 ms, for either engine, drowning the engine difference.
DEFAULT_THREADS = 1

CASES: tuple[Case, ...] = (
    FixedCost(),
    Chain(),
    FanIn(),
    MLP(),
    MLP(name="mlp_grad_x", call=GRAD, reps=1_000, quick_reps=200),
    MLP(name="mlp_double", call=DOUBLE_BACKWARD, reps=300, quick_reps=60),
)


class GradientMismatch(AssertionError):
    pass


def run_call(case: Case, engine: EngineApi, graph: Graph) -> CallResult:
    use_engine(engine)
    return case.call.run(engine, graph)


def check_same_gradients(case: Case, build: Callable[[], Graph]) -> None:
    # Three calls of each engine: the third replays a plan where the cache is on.
    for _ in range(3):
        results = {engine.name: run_call(case, engine, fresh_graph(build)).tensors for engine in ENGINES}
        for name in TORCH_EXT_ENGINES:
            for i, (stock, ext) in enumerate(zip(results["stock"], results[name], strict=True)):
                if stock is None or ext is None:
                    raise GradientMismatch(f"{case.name}: result {i} is missing (stock: {stock}, {name}: {ext})")
                if not torch.equal(stock, ext):
                    diff = (stock - ext).abs().max().item()
                    raise GradientMismatch(f"{case.name}: result {i}: {name}'s differs from stock's (max {diff:g})")


def time_alternating(case: Case, build: Callable[[], Graph], warmup: int) -> dict[str, list[int]]:
    samples: dict[str, list[int]] = {engine.name: [] for engine in ENGINES}
    for rep in range(warmup + case.reps):
        for engine in ENGINES:
            graph = fresh_graph(build)
            elapsed = run_call(case, engine, graph).elapsed_ns
            # Freed here, outside the timed call, before the next graph is built.
            del graph
            if rep >= warmup:
                samples[engine.name].append(elapsed)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run, ~10 s)")
    parser.add_argument("--reps", type=int, help="timed repetitions per engine for every graph")
    parser.add_argument("--out", default="results/engine_overhead.csv", help="long-format CSV to write")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    warmup = QUICK_WARMUP_REPS if args.quick else WARMUP_REPS
    torch.set_num_threads(args.threads)

    sha = git_sha()
    print(
        f"torch {torch.__version__}, git {sha}, {torch.get_num_threads()} intra-op threads; "
        "GC disabled during each timed call"
    )
    started = time.perf_counter()
    rows = []
    table = []
    for case in CASES:
        reps = args.reps if args.reps is not None else (case.quick_reps if args.quick else case.reps)
        case = dataclasses.replace(case, reps=reps)
        progress(f"{case.name}: {case.reps} repetitions of each engine")
        build = case.make_builder()
        check_same_gradients(case, build)
        nodes = case.call.count_nodes(fresh_graph(build))
        samples = time_alternating(case, build, warmup)

        rows.append(csv_row("graph", case.name, case.size, "nodes", Summary(nodes, nodes, nodes), sha))
        per_node: dict[str, Summary] = {}
        for name, times_ns in samples.items():
            rows.append(
                csv_row(name, case.name, case.size, case.call.metric, summarize([t / 1e3 for t in times_ns]), sha)
            )
            per_node[name] = summarize([t / 1e3 / nodes for t in times_ns])
            rows.append(csv_row(name, case.name, case.size, "us_per_node", per_node[name], sha))
        ratios = {}
        for name in TORCH_EXT_ENGINES:
            paired = summarize([ext / stock for stock, ext in zip(samples["stock"], samples[name])])
            rows.append(csv_row(f"{name}/stock", case.name, case.size, "ratio", paired, sha))
            ratios[name] = (per_node[name].median / per_node["stock"].median, paired)
        table.append((case, nodes, per_node, ratios))

    header = (
        "graph",
        "size",
        "call",
        "nodes",
        "reps",
        "stock us/node",
        "torch_ext us/node",
        "ratio",
        "paired ratio",
        "first call ratio",
    )
    lines = [header] + [
        (
            case.name,
            case.size,
            case.call.label,
            str(nodes),
            str(case.reps),
            str(per_node["stock"]),
            str(per_node["torch_ext"]),
            f"{ratios['torch_ext'][0]:.3f}",
            f"{ratios['torch_ext'][1].p20:.3f}-{ratios['torch_ext'][1].p80:.3f}",
            f"{ratios['torch_ext_first'][0]:.3f}",
        )
        for case, nodes, per_node, ratios in table
    ]
    print_columns(lines)
    print(
        "us/node: median [p20-p80]; ratio: torch_ext/stock of the medians, plan replayed (a training loop's "
        "steps); paired ratio: p20-p80 of the per-repetition ratios; first call ratio: plan cache off, every "
        "call plans afresh (a structure's first call)"
    )

    write_csv(args.out, rows)
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    summary = []
    for case in csv_cases(rows, "us_per_node"):
        stock = rows[("stock", case, "us_per_node")]["median"]
        ext = rows[("torch_ext", case, "us_per_node")]["median"]
        paired = rows[("torch_ext/stock", case, "ratio")]
        nodes = int(rows[("graph", case, "nodes")]["median"])
        first = rows.get(("torch_ext_first", case, "us_per_node"))
        first_note = "" if first is None else f"; first call {first['median'] / stock:.2f}"
        # The fixed-cost case is about one call, not its nodes.
        unit, scale = ("us/call", nodes) if case == "fixed_cost" else ("us/node", 1)
        summary.append(
            SummaryRow(
                "engine_overhead",
                case,
                "torch_ext",
                f"stock {stock * scale:.3g} {unit}",
                f"{ext * scale:.3g} {unit}",
                f"{ext / stock:.2f}",
                f"{nodes} nodes; paired ratio p20-p80 {paired['p20']:.2f}-{paired['p80']:.2f}{first_note}",
                {
                    "stock_us_per_node": stock,
                    "torch_ext_us_per_node": ext,
                    "ratio": ext / stock,
                    "paired_ratio_p20": paired["p20"],
                    "paired_ratio_p80": paired["p80"],
                    **({} if first is None else {"first_call_ratio": first["median"] / stock}),
                },
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    bar_chart(
        ax, [r.case for r in rows], {"torch_ext/stock": [r.values["ratio"] for r in rows]}, "time per node / stock", 1.0
    )
    ax.set_title("Engine overhead: backward time per node, torch_ext / stock")


if __name__ == "__main__":
    sys.exit(main())
