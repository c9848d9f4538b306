"""Peak tensor memory of one backward call: stock PyTorch's engine against torch_ext's.

torch_ext's engine releases a gradient as soon as its last reader has run; this measures whether its
peak is any higher than stock's. Graphs (tests/test_backward_memory.py takes them, and ``measure``, from here
and asserts the same):

  deep_mlp                  8 x (Linear(512, 512) + GELU), batch 64, input requiring grad,
                            ``backward(output.sum())``.
  deep_mlp_grad_of_input    the same graph, ``grad(output.sum(), x)``: only the input's path runs.
  fan_in                    64 branches ``x * c_i`` of one 4096-element leaf, stacked and summed: the
                            leaf's input buffer sums 64 gradients.
  elementwise_chain         50 ops (``* 1.0001``, ``+ 0.001``, ``sin`` in turn) on 2^20 elements.
  reused_intermediate       ``h = x.sin()`` (2^20 elements) read by ``(h * 2).exp()``, ``h.cos()`` and
                            ``h.tanh()``, summed: h's input buffer sums 3 gradients.
  *_priority_*              the graph before it, torch_ext given ``priorities={t: 10}`` for the named
                            intermediate ``t`` (stock has no such argument and runs its own order):
                            tanh reorders at no cost; exp runs ExpBackward0 before TanhBackward0 and
                            CosBackward0, whose 4 MiB output then waits for its reader; branch 0 of the
                            fan-in is added last by stock, so bit-stable accumulation holds its
                            gradient until the other 63 are in.

Method (torch_ext/memory.py): the CPU allocator's running total of live bytes, reported to the memory
profiler at every allocation and free from every thread; the graph is built under the tracker so the
forward's saved tensors that backward frees are counted; a call's peak is the most bytes above the
level at its start. The profiler turns on RecordFunction callbacks for both engines alike.

Each graph is built afresh from the same seed for every call. Per graph: one unmeasured call of each
engine (what a kernel sets up on its first use in the process stays out of the comparison; a first call
whose bits differ from stock's later ones is printed); stock ``--runs`` times; torch_ext ``--runs`` times
with its plan cache off (every call discovers its plan, as a structure's first call does); then torch_ext
with the cache cleared and on, three times, the third replaying the plan the first two made (checked from
``_plan_cache_stats``). Stock's measured calls must agree with each other, and every torch_ext call with
them (torch_ext.testing.identity_difference), or the script fails. ``repeats`` says whether stock's runs
and torch_ext's first-call runs each gave one figure. torch_ext's first call in a process allocates a 4-byte
tensor it keeps for good (its driver node's input, csrc/engine/host/host_task.cpp); one unmeasured call of each
engine comes first.

The long-format CSV has, per graph, metric ``peak_bytes`` for ``stock``, ``torch_ext`` (first calls) and
``torch_ext_replayed``: median, 20th and 80th percentile over the runs (all three equal when the runs repeat).

    python -m benchmarks.backward_memory [--quick] [--runs N] [--out results/backward_memory.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

import torch_ext
from torch_ext import _C
from torch_ext.memory import PeakMemory
from torch_ext.testing import identity_difference

from .harness.report import SummaryRow, bar_chart
from .harness.results import csv_cases, csv_row, git_sha, write_csv
from .harness.timing import Summary, summarize

# A structure's plan is kept from its second call on: the third call is the first replay.
FIRST_REPLAY = 3
# Any positive priority reorders; 10 as in the example.
PRIORITY = 10
MIB = 2**20
# Calls of each engine per graph. The peaks are allocator byte counts, the same in every run so far: two runs
# still show whether they repeat. The whole script takes ~5 s here either way, most of it starting torch.
RUNS = 3
QUICK_RUNS = 2

MLP_DEPTH = 8
MLP_WIDTH = 512
MLP_BATCH = 64
FAN_IN_BRANCHES = 64
FAN_IN_NUMEL = 4096
CHAIN_NUMEL = 1 << 20
CHAIN_OPS = 50
REUSED_NUMEL = 1 << 20


@dataclasses.dataclass
class Graph:
    loss: torch.Tensor
    # Whose .grad backward() fills: the gradients compared.
    leaves: list[torch.Tensor]
    # grad(loss, grad_inputs) instead of backward(loss) when set.
    grad_inputs: list[torch.Tensor] | None = None
    # torch_ext's call is given priorities={priority_target: PRIORITY}; stock has no such argument.
    priority_target: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    backward: Callable
    grad: Callable
    takes_priorities: bool


STOCK = Engine("stock", torch.autograd.backward, torch.autograd.grad, takes_priorities=False)
TORCH_EXT = Engine("torch_ext", torch_ext.backward, torch_ext.grad, takes_priorities=True)


def deep_mlp() -> Graph:
    blocks = [(nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.GELU()) for _ in range(MLP_DEPTH)]
    model = nn.Sequential(*[module for block in blocks for module in block])
    x = torch.randn(MLP_BATCH, MLP_WIDTH, requires_grad=True)
    return Graph(model(x).sum(), leaves=[*model.parameters(), x])


def deep_mlp_grad_of_input() -> Graph:
    graph = deep_mlp()
    graph.grad_inputs = [graph.leaves[-1]]
    return graph


def fan_in(prioritized_branch: int | None = None) -> Graph:
    """One leaf, many branches: the leaf's input buffer sums FAN_IN_BRANCHES gradients."""
    x = torch.randn(FAN_IN_NUMEL, requires_grad=True)
    # Distinct factors: the sum's bits depend on the order the branches are added in.
    factors = torch.randn(FAN_IN_BRANCHES)
    branches = [x * factors[i] for i in range(FAN_IN_BRANCHES)]
    target = None if prioritized_branch is None else branches[prioritized_branch]
    return Graph(torch.stack(branches).sum(), leaves=[x], priority_target=target)


