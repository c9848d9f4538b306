"""Which nodes are collectives (torch_ext.collectives.roles): built-in rules, registration, its errors, the cache.

Single process: the "collectives" here are Functions that move no bytes, so these tests are about the
registry and the order the engine gives the nodes; tests/distributed/test_torchrec.py has real ones.
"""

import gc
import importlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engine_helpers import generated_node_class, graph_nodes, recsys_like
from torch.autograd.function import BackwardCFunction

import torch_ext
from torch_ext import _C
from torch_ext.testing import assert_identical

COLLECTIVE_PRIORITY = _C.collective_priority


def _identity_function(name: str) -> type:
    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(lambda ctx, x: x.clone()), "backward": staticmethod(lambda ctx, grad: grad)},
    )


def _req_wait_pair():
    """A fresh Req/Wait pair of identity Functions, shaped like TorchRec's (new classes each call)."""
    return _identity_function("Req"), _identity_function("Wait")


# Where each namespace's autograd formulas are registered.
_REGISTERED_BY = {
    "torch_ext": "torch_ext.ops",
    "_c10d_functional": "torch.distributed._functional_collectives",
    "_c10d_functional_autograd": "torch.distributed._functional_collectives",
    "torchrec": "torchrec.distributed.comm_ops",
    "torch_ext_test": "engine_helpers",
}


@pytest.mark.parametrize(
    "op, role",
    [
        ("torch_ext::all_to_all_single", "launch"),
        ("torch_ext::all_reduce", "launch"),
        ("torch_ext::all_reduce_coalesced", "launch"),  # a list op: its Function is wrapped
        ("torch_ext::reduce_scatter_tensor", "launch"),
        ("torch_ext::all_gather_into_tensor", "launch"),
        ("_c10d_functional::all_to_all_single", "launch"),
        ("_c10d_functional::all_reduce_coalesced", "launch"),
        ("_c10d_functional_autograd::reduce_scatter_tensor", "launch"),
        ("_c10d_functional::wait_tensor", None),
        ("_c10d_functional::_wrap_tensor_autograd", None),
        ("torchrec::reduce_scatter_tensor", "launch"),
        ("torchrec::_split_1d_cat_2d", None),
        ("torch_ext_test::all_to_all_single", None),  # named like a collective: the name says nothing
    ],
)
def test_builtin_role_of_a_generated_op_class(op, role):
    """The class torch.library generated for each op's formula, known by the op its forward holds."""
    namespace, name = op.split("::")
    if namespace == "torchrec":
        pytest.importorskip(_REGISTERED_BY[namespace], reason="TorchRec is not installed")
    importlib.import_module(_REGISTERED_BY[namespace])
    overload = getattr(getattr(torch.ops, namespace), name).default
    assert torch_ext.collective_role(generated_node_class(overload)) == role


def test_a_class_named_as_generated_is_no_collective():
    """Only the class torch.library made for a collective's op is one, not another with its name."""
    import torch.distributed._functional_collectives  # registers the formulas

    real = generated_node_class(torch.ops._c10d_functional.all_to_all_single.default)
    impostor = type(real.__name__, (BackwardCFunction,), {"_forward_cls": type(real._forward_cls.__name__, (), {})})
    assert torch_ext.collective_role(real) == "launch"
    assert torch_ext.collective_role(impostor) is None


def test_torchrec_comm_ops_roles():
    comm_ops = pytest.importorskip("torchrec.distributed.comm_ops", reason="TorchRec is not installed")
    functions = {
        name: value
        for name, value in vars(comm_ops).items()
        if isinstance(value, type)
        and issubclass(value, torch.autograd.Function)
        and value.__module__ == comm_ops.__name__
    }
    # Backward swaps the forward roles: each pair's Wait node launches, its Req node waits.
    expected = {
        name: "launch"
        if name.endswith("_Wait") or name == "AllToAllSingle"
        else "wait"
        if name.endswith("_Req")
        else None
        for name in functions
    }
    assert {name: torch_ext.collective_role(function) for name, function in functions.items()} == expected
    assert list(expected.values()).count("wait") == 8, expected


