"""Peak tensor memory of one backward call: stock PyTorch's engine against torch_ext's.

torch_ext's engine releases a gradient as soon as its last reader has run; this measures whether its
peak is any higher than stock's. Graphs (as in tests/test_backward_memory.py, which asserts the same):

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

Each graph is built afresh from the same seed for every call. Per graph: stock ``--runs`` times;
torch_ext ``--runs`` times with its plan cache off (every call discovers its plan, as a structure's
first call does); then torch_ext with the cache cleared and on, three times, the third replaying the
plan the first two made (checked from ``_plan_cache_stats``). All gradients must be torch.equal to
stock's, or the script fails. ``repeats`` says whether stock's runs and torch_ext's first-call runs
each gave one figure. torch_ext's first call in a process allocates a 4-byte tensor it keeps for good
(its driver node's input, csrc/host_task.cpp); one unmeasured call of each engine comes first.

    python benchmarks/backward_memory.py [--runs N]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch
from torch import nn

import torch_ext
from torch_ext import _C
from torch_ext.memory import PeakMemory

# A structure's plan is kept from its second call on: the third call is the first replay.
FIRST_REPLAY = 3
PRIORITY = 10
MIB = 2**20


@dataclasses.dataclass
class Graph:
    loss: torch.Tensor
    # Whose .grad backward() fills and the script compares.
    leaves: list[torch.Tensor]
    # grad(loss, grad_inputs) instead of backward(loss) when set.
    grad_inputs: list[torch.Tensor] | None = None
    # torch_ext's call is given priorities={priority_target: PRIORITY}.
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
    blocks = [(nn.Linear(512, 512), nn.GELU()) for _ in range(8)]
    model = nn.Sequential(*[module for block in blocks for module in block])
    x = torch.randn(64, 512, requires_grad=True)
    return Graph(model(x).sum(), leaves=[*model.parameters(), x])


def deep_mlp_grad_of_input() -> Graph:
    graph = deep_mlp()
    graph.grad_inputs = [graph.leaves[-1]]
    return graph


def fan_in(prioritized_branch: int | None = None) -> Graph:
    x = torch.randn(4096, requires_grad=True)
    factors = torch.randn(64)
    branches = [x * factors[i] for i in range(64)]
    target = None if prioritized_branch is None else branches[prioritized_branch]
    return Graph(torch.stack(branches).sum(), leaves=[x], priority_target=target)


def elementwise_chain() -> Graph:
    x = torch.randn(1 << 20, requires_grad=True)
    h = x
    for i in range(50):
        h = (h * 1.0001) if i % 3 == 0 else (h + 0.001) if i % 3 == 1 else h.sin()
    return Graph(h.sum(), leaves=[x])


def reused_intermediate(prioritized: str | None = None) -> Graph:
    x = torch.randn(1 << 20, requires_grad=True)
    h = x.sin()
    readers = {"exp": (h * 2).exp(), "cos": h.cos(), "tanh": h.tanh()}
    loss = (readers["exp"] + readers["cos"] + readers["tanh"]).sum()
    target = None if prioritized is None else readers[prioritized]
    return Graph(loss, leaves=[x], priority_target=target)


GRAPHS: dict[str, Callable[[], Graph]] = {
    "deep_mlp": deep_mlp,
    "deep_mlp_grad_of_input": deep_mlp_grad_of_input,
    "fan_in": fan_in,
    "elementwise_chain": elementwise_chain,
    "reused_intermediate": reused_intermediate,
    "reused_intermediate_priority_tanh": lambda: reused_intermediate("tanh"),
    "reused_intermediate_priority_exp": lambda: reused_intermediate("exp"),
    "fan_in_priority_branch_0": lambda: fan_in(prioritized_branch=0),
}


def run_engine(engine: Engine, graph: Graph) -> list[torch.Tensor]:
    kwargs = {}
    if engine.takes_priorities and graph.priority_target is not None:
        kwargs["priorities"] = {graph.priority_target: PRIORITY}
    if graph.grad_inputs is not None:
        return list(engine.grad(graph.loss, graph.grad_inputs, **kwargs))
    engine.backward(graph.loss, **kwargs)
    return [leaf.grad for leaf in graph.leaves]


def measure(build: Callable[[], Graph], engine: Engine) -> tuple[int, list[torch.Tensor]]:
    """Builds a graph (seeded) and runs one engine call on it under the memory tracker: (peak bytes, gradients)."""
    with PeakMemory() as memory:
        torch.manual_seed(0)
        graph = build()
        with memory.region():
            gradients = run_engine(engine, graph)
    return memory.peak_bytes, gradients


def check_same(name: str, expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    if len(expected) != len(got) or not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)):
        raise SystemExit(f"{name}: torch_ext's gradients differ from stock's")


@dataclasses.dataclass(frozen=True)
class Row:
    graph: str
    stock: int
    first_call: int
    replayed: int
    repeats: bool


def measure_graph(name: str, build: Callable[[], Graph], runs: int) -> Row:
    stock_runs = [measure(build, STOCK) for _ in range(runs)]
    stock_gradients = stock_runs[0][1]
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
    for _, gradients in first_calls + replays:
        check_same(name, stock_gradients, gradients)
    stock_peaks = {peak for peak, _ in stock_runs}
    first_peaks = {peak for peak, _ in first_calls}
    return Row(
        name,
        stock=max(stock_peaks),
        first_call=max(first_peaks),
        replayed=replays[-1][0],
        repeats=len(stock_peaks) == 1 and len(first_peaks) == 1,
    )


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
    parser.add_argument("--runs", type=int, default=3, help="calls of each engine per graph (default 3)")
    args = parser.parse_args(argv)
    for engine in (STOCK, TORCH_EXT):
        x = torch.ones(2, requires_grad=True)
        engine.backward((x * 2).sum())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, peak bytes above call start")
    print("torch_ext: first call (plan discovered); replayed: third call of the structure (plan cache)")
    previous = _C._set_plan_cache(True)
    try:
        rows = []
        for name, build in GRAPHS.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            rows.append(measure_graph(name, build, args.runs))
    finally:
        _C._set_plan_cache(previous)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
