"""Runs one graph on stock PyTorch and on torch_ext and compares what each engine did.

In the manner of tinygrad's ``helper_test_op``: a test hands over a ``build()`` that makes the graph, and
:func:`assert_backward_matches_stock` builds it twice from the same seed, runs stock
``torch.autograd.backward`` on one copy and ``torch_ext.backward`` on the other, and asserts the two
engines agree on the bits of every gradient, the order nodes ran in and the calls of every hook.

Hooks made with :func:`hook` (or anything calling :func:`record`) write to the log of the run in
progress, so a ``build()`` registers its hooks exactly as user code would.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch.autograd.graph import GradientEdge, get_gradient_edge

import torch_ext
from torch_ext._loader import _C
from torch_ext.collectives.roles import _declare_collective_op, _generated_function
from torch_ext.testing import assert_identical, identity_difference

SEED = 0

# The log of the backward run being recorded on each thread (both engines run a CPU graph's nodes on the
# thread that called backward); None outside of one.
_recording = threading.local()
# Seeding and building hold this lock: the default generator is shared by all threads.
_build_lock = threading.Lock()


def _active_log() -> list[tuple] | None:
    return getattr(_recording, "log", None)


@dataclasses.dataclass
class BackwardRecord:
    """What one engine did: ``.grad`` of each leaf, and the log of node and hook events in call order."""

    grads: list[torch.Tensor | None]
    log: list[tuple]
    # How many of the logged nodes torch_ext's engine ran (all of them on torch_ext, none on stock).
    nodes_on_torch_ext: int = 0

    @property
    def order(self) -> list[str]:
        """``"<walk index>:<node name>"`` of each node, in the order the engine ran it."""
        return [event[1] for event in self.log if event[0] == "node"]

    @property
    def hook_labels(self) -> list[str]:
        return [event[1] for event in self.log if event[0] == "hook"]

    @property
    def hook_values(self) -> dict[str, list[tuple]]:
        """What each hook saw, call after call: the same for two engines that may call hooks in another order."""
        values: dict[str, list[tuple]] = {}
        for event in self.log:
            if event[0] == "hook":
                values.setdefault(event[1], []).append(event[2])
        return values


def _snapshot(value):
    # Hooks see gradients the engine may later accumulate into in place: copy them when called.
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(_snapshot(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def record(label: str, *values) -> None:
    """Appends ``label`` and a copy of ``values`` (tensors, tuples of them, None) to the log in progress."""
    log = _active_log()
    if log is None:
        raise AssertionError(f"hook {label!r} ran outside a recorded backward")
    log.append(("hook", label, _snapshot(values)))


def hook(label: str, replace: Callable | None = None) -> Callable:
    """A hook of any kind that logs its arguments, then returns ``replace(*args)`` (None: keep the gradient)."""

    def logged_hook(*args):
        record(label, *args)
        return None if replace is None else replace(*args)

    return logged_hook


def graph_nodes(roots: Sequence) -> list:
    """Every node reachable from ``roots``, breadth first along ``next_functions``: the same list for two
    graphs built by the same code, so a node's position names it across the two."""
    queue = []
    for root in roots:
        if isinstance(root, GradientEdge):
            queue.append(root.node)
        elif isinstance(root, torch.Tensor) and root.requires_grad:
            queue.append(get_gradient_edge(root).node)
    seen: set = set()
    nodes = []
    while queue:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        queue.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def _ran_by_torch_ext() -> bool:
    """Whether the node running on this thread is run by torch_ext's engine: its call is this thread's running
    ``BackwardCall``. ``_current_execution_order`` answers only with multithreading off, as stock's
    ``get_current_graph_task_execution_order`` does; the switch is thread-local and lasts for this question."""
    with torch.autograd.set_multithreading_enabled(False):
        return _C._current_execution_order() is not None


def _order_hook(position: int, node):
    tag = f"{position}:{node.name()}"

    def prehook(grad_outputs):
        _active_log().append(("node", tag))
        _recording.nodes_on_torch_ext += _ran_by_torch_ext()

    return prehook


def _fresh_grads(grad_tensors):
    # Each engine gets its own copy: AccumulateGrad may adopt a root gradient as a leaf's .grad.
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        return None if grad_tensors is None else grad_tensors.clone()
    return [None if g is None else g.clone() for g in grad_tensors]