@pytest.mark.parametrize(
    "module", ["megatron.core.tensor_parallel.mappings", "deepspeed.moe.sharded_moe", "my_library.moe"]
)
def test_a_synchronous_all_to_all_keeps_stock_order_until_declared_to_a_lane(module):
    # A stand-in with the library's module and name (which no rule reads). Megatron's and DeepSpeed's block in their
    # node, so priority alone would gain nothing: no built-in role.
    _AllToAll = type("_AllToAll", (torch.autograd.Function,), {"__module__": module})
    assert torch_ext.collective_role(_AllToAll) is None
    torch_ext.run_in_lane(_AllToAll)
    assert torch_ext.collective_role(_AllToAll) == "lane"
    torch_ext.unregister_collective_backward(_AllToAll)
    assert torch_ext.collective_role(_AllToAll) is None


@pytest.mark.slow
def test_importing_torch_ext_imports_no_collective_library():
    code = "import sys, torch_ext; print(sorted(m for m in ('torchrec', 'megatron', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registered_roles_by_function_node_class_tensor_and_node():
    Req, Wait = _req_wait_pair()
    x = torch.randn(3, requires_grad=True)
    requested = Req.apply(x)
    waited = Wait.apply(requested)
    assert [torch_ext.collective_role(t) for t in (Req, Wait, requested, waited.grad_fn)] == [None] * 4
    torch_ext.register_collective_backward(launches=Wait, waits=[Req._backward_cls])
    assert [torch_ext.collective_role(t) for t in (Req, Wait, requested, waited.grad_fn)] == [
        "wait",
        "launch",
        "wait",
        "launch",
    ]
    assert torch_ext.collective_role(x) is None and torch_ext.collective_role((x * 2).grad_fn) is None


def test_registration_replaces_and_unregister_overrides_builtin():
    Req, Wait = _req_wait_pair()
    torch_ext.register_collective_backward(launches=[Req, Wait])
    torch_ext.register_collective_backward(waits=Req)
    assert (torch_ext.collective_role(Req), torch_ext.collective_role(Wait)) == ("wait", "launch")
    torch_ext.unregister_collective_backward(Req, Wait)
    assert (torch_ext.collective_role(Req), torch_ext.collective_role(Wait)) == (None, None)
    declared = generated_node_class(torch.ops.torch_ext_test.exchange.default)
    assert torch_ext.collective_role(declared) == "launch"
    torch_ext.unregister_collective_backward(declared)
    assert torch_ext.collective_role(declared) is None
    # An op's class is given back its built-in role.
    torch_ext.unregister_collective_backward(torch.ops.torch_ext_test.exchange)
    assert torch_ext.collective_role(declared) == "launch"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({}, ValueError, "give at least one Function class in launches= or waits="),
        ({"launches": 3}, TypeError, "launches takes torch.autograd.Function subclasses (or their backward "),
        ({"waits": "All2All_Pooled_Req"}, TypeError, "got a str object"),
        ({"launches": torch.nn.Linear}, TypeError, "got the class Linear"),
        ({"launches": torch.autograd.Function}, ValueError, "Function has no backward node; pass a subclass of it"),
        ({"launches": BackwardCFunction}, TypeError, "got the class BackwardCFunction"),
        ({"launches": [torch.autograd.graph.Node]}, TypeError, "got the class Node"),
    ],
)
def test_registration_errors(kwargs, error, message):
    with pytest.raises(error, match="^torch_ext.register_collective_backward: ") as raised:
        torch_ext.register_collective_backward(**kwargs)
    assert message in str(raised.value)


