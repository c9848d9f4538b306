"""torch_ext.compile_backend: where it cuts a captured graph, what it hands the inner backend, its refusals, and the
stock engine's bits on the split model (one gloo rank; tests/distributed/test_compile.py runs two)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn

import torch_ext
from torch_ext.compiler import is_collective, partition_at_collectives


class Exchange(nn.Module):
    """dispatch -> expert -> combine, and a dense path of three layers made after them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.expert = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        dispatched = funcol.all_to_all_single_autograd(self.gate(tokens), None, None, group)
        combined = funcol.all_to_all_single_autograd(self.expert(dispatched), None, None, group)
        return (combined + self.dense(tokens)).sum()


def captured_graph(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=keep, fullgraph=True)(*inputs)
    return graphs[0]


def test_each_collective_is_alone_and_no_region_mixes_paths(one_rank_world):
    graph = captured_graph(Exchange(), torch.randn(4, 8)).graph
    partition_of = partition_at_collectives(graph, matmuls_per_region=1)
    members: dict[int, list[fx.Node]] = {}
    for node, partition in partition_of.items():
        members.setdefault(partition, []).append(node)
    collectives = [node for node in graph.nodes if is_collective(node)]
    assert len(collectives) == 2
    for node in collectives:
        assert members[partition_of[node]] == [node]
    # The dense path's three layers are three regions, apart from the expert's and the gate's.
    dense_partitions = {partition_of[n] for n in graph.nodes if n.op == "call_function" and "dense" in str(n.args)}
    expert_partitions = {partition_of[n] for n in graph.nodes if n.op == "call_function" and "expert" in str(n.args)}
    assert len(dense_partitions) == 3 and len(expert_partitions) == 2
    assert not dense_partitions & expert_partitions
    # Partitions run in graph order: a DAG whatever was cut.
    order = [partition_of[n] for n in graph.nodes if n in partition_of]
    assert order == sorted(order)
    coarse = partition_at_collectives(graph, matmuls_per_region=8)
    assert len({coarse[n] for n in graph.nodes if n.op == "call_function" and "dense" in str(n.args)}) == 1


def test_a_graph_without_collectives_goes_to_the_inner_backend_whole():
    calls = []

    def inner(gm, example_inputs):
        calls.append(len(list(gm.graph.nodes)))
        return gm

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=torch_ext.compile_backend(inner), fullgraph=True)
    x = torch.randn(2, 4)
    assert torch.equal(compiled(x), model(x))
    assert len(calls) == 1


def test_the_split_model_has_stock_engines_bits_and_its_collectives_as_nodes(one_rank_world):
    torch.manual_seed(0)
    model = Exchange()
    regions = []

    def inner(gm, example_inputs):
        regions.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=torch_ext.compile_backend(inner), fullgraph=True)
    grads = {}
    for engine in ("stock", "torch_ext"):
        model.zero_grad()
        tokens = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        loss = compiled(tokens)
        with (
            torch_ext.enable() if engine == "torch_ext" else contextlib.nullcontext(),
            torch.profiler.profile() as profile,
        ):
            loss.backward()
        grads[engine] = [p.grad.clone() for p in model.parameters()]
        names = [event.name for event in profile.events()]
        assert names.count("GeneratedBackwardFor__c10d_functional_all_to_all_single_defaultBackward") == 2
        assert ("torch_ext::BackwardDriver" in names) == (engine == "torch_ext")
    assert all(torch.equal(a, b) for a, b in zip(grads["torch_ext"], grads["stock"]))
    # gate, expert (2), dense (3) and the sum after the combine: no region holds a collective.
    assert len(regions) >= 6
    assert not any(is_collective(node) for region in regions for node in region.graph.nodes)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"matmuls_per_region": 0}, ValueError, "matmuls_per_region must be an int of at least 1, got 0"),
        ({"matmuls_per_region": True}, ValueError, "matmuls_per_region must be an int of at least 1, got True"),
        ({"inner": 5}, TypeError, "inner must be a backend name or callable, got 5"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        torch_ext.compile_backend(**kwargs)
