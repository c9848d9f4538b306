"""The autograd graphs engine_overhead and trace_overhead time (engine_overhead's docstring describes them), the
calls they ask an engine for, and how many nodes each call runs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

from .harness.timing import timed_call


@dataclass(frozen=True)
class EngineApi:
    name: str
    backward: Callable
    grad: Callable
    # torch_ext's plan cache (csrc/engine/plan/plan_cache.h) on or off for this engine's calls; None for stock.
    plan_cache: bool | None = None


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


def fresh_graph(build: Callable[[], Graph]) -> Graph:
    graph = build()
    for leaf in graph.leaves:
        leaf.grad = None
    return graph