def run_recorded(build: Callable, backward: Callable, *, grad_tensors=None, retain_graph=None, runs=1):
    """Builds the graph from :data:`SEED`, hooks every node's execution, and runs ``backward`` ``runs`` times."""
    with _build_lock:
        torch.manual_seed(SEED)
        roots, leaves = build()
    roots = [roots] if isinstance(roots, (torch.Tensor, GradientEdge)) else list(roots)
    log: list[tuple] = []
    for position, node in enumerate(graph_nodes(roots)):
        node.register_prehook(_order_hook(position, node))
    _recording.log = log
    _recording.nodes_on_torch_ext = 0
    try:
        for run in range(runs):
            if run:
                log.append(("run", run))
            backward(roots, grad_tensors=_fresh_grads(grad_tensors), retain_graph=retain_graph)
    finally:
        _recording.log = None
    return BackwardRecord([leaf.grad for leaf in leaves], log, _recording.nodes_on_torch_ext)


# torch_ext.testing.assert_identical's test as a bool, under the names tests/test_lanes.py imports.
def tensors_identical(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return identity_difference(a, b) is None


def _logs_identical(a, b) -> bool:
    return identity_difference(a, b) is None


def _describe(event) -> str:
    kind, label, *values = event
    return f"{kind} {label}" + (f" {values[0]!r}" if values else "")


def assert_backward_matches_stock(
    build: Callable,
    *,
    grad_tensors=None,
    retain_graph=None,
    runs: int = 1,
    ext_backward: Callable | None = None,
) -> BackwardRecord:
    """Asserts torch_ext and stock PyTorch run backward on ``build()``'s graph identically.

    ``build()`` returns ``(roots, leaves)``: the tensors or GradientEdges to differentiate and the tensors
    whose ``.grad`` is compared (leaves, or non-leaves that retain their grad). It is called once per
    engine from the same seed, so both get the same values and the same graph. ``ext_backward`` replaces
    ``torch_ext.backward`` (same signature as ``torch.autograd.backward``).

    Last, it asserts that torch_ext's engine ran every node of the torch_ext run (and none of stock's): an
    ``ext_backward`` that reached stock's engine would otherwise pass every comparison.

    Returns stock's record, so a test can check the events it expects really happened.
    """
    ext_backward = ext_backward or torch_ext.backward
    options = {"grad_tensors": grad_tensors, "retain_graph": retain_graph, "runs": runs}
    stock = run_recorded(build, torch.autograd.backward, **options)
    ext = run_recorded(build, ext_backward, **options)

    assert stock.order, "no node ran: build() made no graph"
    assert_identical(ext.grads, stock.grads, "leaf .grad")
    assert ext.order == stock.order, "node execution order differs"
    assert identity_difference(ext.log, stock.log) is None, (
        "hook call logs differ:\nstock:\n  {}\ntorch_ext:\n  {}".format(
            "\n  ".join(map(_describe, stock.log)), "\n  ".join(map(_describe, ext.log))
        )
    )
    assert stock.nodes_on_torch_ext == 0, f"{stock.nodes_on_torch_ext} nodes of the stock run ran on torch_ext"
    assert ext.nodes_on_torch_ext == len(ext.order), (
        f"torch_ext's engine did not run the torch_ext run: it ran {ext.nodes_on_torch_ext} of its "
        f"{len(ext.order)} nodes"
    )
    return stock


@dataclasses.dataclass
class ErrorPair:
    stock: BaseException
    ext: BaseException
    stock_warnings: list[warnings.WarningMessage]
    ext_warnings: list[warnings.WarningMessage]


def _raised(fn: Callable, engine: str) -> tuple[BaseException, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any type, compared below
            return e, caught
    raise AssertionError(f"{engine}: expected an exception, none was raised")


def assert_same_error(fn_stock: Callable, fn_ext: Callable) -> ErrorPair:
    """Asserts both callables raise, with the same exception type and message.

    Warnings raised meanwhile are recorded (not filtered) and returned for the test to compare.
    """
    stock, stock_warnings = _raised(fn_stock, "stock")
    ext, ext_warnings = _raised(fn_ext, "torch_ext")
    assert type(ext) is type(stock), f"stock raised {type(stock).__name__}: {stock}\ntorch_ext raised {ext!r}"
    assert str(ext) == str(stock), f"messages differ:\nstock:     {stock}\ntorch_ext: {ext}"
    return ErrorPair(stock, ext, stock_warnings, ext_warnings)


def recsys_like(seed=0, exchange=None, layers=3):
    """loss = (sparse path * dense path).sum(), each path `layers` matmuls deep: the sparse path starts
    at `lookup` (stands for an all_to_all output; `exchange`, if given, is applied to make it) and is
    created before the dense path, so stock runs the dense path first."""
    torch.manual_seed(seed)
    w_sparse = [torch.randn(4, 4, requires_grad=True) for _ in range(layers)]
    w_dense = [torch.randn(4, 4, requires_grad=True) for _ in range(layers)]
    table = torch.randn(2, 4, requires_grad=True)
    lookup = table.exp()
    if exchange is not None:
        lookup = exchange(lookup)
    sparse = lookup
    for w in w_sparse:
        sparse = torch.tanh(sparse @ w)
    dense = torch.randn(2, 4)
    for w in w_dense:
        dense = torch.relu(dense @ w)
    loss = (sparse * dense).sum()
    return loss, lookup, w_sparse, w_dense, [table, *w_sparse, *w_dense]


# Collectives written as torch.library ops, as PyTorch's functional collectives and torch_ext's own are, stood in
# for by ops of a test namespace that move no bytes (forward copies, backward passes the gradient on): one on a
# tensor and one on a tensor list (torch.library wraps the Function it generates for a list op). The engine knows
# such a node by the op its generated class was made for; these two are declared collectives as torch_ext's own ops
# are (_declare_collective_op), and all_to_all_single, named like a collective, is not one.
@torch.library.custom_op("torch_ext_test::exchange", mutates_args=())
def exchange_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("torch_ext_test::exchange_list", mutates_args=())
def exchange_list_op(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@torch.library.custom_op("torch_ext_test::all_to_all_single", mutates_args=())
def not_a_collective_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


for _op in (exchange_op, not_a_collective_op):
    _op.register_fake(torch.empty_like)
    _op.register_autograd(lambda ctx, grad: grad)
exchange_list_op.register_fake(lambda xs: [torch.empty_like(x) for x in xs])
exchange_list_op.register_autograd(lambda ctx, grads: list(grads))
for _op in (torch.ops.torch_ext_test.exchange.default, torch.ops.torch_ext_test.exchange_list.default):
    _declare_collective_op(_op, defers_wait=False)


def generated_node_class(op: torch._ops.OpOverload) -> type:
    """The backward node class torch.library generated for ``op``'s autograd formula."""
    return _generated_function(op, "test")._backward_cls


# Random programs: hypothesis draws a small graph, test_engine_fuzz and test_bit_stability run it on both engines.

N = 3
NUM_LEAVES = 4


def _inplace_on_clone(a):
    c = a.clone()
    c[1:].mul_(2)
    return c


def _inplace_on_view_of_clone(a, b):
    c = a.clone(memory_format=torch.contiguous_format)
    c[:, 1:].mul_(b[:, 1:])
    c.view(-1)[0] = b[0, 0] * 3
    return c


def _inplace_chain(a, b):
    c = a.clone()
    c.t_()
    c.add_(b).mul_(b).sigmoid_()
    return c


UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "scale": lambda a: a * 1.5,
    "square": lambda a: a * a,
    "t": lambda a: a.t(),
    "flip_view": lambda a: a.reshape(-1).flip(0).view(N, N),
    "row_sum_scale": lambda a: a.sum(1, keepdim=True) * a,
    "col_mean_expand": lambda a: a.mean(0, keepdim=True).expand(N, N),
    "amax_add": lambda a: a.amax(0, keepdim=True) + a,
    "softmax": lambda a: a.softmax(-1),
    "cumsum": lambda a: a.cumsum(0),
    "unbind_stack": lambda a: torch.stack(a.unbind(0)[::-1]),
    "chunk_swap": lambda a: torch.cat(a.chunk(3, 1)[::-1], 1),
    "index_select": lambda a: a.index_select(0, torch.tensor([2, 0, 0])),
    "clamp": lambda a: a.clamp(-0.5, 0.5),
    "inplace_on_clone": _inplace_on_clone,
    "detach": lambda a: a.detach(),
}

BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "matmul": torch.matmul,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "cat_rows": lambda a, b: torch.cat([a[:1], b[1:]]),
    "inplace_on_view_of_clone": _inplace_on_view_of_clone,
    "inplace_chain": _inplace_chain,
}


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    args: tuple[int, ...]
    # A logging hook on the result, halving the gradient when `replace` (only for results needing grad).
    hook: str | None = None
    # retain_grad() on the result (only for results needing grad): Program.build returns it after the leaves.
    retain: bool = False


@dataclasses.dataclass(frozen=True)
class Root:
    value: int
    kind: str  # "tensor": grad given; "scalar": .sum(), no grad; "edge": GradientEdge, grad given


@dataclasses.dataclass(frozen=True)
class Program:
    """A random graph over NUM_LEAVES (N, N) leaves; value i > NUM_LEAVES is the result of ops[i - NUM_LEAVES]."""

    ops: tuple[Op, ...]
    roots: tuple[Root, ...]
    runs: int
    dtype: torch.dtype = torch.float32

    def build(self, wrap: Callable | None = None):
        """``(roots, leaves followed by the values that retain their grad)``, from the current seed.

        ``wrap(i, value)``, when given, replaces the result of op ``i`` before anything reads it.
        """
        values = [torch.randn(N, N, dtype=self.dtype, requires_grad=True) for _ in range(NUM_LEAVES)]
        retained = []
        for i, op in enumerate(self.ops):
            fn = UNARY.get(op.name) or BINARY[op.name]
            value = fn(*(values[a] for a in op.args))
            if wrap is not None:
                value = wrap(i, value)
            if op.hook is not None:
                replace = (lambda g: g * 0.5) if op.hook == "replace" else None
                value.register_hook(hook(f"value {NUM_LEAVES + i}", replace))
            if op.retain:
                value.retain_grad()
                retained.append(value)
            values.append(value)
        roots = []
        for root in self.roots:
            value = values[root.value]
            if root.kind == "scalar":
                roots.append(value.sum())
            elif root.kind == "edge":
                roots.append(get_gradient_edge(value))
            else:
                roots.append(value)
        return roots, values[:NUM_LEAVES] + retained

    def grad_tensors(self):
        generator = torch.Generator().manual_seed(len(self.ops))
        return [
            None if r.kind == "scalar" else torch.randn(N, N, generator=generator, dtype=self.dtype) for r in self.roots
        ]


# With fan_in, half the arguments are one of the FAN_IN_WINDOW latest values, so that most values feed
# several later ops and their nodes' input buffers sum three or more gradients.
FAN_IN_WINDOW = 3


@st.composite
def programs(draw, *, dtype=torch.float32, max_ops=16, fan_in=False, retain_grad=False):
    """Random :class:`Program` s. The defaults draw exactly as test_engine_fuzz always has (its examples
    are derandomized); ``fan_in`` favours recent values as arguments, ``retain_grad`` draws Op.retain."""
    requires_grad = [True] * NUM_LEAVES
    ops = []

    def argument():
        if fan_in and draw(st.booleans()):
            return draw(st.integers(max(0, len(requires_grad) - FAN_IN_WINDOW), len(requires_grad) - 1))
        return draw(st.integers(0, len(requires_grad) - 1))

    for _ in range(draw(st.integers(1, max_ops))):
        binary = draw(st.booleans())
        name = draw(st.sampled_from(sorted(BINARY if binary else UNARY)))
        args = tuple(argument() for _ in range(2 if binary else 1))
        needs_grad = name != "detach" and any(requires_grad[a] for a in args)
        hook_kind = draw(st.sampled_from([None, None, "log", "replace"])) if needs_grad else None
        retain = needs_grad and retain_grad and draw(st.booleans())
        ops.append(Op(name, args, hook_kind, retain))
        requires_grad.append(needs_grad)
    # Roots are computed values needing grad, plus, now and then, a leaf (its AccumulateGrad is the root).
    computed = [i for i in range(NUM_LEAVES, len(requires_grad)) if requires_grad[i]]
    chosen = draw(st.lists(st.sampled_from(computed[::-1]), min_size=1, max_size=3)) if computed else []
    if not chosen or draw(st.integers(0, 4)) == 0:
        chosen.append(draw(st.integers(0, NUM_LEAVES - 1)))
    roots = tuple(Root(v, draw(st.sampled_from(["tensor", "scalar", "edge"]))) for v in chosen)
    return Program(tuple(ops), roots, draw(st.sampled_from([1, 1, 1, 2])), dtype)


# CI's fuzz job (.ci/run): TORCH_EXT_FUZZ_SCALE multiplies every fuzz test's examples, and TORCH_EXT_FUZZ_SEED
# (also passed as pytest's --hypothesis-seed) draws them from that seed instead of the default suite's fixed
# ones; the job prints the seed, so a failure found there replays with the same two variables.
FUZZ_SCALE_VARIABLE = "TORCH_EXT_FUZZ_SCALE"
FUZZ_SEED_VARIABLE = "TORCH_EXT_FUZZ_SEED"


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings of a random-graph fuzz test: ``max_examples`` derandomized examples in the default
    suite (the same every run), scaled and seeded in CI's fuzz job."""
    scale = float(os.environ.get(FUZZ_SCALE_VARIABLE, "1"))
    return settings(
        max_examples=max(1, round(max_examples * scale)),
        deadline=None,
        derandomize=FUZZ_SEED_VARIABLE not in os.environ,
        database=None,
        print_blob=True,
        # The helpers seed torch themselves before every build; slow examples are expected.
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
