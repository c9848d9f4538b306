"""What torch_ext.trace() costs: torch_ext's backward wall time per node with tracing off and on.

Graphs (from engine_overhead.py, where they are described):

  chain  10,000 ops on one 4-element tensor: per-node cost, nearly all engine bookkeeping.
  mlp    32 x (Linear(64, 64) + tanh), batch 8: the same next to real kernels.

Variants, alternating in one process in this order in every repetition, after unrecorded warmup
repetitions:

  off      ``torch_ext.backward(loss)`` with no trace active.
  on       the same call inside ``with torch_ext.trace()``; only the backward call is timed.
  collect  the ``with`` block's exit: stopping the recorder and turning its events into the dicts
           of ``Trace.events`` (what a program pays once per trace, not per backward).

Both runs must give torch.equal leaf gradients before timing. Reported: median, 20th and 80th
percentile of us/node per variant, and on - off per node (of the medians) and its paired spread.

Tracing off must cost nothing: each call reads one atomic flag, and each node tests one pointer.
Wall time cannot resolve that, so the instruction counts of the engine with and without this code
are compared under callgrind, counting only inside ``BackwardCall::run`` (discovery and every node):

    valgrind --tool=callgrind --callgrind-out-file=OUT \\
        --toggle-collect='torch_ext::BackwardCall::run(torch::autograd::Node*)' \\
        python -m benchmarks.trace_overhead --callgrind-workload off

once with this checkout and once with a build of the commit before tracing (README, "Tracing").

    python -m benchmarks.trace_overhead [--quick] [--reps N] [--out results/trace_overhead.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

import torch

import torch_ext

from .graphs import MLP, Chain, count_nodes, fresh_graph
from .harness.report import SummaryRow, bar_chart
from .harness.results import csv_cases, csv_row, git_sha, print_columns, write_csv
from .harness.timing import Summary, summarize, timed_call

WARMUP_REPS = 3
QUICK_WARMUP_REPS = 1
# As engine_overhead: one intra-op thread, or OpenMP barriers on the shared 2-core machine drown
# the difference being measured.
DEFAULT_THREADS = 1
# The callgrind workload: three backward calls of a 3,000-node chain. Under callgrind the process
# runs ~50x slower; this keeps one run of it to a few minutes here, most of it importing torch.
CALLGRIND_CHAIN = 3_000
CALLGRIND_CALLS = 3

CASES = (Chain(reps=40, quick_reps=8), MLP(reps=600, quick_reps=120))
VARIANTS = ("off", "on", "collect")


def run_variant(variant_on: bool, build) -> tuple[int, int, list[torch.Tensor]]:
    """(backward ns, collect ns, leaf grads) of one call, traced or not."""
    graph = fresh_graph(build)
    if not variant_on:
        elapsed, _ = timed_call(torch_ext.backward, graph.root)
        return elapsed, 0, [leaf.grad for leaf in graph.leaves]
    context = torch_ext.trace()
    t = context.__enter__()
    try:
        elapsed, _ = timed_call(torch_ext.backward, graph.root)
    finally:
        collect, _ = timed_call(context.__exit__, None, None, None)
    assert len(t.events) > 1, "the traced call recorded nothing"
    return elapsed, collect, [leaf.grad for leaf in graph.leaves]


def check_same_gradients(name: str, build) -> None:
    _, _, off = run_variant(False, build)
    _, _, on = run_variant(True, build)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: leaf {i}: tracing changed the gradient")


def callgrind_workload(traced: bool) -> None:
    x = torch.linspace(0.5, 1.0, 4).requires_grad_()
    for _ in range(CALLGRIND_CALLS):
        y = x
        for i in range(CALLGRIND_CHAIN):
            y = y * 1.0001 if i % 3 == 0 else (y + 0.001 if i % 3 == 1 else y.sin())
        if traced:
            with torch_ext.trace():
                torch_ext.backward(y.sum())
        else:
            torch_ext.backward(y.sum())
    print(f"{CALLGRIND_CALLS} calls x {count_nodes(y.sum())} nodes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    parser.add_argument("--reps", type=int, help="timed repetitions per variant for every graph")
    parser.add_argument("--out", default="results/trace_overhead.csv", help="long-format CSV to write")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--callgrind-workload",
        choices=("off", "on"),
        help="run only the fixed workload counted under callgrind (see the module docstring)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.callgrind_workload is not None:
        callgrind_workload(args.callgrind_workload == "on")
        return 0
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    warmup = QUICK_WARMUP_REPS if args.quick else WARMUP_REPS

    sha = git_sha()
    print(f"torch {torch.__version__}, git {sha}, {torch.get_num_threads()} intra-op threads")
    started = time.perf_counter()
    rows = []
    table = []
    for case in CASES:
        reps = args.reps if args.reps is not None else (case.quick_reps if args.quick else case.reps)
        case = dataclasses.replace(case, reps=reps)
        print(f"{case.name}: {reps} repetitions of each variant", file=sys.stderr, flush=True)
        build = case.make_builder()
        check_same_gradients(case.name, build)
        nodes = count_nodes(fresh_graph(build).root)
        samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for rep in range(warmup + reps):
            off, _, _ = run_variant(False, build)
            on, collect, _ = run_variant(True, build)
            if rep >= warmup:
                samples["off"].append(off / 1e3 / nodes)
                samples["on"].append(on / 1e3 / nodes)
                samples["collect"].append(collect / 1e3 / nodes)
        per_node = {variant: summarize(values) for variant, values in samples.items()}
        added = summarize([on - off for off, on in zip(samples["off"], samples["on"], strict=True)])
        rows.append(csv_row("graph", case.name, case.size, "nodes", Summary(nodes, nodes, nodes), sha))
        for variant, summary in per_node.items():
            rows.append(csv_row(f"torch_ext/{variant}", case.name, case.size, "us_per_node", summary, sha))
        rows.append(csv_row("on-off", case.name, case.size, "us_per_node", added, sha))
        table.append((case, nodes, per_node, added))

    header = ("graph", "nodes", "reps", "off us/node", "on us/node", "on-off", "paired on-off", "collect us/node")
    lines = [header] + [
        (
            case.name,
            str(nodes),
            str(case.reps),
            str(per_node["off"]),
            str(per_node["on"]),
            f"{per_node['on'].median - per_node['off'].median:.3f}",
            f"{added.p20:.3f}-{added.p80:.3f}",
            str(per_node["collect"]),
        )
        for case, nodes, per_node, added in table
    ]
    print_columns(lines)
    print(
        "us/node: median [p20-p80]; on-off: of the medians; paired: p20-p80 of per-repetition differences; "
        "collect: the trace's exit (events to dicts), per node traced"
    )
    write_csv(args.out, rows)
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- python -m torch_ext bench: the summary table's rows and the plot, from the CSV ---------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    summary = []
    for case in csv_cases(rows, "us_per_node"):
        off = rows[("torch_ext/off", case, "us_per_node")]["median"]
        on = rows[("torch_ext/on", case, "us_per_node")]["median"]
        added = rows[("on-off", case, "us_per_node")]
        collect = rows[("torch_ext/collect", case, "us_per_node")]["median"]
        nodes = int(rows[("graph", case, "nodes")]["median"])
        summary.append(
            SummaryRow(
                "trace_overhead",
                case,
                "trace on",
                f"off {off:.3g} us/node",
                f"{on:.3g} us/node",
                f"{on / off:.2f}",
                f"{nodes} nodes; on-off {on - off:.3f} us/node (paired p20-p80 {added['p20']:.3f}-{added['p80']:.3f});"
                f" collecting the events {collect:.3g} us/node",
                {
                    "off_us_per_node": off,
                    "on_us_per_node": on,
                    "ratio": on / off,
                    "added_us_per_node": on - off,
                    "collect_us_per_node": collect,
                },
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    bar_chart(
        ax, [r.case for r in rows], {"on/off": [r.values["ratio"] for r in rows]}, "backward time per node / off", 1.0
    )
    ax.set_title("torch_ext.trace(): backward time per node, tracing on / off")


if __name__ == "__main__":
    sys.exit(main())
