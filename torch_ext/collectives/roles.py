"""Which backward nodes are collectives: the ones torch_ext wrote, PyTorch's and other libraries'.

A collective's backward has up to two nodes that matter to the engine:

- a **launch** node starts the gradient communication. The engine drives to it first (the automatic
  collective priority, propagated to every node on a path from the roots to it, see
  :func:`torch_ext.set_auto_collective_priority`);
- a **wait** node blocks until that communication has finished. The engine runs it as late as the
  nodes reading its result allow, so everything else that is ready runs while the bytes move.

A synchronous collective (one node that sends and waits) is a launch with no wait: it can only be
started earlier.

Libraries that write their collectives as autograd Functions declare them with
:func:`register_collective_backward`, naming the *forward* Function classes by what their backward
node does. TorchRec's Req/Wait pairs swap roles in backward, so for its pooled all_to_all::

    from torchrec.distributed.comm_ops import All2All_Pooled_Req, All2All_Pooled_Wait
    torch_ext.register_collective_backward(launches=All2All_Pooled_Wait, waits=All2All_Pooled_Req)

(torch_ext already knows TorchRec's, so this is not needed there). A synchronous collective, whose
node sends and waits: ``register_collective_backward(launches=MyAllToAll)``.

Built in, without importing any of these libraries: torch_ext's own collective ops
(:mod:`torch_ext.ops`), PyTorch's functional collectives (``_c10d_functional`` and
``_c10d_functional_autograd`` ops), TorchRec's ``torchrec.distributed.comm_ops`` (every Req/Wait
pair, its synchronous ``AllToAllSingle`` and its ``torchrec::`` collective ops). A class is known
by identity, never by its name, once per class: the Function torch.library generates for an op's
autograd formula by the op its forward holds (looked up by the op's qualified name, read from the op
object), TorchRec's Functions as the objects its module defines, once it is imported.

The synchronous ``_AllToAll`` of Megatron-core (``megatron.core.tensor_parallel.mappings``) and DeepSpeed
(``deepspeed.moe.sharded_moe``) block inside their node, so starting them earlier gains nothing: they
keep stock's order until declared to a *lane* (:func:`torch_ext.run_in_lane`, role ``"lane"``), where
their node runs beside the rest of backward.

The engine decides a node class's role once, the first time it meets the class, and keeps it for as
long as the class lives: a registration wins over the built-in rules, and a later registration of
the same class replaces the earlier one, also while another thread runs backward (that backward
sees either). Registration is by exact class: a subclass of a registered Function is decided on its
own.
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from collections.abc import Iterable
from typing import Literal

import torch
from torch._library import autograd as _library_autograd
from torch.autograd.function import BackwardCFunction

from torch_ext._loader import _C

_NONE, _LAUNCH, _WAIT, _LANE = (_C.collective_roles[name] for name in ("none", "launch", "wait", "lane"))
_ROLE_NAMES = {_NONE: None, _LAUNCH: "launch", _WAIT: "wait", _LANE: "lane"}

# The ops whose torch.library autograd formula is a synchronous collective (its node sends and waits), by the op's
# qualified name, read from the op object (its schema's name, "namespace::op"; every overload): role, and whether
# the node hands its result to the engine in flight (torch_ext's own ops, which add themselves when they are
# registered: torch_ext/ops/collectives.py).
_COLLECTIVE_OPS: dict[str, tuple[int, bool]] = {
    # torchrec/distributed/comm_ops.py: their backward gathers or scatters and waits in the node.
    "torchrec::reduce_scatter_tensor": (_LAUNCH, False),
    "torchrec::all_gather_into_tensor": (_LAUNCH, False),
}
# PyTorch's functional collectives: every op of these namespaces with a formula launches (its formula issues the
# gradient collective and waits for it in the node), but wait_tensor, and the identity that turns a result into an
# AsyncCollectiveTensor. Both lie on the path to the collective they belong to, and so get its priority anyway.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _declare_collective_op(op: torch._ops.OpOverload, *, defers_wait: bool) -> None:
    """Makes the backward nodes of ``op`` (every overload) launches, as the built-in rules do: for torch_ext's own
    ops, at their registration."""
    _COLLECTIVE_OPS[op._schema.name] = (_LAUNCH, defers_wait)


def _op_kind(op: torch._ops.OpOverload) -> tuple[int, bool]:
    name = op._schema.name
    if name in _COLLECTIVE_OPS:
        return _COLLECTIVE_OPS[name]
    if op.namespace in _COLLECTIVE_NAMESPACES and op._opname not in _NOT_COLLECTIVES:
        return _LAUNCH, False
    return _NONE, False


# The code of the forward torch.library gives the autograd.Function it generates for an op's formula
# (torch/_library/autograd.py: make_autograd_impl's forward, and for an op with tensor lists supports_tensorlist's
# new_forward around it): a nested function's code object is a constant of the function that makes it. The class
# names its op only in a string, its __name__; its forward holds the op object itself, in its closure.
_GENERATED_FORWARD_CODE = frozenset(
    constant
    for maker in (_library_autograd.make_autograd_impl, _library_autograd.supports_tensorlist)
    for constant in maker.__code__.co_consts
    if isinstance(constant, types.CodeType)
)


def _generated_op(function: type) -> torch._ops.OpOverload | None:
    """The op whose torch.library autograd formula the Function class ``function`` was generated for, or None for
    any other Function: read from its forward's closure, by type (a wrapping forward closes over the one it wraps)."""
    forward = getattr(function, "forward", None)
    while isinstance(forward, types.FunctionType) and forward.__code__ in _GENERATED_FORWARD_CODE:
        captured = []
        for cell in forward.__closure__ or ():
            try:
                captured.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
        op = next((value for value in captured if isinstance(value, torch._ops.OpOverload)), None)
        if op is not None:
            return op
        forward = next((value for value in captured if isinstance(value, types.FunctionType)), None)
    return None


