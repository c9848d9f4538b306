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
pair, its synchronous ``AllToAllSingle`` and its ``torchrec::`` collective ops). They are matched by
the module and name of the forward Function class, once per class.

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
from collections.abc import Iterable
from typing import Literal

import torch
from torch.autograd.function import BackwardCFunction

from torch_ext._loader import _C

_NONE, _LAUNCH, _WAIT, _LANE = (_C.collective_roles[name] for name in ("none", "launch", "wait", "lane"))
_ROLE_NAMES = {_NONE: None, _LAUNCH: "launch", _WAIT: "wait", _LANE: "lane"}

# torch.library.register_autograd names the Function class it generates
# "GeneratedBackwardFor_{namespace}_{op}_{overload}"; its node class adds "Backward"
# (torch/_library/autograd.py).
_GENERATED = "GeneratedBackwardFor_"
# Namespace -> op names (each followed by "_{overload}") whose backward is a synchronous collective.
# None: every op of the namespace but _GENERATED_NOT_COLLECTIVES.
_COLLECTIVE_OPS: dict[str, tuple[str, ...] | None] = {
    # Also matches _c10d_functional_autograd_.
    "_c10d_functional_": None,
    # "all_reduce_" also covers all_reduce_coalesced.
    "torch_ext_": ("all_to_all_single_", "all_reduce_", "reduce_scatter_tensor_", "all_gather_into_tensor_"),
    # torchrec/distributed/comm_ops.py: their backward gathers or scatters and waits in the node.
    "torchrec_": ("reduce_scatter_tensor_", "all_gather_into_tensor_"),
}
# Ops of _c10d_functional that are no collectives: wait_tensor, and the identity that turns a result
# into an AsyncCollectiveTensor. Both lie on the path to the collective they belong to, and so get
# its priority anyway.
_GENERATED_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")

_TORCHREC_COMM_OPS = "torchrec.distributed.comm_ops"
# (module, Function qualname) -> what that Function's backward node does. TorchRec's Req/Wait pairs
# (torchrec/distributed/comm_ops.py): the forward Req launches and the forward Wait waits, so in
# backward the Wait's node launches the gradient collective (async_op=True, the Work stored in the
# shared Request) and the Req's node waits for it (myreq.req.wait()).
_KNOWN_FUNCTIONS: dict[tuple[str, str], int] = {
    **{
        (_TORCHREC_COMM_OPS, name): role
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
    (_TORCHREC_COMM_OPS, "AllToAllSingle"): _LAUNCH,
    # Not here: the mixture-of-experts token exchange of Megatron-core
    # (megatron.core.tensor_parallel.mappings._AllToAll) and DeepSpeed (deepspeed.moe.sharded_moe._AllToAll),
    # synchronous: backward runs the reverse all_to_all and returns when it has finished. Started earlier by
    # priority alone it gains nothing and cost 1.03-1.06x stock's backward (benchmarks/moe_sync.py), so it
    # keeps stock's order unless declared to a lane (torch_ext.run_in_lane), where it runs beside the rest.
}


def _generated_op_role(op: str) -> int:
    for namespace, ops in _COLLECTIVE_OPS.items():
        if op.startswith(namespace):
            op = op[len(namespace) :]
            if ops is None:
                return _NONE if any(name in op for name in _GENERATED_NOT_COLLECTIVES) else _LAUNCH
            return _LAUNCH if op.startswith(ops) else _NONE
    return _NONE


def _builtin_role(node_class: type) -> int:
    """The engine's question about a node class it meets for the first time (csrc/bindings/python_collectives.cpp)."""
    name = node_class.__name__
    if name.startswith(_GENERATED):
        return _generated_op_role(name[len(_GENERATED) :])
    function = getattr(node_class, "_forward_cls", None)
    if function is None:
        return _NONE
    return _KNOWN_FUNCTIONS.get((function.__module__, function.__qualname__), _NONE)


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
        _C.set_collective_role(node_class, _LAUNCH)
    for node_class in wait_classes:
        _C.set_collective_role(node_class, _WAIT)


def _is_op(item: object) -> bool:
    return isinstance(item, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _overload(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> torch._ops.OpOverload:
    return op.default if isinstance(op, torch._ops.OpOverloadPacket) else op


@functools.cache
def _generated_function(op: torch._ops.OpOverload, api: str) -> type:
    """The autograd Function torch.library.register_autograd generated for ``op`` (an OpOverload, or a packet's
    default), found among live classes by the name it gives it (torch/_library/autograd.py): it is held only by
    the op's autograd kernel, for good, so the scan (tens of ms) is made once per op."""
    name = f"GeneratedBackwardFor_{op._namespace}_{op._opname}_{op._overloadname}"
    # issubclass(type(...)): isinstance would ask every object for its __class__, which some answer with a warning.
    found = [obj for obj in gc.get_objects() if issubclass(type(obj), type) and obj.__name__ == name]
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
        _C.set_collective_role(node_class, _NONE)
    for node_class in ops:
        _C.set_collective_role(node_class, _builtin_role(node_class))


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