def elementwise_chain() -> Graph:
    """mul/add/sin in turn: add saves nothing, mul a scalar, sin its input (freed when its node runs)."""
    x = torch.randn(CHAIN_NUMEL, requires_grad=True)
    h = x
    for i in range(CHAIN_OPS):
        h = (h * 1.0001) if i % 3 == 0 else (h + 0.001) if i % 3 == 1 else h.sin()
    return Graph(h.sum(), leaves=[x])


def reused_intermediate(prioritized: str | None = None) -> Graph:
    """``h`` feeds three ops: its input buffer sums three gradients before SinBackward0 reads it."""
    x = torch.randn(REUSED_NUMEL, requires_grad=True)
    h = x.sin()
    readers = {"exp": (h * 2).exp(), "cos": h.cos(), "tanh": h.tanh()}
    loss = (readers["exp"] + readers["cos"] + readers["tanh"]).sum()
    target = None if prioritized is None else readers[prioritized]
    return Graph(loss, leaves=[x], priority_target=target)


@dataclasses.dataclass(frozen=True)
class Case:
    # The CSV's size column: the graph in a few words (the module docstring has the rest).
    size: str
    build: Callable[[], Graph]


GRAPHS: dict[str, Case] = {
    "deep_mlp": Case("8x Linear(512, 512)+GELU, batch 64", deep_mlp),
    "deep_mlp_grad_of_input": Case("8x Linear(512, 512)+GELU, batch 64, grad of x", deep_mlp_grad_of_input),
    "fan_in": Case("64 branches of 4096 elements", fan_in),
    "elementwise_chain": Case("50 ops on 2^20 elements", elementwise_chain),
    "reused_intermediate": Case("3 readers of 2^20 elements", reused_intermediate),
    # Reorders (TanhBackward0 runs before the inner AddBackward0) at no cost in memory.
    "reused_intermediate_priority_tanh": Case(
        "3 readers of 2^20 elements, tanh prioritized", lambda: reused_intermediate("tanh")
    ),
    "reused_intermediate_priority_exp": Case(
        "3 readers of 2^20 elements, exp prioritized", lambda: reused_intermediate("exp")
    ),
    "fan_in_priority_branch_0": Case(
        "64 branches of 4096 elements, branch 0 prioritized", lambda: fan_in(prioritized_branch=0)
    ),
}


