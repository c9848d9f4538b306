"""The one way torch_ext's engine reaches Python: its host, installed once, when torch_ext is imported.

The engine asks its host what only Python knows (``csrc/engine/host_interface.h``): which node classes are
collectives, the process group a lane node's collective runs on, a group's twin, the collective order check's
verdicts. torch_ext's import makes one host from the Python functions that answer and installs it,
``torch_ext._C.install_host``, as stock's ``torch._C`` installs its Python engine
(``torch/csrc/autograd/python_engine.cpp``). The host holds these functions; no C++ imports a Python module, and
no module hands the engine a function as a side effect of its own import. What changes at run time, the order
check's checker, is a call on the host (``_C.set_collective_checker``).
"""

from __future__ import annotations

import torch

from torch_ext._loader import _C, CHECK_COLLECTIVES_VARIABLE, switch_on
from torch_ext.collectives import lanes, order_check, roles


class _PythonNodeProbe(torch.autograd.Function):
    """Its node shows the host what a Python Function's node is (collectives' nodes are such): its C++ type is not
    exported by libtorch_python."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _twin_group_name(group_name: str) -> str:
    """The registered name of the twin of the group registered as ``group_name`` (torch_ext.collectives.twin_groups),
    for a backward beside the next microbatch's forward."""
    # Imported at the first twin, where it always was: its import registers the twins' atexit cleanup, whose place
    # among the exit handlers (the last registered runs first) this keeps.
    from torch_ext.collectives.twin_groups import TWINS

    return TWINS.name_of(group_name)


def _install() -> None:
    with torch.enable_grad():
        probe = _PythonNodeProbe.apply(torch.zeros((), requires_grad=True))
    _C.install_host(
        node_class_kind=roles._builtin_kind,
        lane_group=lanes._lane_group,
        twin_group_name=_twin_group_name,
        python_node=probe.grad_fn,
    )


_install()

if switch_on(CHECK_COLLECTIVES_VARIABLE):
    order_check.check_collective_order()