def test_registration_error_for_a_node_and_for_both_roles():
    Req, Wait = _req_wait_pair()
    node = Req.apply(torch.randn(2, requires_grad=True)).grad_fn
    with pytest.raises(TypeError, match="got a ReqBackward object \\(a backward node; pass its Function class\\)"):
        torch_ext.register_collective_backward(launches=node)
    with pytest.raises(ValueError, match="Req cannot both launch and wait"):
        torch_ext.register_collective_backward(launches=[Req, Wait], waits=Req)
    # Nothing was registered by the failed calls.
    assert torch_ext.collective_role(Wait) is None
    with pytest.raises(ValueError, match="^torch_ext.unregister_collective_backward: give at least one"):
        torch_ext.unregister_collective_backward()
    with pytest.raises(TypeError, match="expected a Tensor, a torch.autograd.graph.Node or a Function class"):
        torch_ext.collective_role(3)


def _names(events):
    return [event["name"] for event in events if event["kind"] == "node"]


def test_launch_gets_the_collective_priority_and_stock_bits():
    Req, Wait = _req_wait_pair()
    torch_ext.register_collective_backward(launches=Wait, waits=Req)

    def exchange(lookup):
        return Wait.apply(Req.apply(lookup))

    loss, _, _, _, leaves = recsys_like(exchange=exchange)
    torch.autograd.backward(loss)
    stock = [leaf.grad for leaf in leaves]
    loss, _, _, _, leaves = recsys_like(exchange=exchange)
    with torch_ext.trace() as trace:
        torch_ext.backward(loss)
    assert_identical([leaf.grad for leaf in leaves], stock, "gradients")
    (launch,) = [event for event in trace.events if event["name"] == "WaitBackward"]
    assert (launch["priority"], launch["priority_from"], launch["collective"]) == (
        COLLECTIVE_PRIORITY,
        "collective",
        True,
    )
    # Driven to first: the dense path (ReluBackward0) runs after it.
    names = _names(trace.events)
    assert names.index("WaitBackward") < names.index("ReluBackward0")


def test_dead_class_leaves_the_cache():
    Req, Wait = _req_wait_pair()
    torch_ext.register_collective_backward(launches=Wait)
    assert torch_ext.collective_role(Req) is None  # decided and cached too
    gc.collect()
    size = _C._collective_role_cache_size()
    del Req, Wait
    gc.collect()
    assert _C._collective_role_cache_size() == size - 2


def test_many_classes_grow_the_cache():
    pairs = [_req_wait_pair() for _ in range(300)]
    for index, (Req, Wait) in enumerate(pairs):
        if index % 2:
            torch_ext.register_collective_backward(launches=Wait, waits=Req)
    for index, (Req, Wait) in enumerate(pairs):
        expected = ("wait", "launch") if index % 2 else (None, None)
        assert (torch_ext.collective_role(Req), torch_ext.collective_role(Wait)) == expected


def test_registering_while_another_thread_runs_backward():
    Req, Wait = _req_wait_pair()

    def exchange(lookup):
        return Wait.apply(Req.apply(lookup))

    loss, _, _, _, leaves = recsys_like(exchange=exchange)
    torch.autograd.backward(loss)
    stock = [leaf.grad for leaf in leaves]

    def run_backwards():
        for _ in range(50):
            loss, _, _, _, leaves = recsys_like(exchange=exchange)
            torch_ext.backward(loss)
            assert_identical([leaf.grad for leaf in leaves], stock, "gradients")

    with ThreadPoolExecutor(max_workers=1) as pool:
        backwards = pool.submit(run_backwards)
        for index in range(200):
            if index % 2:
                torch_ext.register_collective_backward(launches=Wait, waits=Req)
            else:
                torch_ext.unregister_collective_backward(Wait, Req)
            # New classes: the cache grows and copies itself while the other thread reads it.
            torch_ext.collective_role(_req_wait_pair()[0])
        backwards.result()


def test_graph_nodes_of_a_pair_are_what_discovery_sees():
    # collective_role on a node agrees with the class: the engine's question is per class.
    Req, Wait = _req_wait_pair()
    torch_ext.register_collective_backward(launches=Wait, waits=Req)
    out = Wait.apply(Req.apply(torch.randn(2, requires_grad=True)))
    roles = {node.name(): torch_ext.collective_role(node) for node in graph_nodes([out])}
    assert roles == {"WaitBackward": "launch", "ReqBackward": "wait", "torch::autograd::AccumulateGrad": None}