def run_engine(engine: Engine, graph: Graph) -> list[torch.Tensor]:
    kwargs = {}
    if engine.takes_priorities and graph.priority_target is not None:
        kwargs["priorities"] = {graph.priority_target: PRIORITY}
    if graph.grad_inputs is not None:
        return list(engine.grad(graph.loss, graph.grad_inputs, **kwargs))
    engine.backward(graph.loss, **kwargs)
    return [leaf.grad for leaf in graph.leaves]


@dataclasses.dataclass(frozen=True)
class Measured:
    peak_bytes: int
    gradients: list[torch.Tensor]


def measure(build: Callable[[], Graph], engine: Engine) -> Measured:
    """Builds a graph (seeded) and runs one engine call on it, both under the memory tracker."""
    with PeakMemory() as memory:
        torch.manual_seed(0)
        graph = build()
        with memory.region():
            gradients = run_engine(engine, graph)
    return Measured(memory.peak_bytes, gradients)


@dataclasses.dataclass(frozen=True)
class Row:
    graph: str
    # Peak bytes of each run.
    stock_peaks: tuple[int, ...]
    first_call_peaks: tuple[int, ...]
    replayed: int

    @property
    def stock(self) -> int:
        return max(self.stock_peaks)

    @property
    def first_call(self) -> int:
        return max(self.first_call_peaks)

    @property
    def repeats(self) -> bool:
        return len(set(self.stock_peaks)) == 1 and len(set(self.first_call_peaks)) == 1


def first_use_note(name: str, first: Measured, later: Measured) -> str | None:
    """A note when stock's unmeasured first call of a graph gave other bits than its measured calls."""
    difference = identity_difference(first.gradients, later.gradients)
    if difference is None:
        return None
    return (
        f"{name}: stock's first call gave other gradients than its later ones (gradients{difference}); a first-use"
        " effect below both engines, left out of the comparison"
    )


def measure_graph(name: str, build: Callable[[], Graph], runs: int) -> Row:
    # One unmeasured call of each engine first, so that what a kernel initializes on its first use lies outside the
    # compared calls. Stock's first call of elementwise_chain once gave other bits than its later calls: every
    # element of the second OpenMP thread's half off by ~5e-4 relative (CI, 2026-11-28; the first sin and cos of the
    # process, which ATen takes from MKL's VML, on two threads at once). Stock's measured calls must then agree.
    stock_first = measure(build, STOCK)
    measure(build, TORCH_EXT)
    stock_runs = [measure(build, STOCK) for _ in range(runs)]
    note = first_use_note(name, stock_first, stock_runs[0])
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    for later in stock_runs[1:]:
        difference = identity_difference(later.gradients, stock_runs[0].gradients)
        if difference is not None:
            raise SystemExit(f"{name}: stock's own gradients differ between its calls: gradients{difference}")
    _C._set_plan_cache(False)
    first_calls = [measure(build, TORCH_EXT) for _ in range(runs)]
    _C._set_plan_cache(True)
    _C._clear_plan_cache()
    replays = []
    for call in range(1, FIRST_REPLAY + 1):
        hits = _C._plan_cache_stats(False)["hits"]
        replays.append(measure(build, TORCH_EXT))
        if (_C._plan_cache_stats(False)["hits"] > hits) != (call == FIRST_REPLAY):
            raise SystemExit(f"{name}: call {call} did not replay as expected ({_C._plan_cache_stats(False)})")
    for ours in first_calls + replays:
        difference = identity_difference(ours.gradients, stock_runs[0].gradients)
        if difference is not None:
            raise SystemExit(f"{name}: torch_ext's gradients differ from stock's: gradients{difference}")
    return Row(
        name,
        stock_peaks=tuple(run.peak_bytes for run in stock_runs),
        first_call_peaks=tuple(run.peak_bytes for run in first_calls),
        replayed=replays[-1].peak_bytes,
    )


