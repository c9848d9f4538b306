"""A torch.compile backend that keeps every collective an autograd node of its own, so torch_ext can overlap it.

Compiled whole, a model's backward is one ``CompiledFunctionBackward`` node, and AOTAutograd's graph waits for each
collective right after issuing it: nothing is left for torch_ext to launch early or run in a lane. This backend
applies Dynamo's ``DDPOptimizer`` pattern (``torch/_dynamo/backends/distributed.py``) at collectives instead of
DDP's buckets: it splits the captured graph, runs each collective op eagerly, so that its backward is the op's own
autograd node (``run_in_lane``'s and the automatic collective priority's target), and compiles the compute between
them with the inner backend (Inductor by default)::

    torch_ext.run_in_lane(torch.ops._c10d_functional.all_to_all_single)
    model = torch.compile(model, backend=torch_ext.compile_backend(), fullgraph=True)
    with torch_ext.enable():
        model(tokens).sum().backward()

The split happens after Dynamo's capture, so ``fullgraph=True`` keeps working. The compute is cut into regions
by what it depends on and what depends on it: a region never mixes compute on a path to a collective with
compute independent of it (or the collective's backward would wait for work beside it), and a region holds at
most ``matmuls_per_region`` matrix products, so that the engine can run the work beside a collective in pieces,
between one collective's backward and the next. A graph with no collective is handed to the inner backend whole.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["compile_backend"]

# Ops whose call is a collective with a backward torch_ext can act on: PyTorch's functional collectives (what
# all_to_all_single_autograd, DTensor and torchtitan trace to), the c10d ops, and torch_ext's own collectives.
# wait_tensor is not one: it stays in the compute region that reads its result, as AOTAutograd handles it.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
_TORCH_EXT_COLLECTIVES = frozenset(
    {"all_to_all_single", "all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "all_gather_into_tensor"}
)

# Matrix products as Dynamo's graphs name them (torch functions, Tensor methods), the work a region is sized by.
_MATMUL_FUNCTIONS = frozenset(
    {
        torch._C._nn.linear,
        torch.nn.functional.linear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
        operator.matmul,
        torch.conv1d,
        torch.conv2d,
        torch.conv3d,
        torch.nn.functional.conv1d,
        torch.nn.functional.conv2d,
        torch.nn.functional.conv3d,
        torch.nn.functional.scaled_dot_product_attention,
    }
)
_MATMUL_METHODS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"})


def _op_name(target: Any) -> tuple[str, str] | None:
    """``(namespace, name)`` of an op overload or packet, None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return namespace, name
    return None


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` of a Dynamo graph calls a collective that the backend keeps out of compiled regions."""
    if node.op != "call_function":
        return False
    op = _op_name(node.target)
    if op is None:
        return False
    namespace, name = op
    if namespace == "torch_ext":
        return name in _TORCH_EXT_COLLECTIVES
    return namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES


def _is_matmul(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _MATMUL_FUNCTIONS or _op_name(node.target) in {
            ("aten", "mm"),
            ("aten", "addmm"),
            ("aten", "bmm"),
            ("aten", "linear"),
            ("aten", "matmul"),
            ("aten", "convolution"),
        }
    return node.op == "call_method" and node.target in _MATMUL_METHODS


def partition_at_collectives(graph: fx.Graph, matmuls_per_region: int) -> dict[fx.Node, int]:
    """Each node's partition: a collective alone in one, the compute between them in regions.

    Partitions are runs of consecutive nodes in the graph's (topological) order, so the partitions form a DAG
    whatever is cut. A new compute region starts after a collective, where the collectives a node depends on
    or feeds change (a node's signature), and after ``matmuls_per_region`` matrix products.
    """
    nodes = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    upstream: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in graph.nodes:
        inherited = frozenset().union(*(upstream.get(source, frozenset()) for source in node.all_input_nodes))
        upstream[node] = inherited | {node} if is_collective(node) else inherited
    downstream: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in reversed(graph.nodes):
        inherited = frozenset().union(*(downstream.get(user, frozenset()) for user in node.users))
        downstream[node] = inherited | {node} if is_collective(node) else inherited

    partition_of: dict[fx.Node, int] = {}
    partition = 0
    signature = None
    matmuls = 0
    for node in nodes:
        if is_collective(node):
            partition_of[node] = partition + 1
            partition += 2
            signature = None
            continue
        node_signature = (upstream[node], downstream[node])
        if signature is not None and (node_signature != signature or matmuls >= matmuls_per_region):
            partition += 1
            matmuls = 0
        signature = node_signature
        matmuls += _is_matmul(node)
        partition_of[node] = partition
    return partition_of


# The default most matrix products in one compiled region. 1, the finest the engine can interleave: at x1 of
# benchmarks/compile_overlap (one Linear + ReLU layer ~2.5 ms here) 2 and 4 read 0.85 and 0.79 by step time,
# within the runs' noise of 1 (0.77-0.82).
MATMULS_PER_REGION = 1


def compile_backend(
    inner: str | Callable[..., Any] = "inductor", *, matmuls_per_region: int = MATMULS_PER_REGION
) -> Callable[[fx.GraphModule, Sequence[torch.Tensor]], Callable[..., Any]]:
    """A ``torch.compile`` backend: the captured graph split at its collectives, the compute compiled by ``inner``.

    Args:
        inner: the backend that compiles each compute region: a name ``torch.compile`` accepts (``"inductor"``,
            ``"aot_eager"``, ...) or a backend callable.
        matmuls_per_region: the most matrix products (linear, matmul, conv, attention) one compiled region
            holds. Smaller regions let the engine interleave the work beside a collective more finely, at the
            cost of a compiled call each and fusion across their boundary.

    Collectives are PyTorch's functional collectives (``torch.distributed._functional_collectives``, what
    ``all_to_all_single_autograd``, DTensor and torchtitan use), the ``c10d`` ops and ``torch_ext.ops``'
    collectives. An autograd Function declared with ``run_in_lane`` or ``register_collective_backward`` is
    not recognised in a captured graph (Dynamo inlines it): leave such a call outside the compiled module.
    """
    if not isinstance(matmuls_per_region, int) or isinstance(matmuls_per_region, bool) or matmuls_per_region < 1:
        raise ValueError(
            f"torch_ext.compile_backend: matmuls_per_region must be an int of at least 1, got {matmuls_per_region!r}"
        )
    if isinstance(inner, str):
        inner_backend = torch._dynamo.lookup_backend(inner)
    elif callable(inner):
        inner_backend = inner
    else:
        raise TypeError(f"torch_ext.compile_backend: inner must be a backend name or callable, got {inner!r}")

    def split_at_collectives(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        # Private parts of Dynamo's DDPOptimizer, the same pattern at other cut points (torch is pinned).
        from torch._dynamo.backends.distributed import SubmodCompiler, propagate_dynamo_source, propagate_metadata
        from torch._dynamo.utils import detect_fake_mode
        from torch.fx.passes.split_module import split_module

        partition_of = partition_at_collectives(gm.graph, matmuls_per_region)
        collective_partitions = {partition_of[node] for node in gm.graph.nodes if is_collective(node)}
        if not collective_partitions:
            return inner_backend(gm, example_inputs)
        split_gm = split_module(gm, None, lambda node: partition_of[node])
        propagate_dynamo_source(gm, split_gm)
        propagate_metadata(gm, split_gm)
        eager_names = {f"submod_{partition}" for partition in collective_partitions}

        def compile_region(module: fx.GraphModule, args: list[torch.Tensor], **configs: Any) -> Callable[..., Any]:
            if _submodule_name(split_gm, module) in eager_names:
                return module  # the collective runs as an op: its backward is its own autograd node
            return inner_backend(module, args, **configs)

        fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
        with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
            SubmodCompiler(split_gm, compile_region, fake_mode).run(*example_inputs)
        split_gm.recompile()
        return split_gm

    return split_at_collectives


def _submodule_name(parent: fx.GraphModule, module: torch.nn.Module) -> str | None:
    for name, child in parent.named_children():
        if child is module:
            return name
    return None
