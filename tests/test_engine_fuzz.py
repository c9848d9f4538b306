"""Random graphs on torch_ext and on stock torch.autograd: the same gradient bits and node order.

Hypothesis draws a small program over a few (N, N) leaves: elementwise, matmul, reduction, view and
in-place-on-clone ops, detached branches, logging hooks, and one to four roots (tensors, scalars or
GradientEdges; a root may be reachable from another). ``engine_helpers.assert_backward_matches_stock``
builds it once per engine and compares gradients with torch.equal, node execution order and hook calls.
"""

import dataclasses

import torch
from engine_helpers import assert_backward_matches_stock, hook
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

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


@dataclasses.dataclass(frozen=True)
class Root:
    value: int
    kind: str  # "tensor": grad given; "scalar": .sum(), no grad; "edge": GradientEdge, grad given


@dataclasses.dataclass(frozen=True)
class Program:
    ops: tuple[Op, ...]
    roots: tuple[Root, ...]
    runs: int

    def build(self):
        values = [torch.randn(N, N, requires_grad=True) for _ in range(NUM_LEAVES)]
        for i, op in enumerate(self.ops):
            fn = UNARY.get(op.name) or BINARY[op.name]
            value = fn(*(values[a] for a in op.args))
            if op.hook is not None:
                replace = (lambda g: g * 0.5) if op.hook == "replace" else None
                value.register_hook(hook(f"value {NUM_LEAVES + i}", replace))
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
        return roots, values[:NUM_LEAVES]

    def grad_tensors(self):
        generator = torch.Generator().manual_seed(len(self.ops))
        return [None if r.kind == "scalar" else torch.randn(N, N, generator=generator) for r in self.roots]


@st.composite
def programs(draw):
    requires_grad = [True] * NUM_LEAVES
    ops = []
    for _ in range(draw(st.integers(1, 16))):
        binary = draw(st.booleans())
        name = draw(st.sampled_from(sorted(BINARY if binary else UNARY)))
        args = tuple(draw(st.integers(0, len(requires_grad) - 1)) for _ in range(2 if binary else 1))
        needs_grad = name != "detach" and any(requires_grad[a] for a in args)
        hook_kind = draw(st.sampled_from([None, None, "log", "replace"])) if needs_grad else None
        ops.append(Op(name, args, hook_kind))
        requires_grad.append(needs_grad)
    # Roots are computed values needing grad, plus, now and then, a leaf (its AccumulateGrad is the root).
    computed = [i for i in range(NUM_LEAVES, len(requires_grad)) if requires_grad[i]]
    chosen = draw(st.lists(st.sampled_from(computed[::-1]), min_size=1, max_size=3)) if computed else []
    if not chosen or draw(st.integers(0, 4)) == 0:
        chosen.append(draw(st.integers(0, NUM_LEAVES - 1)))
    roots = tuple(Root(v, draw(st.sampled_from(["tensor", "scalar", "edge"]))) for v in chosen)
    return Program(tuple(ops), roots, draw(st.sampled_from([1, 1, 1, 2])))


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    # The helper seeds torch itself before every build; the autouse seed fixture does not matter here.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(programs())
def test_random_graph_matches_stock(program):
    assert_backward_matches_stock(
        program.build,
        grad_tensors=program.grad_tensors(),
        retain_graph=program.runs > 1,
        runs=program.runs,
    )