# TorchRec's Functions (torchrec/distributed/comm_ops.py), by their names in that module: what the backward node of
# each does. Its Req/Wait pairs: the forward Req launches and the forward Wait waits, so in backward the Wait's node
# launches the gradient collective (async_op=True, the Work stored in the shared Request) and the Req's node waits for
# it (myreq.req.wait()).
_TORCHREC_COMM_OPS = "torchrec.distributed.comm_ops"
_TORCHREC_FUNCTIONS: dict[str, int] = {
    **{
        name: role
        for req, wait in (
            ("All2All_Pooled_Req", "All2All_Pooled_Wait"),
            ("Variable_Batch_All2All_Pooled_Req", "Variable_Batch_All2All_Pooled_Wait"),
            ("All2All_Seq_Req", "All2All_Seq_Req_Wait"),
            ("All2Allv_Req", "All2Allv_Wait"),
            ("ReduceScatter_Req", "ReduceScatter_Wait"),
            ("ReduceScatterBase_Req", "ReduceScatterBase_Wait"),
            ("AllGatherBase_Req", "AllGatherBase_Wait"),
            ("ReduceScatterV_Req", "ReduceScatterV_Wait"),
        )
        for name, role in ((req, _WAIT), (wait, _LAUNCH))
    },
    # The *_sync paths (torchrec_use_sync_collectives): backward issues a functional all_to_all.
    "AllToAllSingle": _LAUNCH,
    # Not here: the mixture-of-experts token exchange of Megatron-core
    # (megatron.core.tensor_parallel.mappings._AllToAll) and DeepSpeed (deepspeed.moe.sharded_moe._AllToAll),
    # synchronous: backward runs the reverse all_to_all and returns when it has finished. Started earlier by
    # priority alone it gains nothing and cost 1.03-1.06x stock's backward (benchmarks/moe_sync), so it
    # keeps stock's order unless declared to a lane (torch_ext.run_in_lane), where it runs beside the rest.
}


@functools.cache
def _torchrec_function_roles(comm_ops: types.ModuleType) -> dict[type, int]:
    """TorchRec's Function classes -> their nodes' roles, the classes taken from the module (once it is imported: a
    class of it cannot exist before) and known by identity."""
    return {
        function: role
        for name, role in _TORCHREC_FUNCTIONS.items()
        if isinstance(function := getattr(comm_ops, name, None), type)
    }


def _builtin_kind(node_class: type) -> tuple[int, bool]:
    """The engine's question about a node class it meets for the first time (PythonHost, csrc/bindings/
    python_collectives.cpp): its role, and whether its node hands its result to the engine in flight."""
    function = getattr(node_class, "_forward_cls", None)
    if function is None:
        return _NONE, False
    op = _generated_op(function)
    if op is not None:
        return _op_kind(op)
    comm_ops = sys.modules.get(_TORCHREC_COMM_OPS)
    if comm_ops is None:
        return _NONE, False
    return _torchrec_function_roles(comm_ops).get(function, _NONE), False


FunctionClasses = type | Iterable[type]


def _node_classes(functions: FunctionClasses, argument: str, api: str) -> list[type]:
    """The backward node classes of ``functions``: Function subclasses or their ``_backward_cls``."""
    items = [functions] if isinstance(functions, type) else functions
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        items = [items]
    node_classes = []
    for item in items:
        if isinstance(item, type) and issubclass(item, torch.autograd.Function):
            if item is torch.autograd.Function or not hasattr(item, "_backward_cls"):
                raise ValueError(
                    f"torch_ext.{api}: {argument}: {item.__qualname__} has no backward node; pass a subclass of it"
                )
            node_classes.append(item._backward_cls)
        elif isinstance(item, type) and issubclass(item, BackwardCFunction) and item is not BackwardCFunction:
            node_classes.append(item)
        else:
            what = f"the class {item.__qualname__}" if isinstance(item, type) else f"a {type(item).__name__} object"
            if isinstance(item, torch.autograd.graph.Node):
                what += " (a backward node; pass its Function class)"
            raise TypeError(
                f"torch_ext.{api}: {argument} takes torch.autograd.Function subclasses (or their backward "
                f"node classes, Function._backward_cls), got {what}"
            )
    return node_classes


