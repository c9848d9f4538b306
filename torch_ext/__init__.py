"""torch_ext: a reimplemented autograd engine for PyTorch, with control over backward order.

Importing torch_ext loads its C++ engine first and fails loudly (naming the torch it was built
for and the one it found) when that is not possible; see torch_ext/_loader.py.
"""

from torch_ext.collective_check import check_collective_order, collective_checks
from torch_ext.collectives import collective_role, register_collective_backward, unregister_collective_backward
from torch_ext.current_node import current_node_supported
from torch_ext.engine import Engine, backward, disable, enable, enabled, grad, is_enabled
from torch_ext.lanes import run_in_lane
from torch_ext.order import execution_order
from torch_ext.priority import (
    LAUNCH_FIRST,
    auto_collective_priority,
    clear_priority,
    get_priority,
    launch_first,
    set_auto_collective_priority,
    set_priority,
)
from torch_ext.split import (
    SplitState,
    backward_input,
    backward_weight,
    set_weight_accumulation_batching,
    weight_accumulation_batching,
)
from torch_ext.tracing import Trace, trace
from torch_ext.verify import VerifyReport, verify  # torch_ext.verify is the function; the module is in sys.modules

__all__ = [
    "LAUNCH_FIRST",
    "Engine",
    "SplitState",
    "Trace",
    "VerifyReport",
    "auto_collective_priority",
    "backward",
    "backward_input",
    "backward_weight",
    "check_collective_order",
    "clear_priority",
    "collective_checks",
    "collective_role",
    "current_node_supported",
    "disable",
    "enable",
    "enabled",
    "execution_order",
    "get_priority",
    "grad",
    "is_enabled",
    "kernels",
    "launch_first",
    "ops",
    "register_collective_backward",
    "run_in_lane",
    "set_auto_collective_priority",
    "set_priority",
    "set_weight_accumulation_batching",
    "trace",
    "unregister_collective_backward",
    "verify",
    "weight_accumulation_batching",
]


def __getattr__(name: str):
    # Submodules imported on first use. torch_ext.kernels: registering its ops imports torch._inductor
    # when triton is installed (torch.library.triton_op), about 2 s here on top of torch's 3 s.
    # torch_ext.ops registers the collective ops and imports torch.distributed.
    if name in ("kernels", "ops"):
        import importlib

        return importlib.import_module(f"torch_ext.{name}")
    raise AttributeError(f"module 'torch_ext' has no attribute {name!r}")