def peak_summary(peaks: Sequence[int]) -> Summary:
    return summarize(peaks) if len(peaks) >= 2 else Summary(peaks[0], peaks[0], peaks[0])


def csv_rows(rows: list[Row], sha: str) -> list[dict[str, object]]:
    out = []
    for row in rows:
        size = GRAPHS[row.graph].size
        for what, peaks in (
            ("stock", row.stock_peaks),
            ("torch_ext", row.first_call_peaks),
            ("torch_ext_replayed", (row.replayed,)),
        ):
            out.append(csv_row(what, row.graph, size, "peak_bytes", peak_summary(peaks), sha))
    return out


def print_table(rows: list[Row]) -> None:
    header = (
        "graph",
        "stock MiB",
        "torch_ext MiB",
        "ratio",
        "replayed MiB",
        "ratio",
        "stock B",
        "torch_ext B",
        "replayed B",
        "repeats",
    )
    lines = [
        (
            row.graph,
            f"{row.stock / MIB:.3f}",
            f"{row.first_call / MIB:.3f}",
            f"{row.first_call / row.stock:.3f}",
            f"{row.replayed / MIB:.3f}",
            f"{row.replayed / row.stock:.3f}",
            f"{row.stock:,}",
            f"{row.first_call:,}",
            f"{row.replayed:,}",
            "yes" if row.repeats else "NO",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    for line in [header, *lines]:
        print(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(line, widths))
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} calls of each engine per graph (CI)")
    parser.add_argument("--runs", type=int, help=f"calls of each engine per graph (default {RUNS})")
    parser.add_argument("--out", default="results/backward_memory.csv", help="long-format CSV to write")
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    runs = args.runs if args.runs is not None else (QUICK_RUNS if args.quick else RUNS)
    started = time.perf_counter()
    for engine in (STOCK, TORCH_EXT):
        x = torch.ones(2, requires_grad=True)
        engine.backward((x * 2).sum())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, peak bytes above call start")
    print("torch_ext: first call (plan discovered); replayed: third call of the structure (plan cache)")
    previous = _C._set_plan_cache(True)
    try:
        rows = []
        for name, case in GRAPHS.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            rows.append(measure_graph(name, case.build, runs))
    finally:
        _C._set_plan_cache(previous)
    print_table(rows)
    write_csv(args.out, csv_rows(rows, git_sha()))
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- python -m torch_ext bench: the summary table's rows and the plot, from the CSV ---------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    summary = []
    for case in csv_cases(rows, "peak_bytes"):
        stock = rows[("stock", case, "peak_bytes")]
        first = rows[("torch_ext", case, "peak_bytes")]
        replayed = rows[("torch_ext_replayed", case, "peak_bytes")]["median"]
        repeats = stock["p20"] == stock["p80"] and first["p20"] == first["p80"]
        summary.append(
            SummaryRow(
                "backward_memory",
                case,
                "torch_ext",
                f"stock {stock['median'] / MIB:.3g} MiB",
                f"{first['median'] / MIB:.3g} MiB",
                f"{first['median'] / stock['median']:.2f}",
                f"peak above the call's start; replayed plan {replayed / stock['median']:.2f}"
                + ("" if repeats else "; peaks differ between runs"),
                {
                    "stock_peak_bytes": stock["median"],
                    "torch_ext_peak_bytes": first["median"],
                    "replayed_peak_bytes": replayed,
                    "ratio": first["median"] / stock["median"],
                    "replayed_ratio": replayed / stock["median"],
                },
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    bar_chart(
        ax,
        [r.case for r in rows],
        {"first call": [r.values["ratio"] for r in rows], "replayed": [r.values["replayed_ratio"] for r in rows]},
        "peak memory / stock",
        1.0,
    )
    ax.set_title("Backward peak memory, torch_ext / stock")


if __name__ == "__main__":
    sys.exit(main())