def register_collective_backward(*, launches: FunctionClasses = (), waits: FunctionClasses = ()) -> None:
    """Declares autograd Functions whose backward node launches a collective, or waits for one.

    Args:
        launches: Function classes (one, or several in an iterable) whose backward node starts
            gradient communication: the engine drives to it first. A synchronous collective (whose
            node also waits) goes here too.
        waits: Function classes whose backward node waits for communication a launch node started:
            the engine runs it as late as the nodes that read its result allow.

    Name the *forward* Function classes by what their *backward* node does: a Req/Wait pair that
    launches in forward's Req swaps roles in backward (``launches=Wait, waits=Req``). A backward
    node class (``Function._backward_cls``) is accepted too. A registration replaces any earlier
    one, and torch_ext's built-in knowledge, for exactly these classes.
    """
    api = "register_collective_backward"
    launch_classes = _node_classes(launches, "launches", api)
    wait_classes = _node_classes(waits, "waits", api)
    if not launch_classes and not wait_classes:
        raise ValueError(f"torch_ext.{api}: give at least one Function class in launches= or waits=")
    both = set(launch_classes) & set(wait_classes)
    if both:
        names = ", ".join(sorted(node_class._forward_cls.__qualname__ for node_class in both))
        raise ValueError(f"torch_ext.{api}: {names} cannot both launch and wait")
    for node_class in launch_classes:
        _set_role(node_class, _LAUNCH)
    for node_class in wait_classes:
        _set_role(node_class, _WAIT)


def _set_role(node_class: type, role: int) -> None:
    """Registers ``node_class``'s role. Whether its node hands its result over in flight stays the built-in rules'
    answer: that is what its formula does, not something declared."""
    _C.set_collective_role(node_class, role, _builtin_kind(node_class)[1])


def _is_op(item: object) -> bool:
    return isinstance(item, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _overload(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> torch._ops.OpOverload:
    return op.default if isinstance(op, torch._ops.OpOverloadPacket) else op


@functools.cache
def _generated_function(op: torch._ops.OpOverload, api: str) -> type:
    """The autograd Function torch.library.register_autograd generated for ``op`` (an OpOverload, or a packet's
    default), found among live classes by the op its forward holds (:func:`_generated_op`): it is held only by the
    op's autograd kernel, for good, so the scan (tens of ms) is made once per op."""
    # issubclass(type(...)): isinstance would ask every object for its __class__, which some answer with a warning.
    found = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), type) and issubclass(obj, torch.autograd.Function) and _generated_op(obj) is op
    ]
    if not found:
        raise ValueError(
            f"torch_ext.{api}: {op} has no autograd formula registered with torch.library.register_autograd "
            "(for PyTorch's functional collectives, import torch.distributed._functional_collectives first)"
        )
    return found[-1]


def unregister_collective_backward(*functions: type | torch._ops.OpOverload) -> None:
    """Treats the backward nodes of ``functions`` (Function classes) as ordinary nodes from now on; for an op
    declared with :func:`torch_ext.run_in_lane`, gives its backward node back its built-in role.

    Also overrides torch_ext's built-in knowledge: ``unregister_collective_backward(All2All_Pooled_Wait,
    All2All_Pooled_Req)`` leaves TorchRec's pooled all_to_all in stock order.
    """
    api = "unregister_collective_backward"
    node_classes = _node_classes([f for f in functions if not _is_op(f)], "functions", api)
    ops = [_generated_function(_overload(f), api)._backward_cls for f in functions if _is_op(f)]
    if not node_classes and not ops:
        raise ValueError(f"torch_ext.{api}: give at least one Function class")
    for node_class in node_classes:
        _set_role(node_class, _NONE)
    for node_class in ops:
        _C.set_collective_role(node_class, *_builtin_kind(node_class))


def collective_role(
    target: torch.Tensor | torch.autograd.graph.Node | type,
) -> Literal["launch", "wait", "lane"] | None:
    """What the engine takes ``target``'s backward node for: ``"launch"``, ``"wait"``, ``"lane"`` or None.

    ``target`` is a tensor (its ``grad_fn``), a backward node, or a Function class (its backward node
    class).
    """
    api = "collective_role"
    if isinstance(target, torch.Tensor):
        target = target.grad_fn
        if target is None:
            return None
    if isinstance(target, type):
        (node_class,) = _node_classes(target, "target", api)
        return _ROLE_NAMES[_C.collective_role(node_class)]
    if not isinstance(target, torch.autograd.graph.Node):
        raise TypeError(
            f"torch_ext.{api}: expected a Tensor, a torch.autograd.graph.Node or a Function class, "
            f"got {type(target).__name__}"
        )
    if not isinstance(target, torch._C._FunctionBase):
        return None  # a C++ node: never a collective
    return _ROLE_NAMES[_C.collective_role(target)]
