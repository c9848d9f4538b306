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

    python benchmarks/engine_overhead.py [--quick] [--reps N] [--out results/engine_overhead.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from _common import (
    Summary,
    SummaryRow,
    bar_chart,
    csv_cases,
    csv_row,
    git_sha,
    print_columns,
    progress,
    summarize,
    timed_call,
    write_csv,
)
from torch.autograd.graph import get_gradient_edge

import torch_ext


@dataclass(frozen=True)
class EngineApi:
    name: str
    backward: Callable
    grad: Callable
    # torch_ext's plan cache (csrc/engine/plan/plan_cache.h) on or off for this engine's calls; None for stock.
    plan_cache: bool | None = None


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


@dataclass
class Graph:
    # Tensors whose .grad is reset before every call (and compared after backward()).
    leaves: list[torch.Tensor]
    root: torch.Tensor
    # What grad() differentiates with respect to.
    inputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class CallResult:
    elapsed_ns: int
    # Compared between the engines with torch.equal.
    tensors: list[torch.Tensor | None]


def backward_call(engine: EngineApi, graph: Graph) -> CallResult:
    elapsed, _ = timed_call(engine.backward, graph.root)
    return CallResult(elapsed, [leaf.grad for leaf in graph.leaves])


def grad_call(engine: EngineApi, graph: Graph) -> CallResult:
    elapsed, grads = timed_call(engine.grad, graph.root, graph.inputs)
    return CallResult(elapsed, list(grads))


def squared_norm(tensors) -> torch.Tensor:
    return sum(t.pow(2).sum() for t in tensors)


def double_backward_call(engine: EngineApi, graph: Graph) -> CallResult:
    first, grads = timed_call(engine.grad, graph.root, graph.inputs, create_graph=True)
    # Not timed: the same forward ops for both engines.
    penalty = squared_norm(grads)
    second, _ = timed_call(engine.backward, penalty)
    return CallResult(first + second, [g.detach() for g in grads] + [leaf.grad for leaf in graph.leaves])


def count_nodes(root: torch.Tensor) -> int:
    """Unique nodes reachable from ``root.grad_fn``: the nodes a plain backward() runs."""
    seen = {root.grad_fn}
    stack = [root.grad_fn]
    while stack:
        for fn, _ in stack.pop().next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                stack.append(fn)
    return len(seen)


def count_nodes_to_inputs(root: torch.Tensor, inputs: list[torch.Tensor]) -> int:
    """Unique nodes on a path from ``root.grad_fn`` to the gradient node of an input (inputs' own
    nodes included): the nodes grad() runs or captures at."""
    parents: defaultdict[object, list] = defaultdict(list)
    seen = {root.grad_fn}
    stack = [root.grad_fn]
    while stack:
        fn = stack.pop()
        for child, _ in fn.next_functions:
            if child is None:
                continue
            parents[child].append(fn)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    on_path = {node for node in (get_gradient_edge(t).node for t in inputs) if node in seen}
    stack = list(on_path)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in on_path:
                on_path.add(parent)
                stack.append(parent)
    return len(on_path)


def count_double_backward_nodes(graph: Graph) -> int:
    first = count_nodes_to_inputs(graph.root, graph.inputs)
    grads = torch.autograd.grad(graph.root, graph.inputs, create_graph=True)
    return first + count_nodes(squared_norm(grads))


@dataclass(frozen=True)
class Call:
    """One way of asking an engine for gradients: how to time it and how many nodes it runs."""

    label: str
    # The CSV metric of the call's wall time.
    metric: str
    run: Callable[[EngineApi, Graph], CallResult]
    count_nodes: Callable[[Graph], int]


BACKWARD = Call("backward(loss)", "backward_us", backward_call, lambda graph: count_nodes(graph.root))
GRAD = Call("grad(loss, x)", "grad_us", grad_call, lambda graph: count_nodes_to_inputs(graph.root, graph.inputs))
DOUBLE_BACKWARD = Call(
    "grad(loss, W, create_graph) + backward(|g|^2)",
    "double_backward_us",
    double_backward_call,
    count_double_backward_nodes,
)


# Each case config also sets its repetitions. Measured on the shared 2-core development machine
# under load from other jobs (one pair of calls, forward rebuilds included: chain ~0.3 s, fanin
# ~30 ms, mlp ~5 ms, mlp_grad_x ~4 ms, mlp_double ~25 ms): the defaults run in ~47 s in all (~50 s
# with start-up), quick_reps in ~10 s (~12.5 s). With these the paired torch_ext/stock ratio's
# median moved by about 0.05 between runs (mlp_grad_x and mlp_double: by 0.02 over five runs).
# On an idle Intel Xeon, three quick runs beside a full one: the chain at 12 quick repetitions read
# 0.55, 0.56 and 0.63 against the full run's 0.61, so it has 20; every other case read within 0.015
# of the full run, the fixed cost's 600 included (kept: ~2 s).
@dataclass(frozen=True)
class Chain:
    length: int = 10_000
    numel: int = 4
    reps: int = 60
    quick_reps: int = 20
    name: str = "chain"
    call: Call = BACKWARD

    @property
    def size(self) -> str:
        return str(self.length)

    def make_builder(self) -> Callable[[], Graph]:
        x = torch.linspace(0.5, 1.0, self.numel).requires_grad_()

        def build() -> Graph:
            y = x
            for i in range(self.length):
                step = i % 3
                if step == 0:
                    y = y * 1.0001
                elif step == 1:
                    y = y + 0.001
                else:
                    y = y.sin()
            return Graph([x], y.sum())

        return build


@dataclass(frozen=True)
class FanIn:
    width: int = 1_000
    numel: int = 4
    reps: int = 300
    quick_reps: int = 60
    name: str = "fanin"
    call: Call = BACKWARD

    @property
    def size(self) -> str:
        return str(self.width)

    def make_builder(self) -> Callable[[], Graph]:
        x = torch.linspace(0.5, 1.0, self.numel).requires_grad_()
        scales = [1.0 + i * 1e-3 for i in range(self.width)]

        def build() -> Graph:
            return Graph([x], torch.stack([x * scale for scale in scales]).sum())

        return build


@dataclass(frozen=True)
class MLP:
    depth: int = 32
    width: int = 64
    batch: int = 8
    reps: int = 1_000
    quick_reps: int = 200
    name: str = "mlp"
    call: Call = BACKWARD

    @property
    def size(self) -> str:
        return f"{self.depth}x{self.width}/b{self.batch}"

    def make_builder(self) -> Callable[[], Graph]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(self.depth):
            layers += [torch.nn.Linear(self.width, self.width), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        # Only grad(loss, x) needs x to require grad; the other calls keep stock's usual training
        # graph, where the input's gradient is never computed.
        x = torch.randn(self.batch, self.width, requires_grad=self.call is GRAD)
        params = list(model.parameters())
        inputs = {BACKWARD: [], GRAD: [x], DOUBLE_BACKWARD: params}[self.call]

        def build() -> Graph:
            return Graph(params, model(x).sum(), inputs)

        return build


@dataclass(frozen=True)
class FixedCost:
    """The fixed cost of one call: ``(x * 2).sin().sum()`` on 4 elements, 4 nodes with x's AccumulateGrad.

    Small backward calls are common (per micro-batch in pipeline schedules, per layer in split backward,
    in RL and meta-learning loops); here the per-call work (Python entry, argument checks, the host task's
    stock graph task, discovery, post-processing) is most of the time."""

    reps: int = 3_000
    quick_reps: int = 600
    name: str = "fixed_cost"
    call: Call = BACKWARD

    @property
    def size(self) -> str:
        return "3 ops"

    def make_builder(self) -> Callable[[], Graph]:
        x = torch.linspace(0.5, 1.0, 4).requires_grad_()

        def build() -> Graph:
            return Graph([x], (x * 2).sin().sum())

        return build


Case = Chain | FanIn | MLP | FixedCost
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


def fresh_graph(build: Callable[[], Graph]) -> Graph:
    graph = build()
    for leaf in graph.leaves:
        leaf.grad = None
    return graph


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
