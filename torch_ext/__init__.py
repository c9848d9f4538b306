"""torch_ext: a reimplemented autograd engine for PyTorch, with control over backward order.

Importing torch_ext loads its C++ engine first and fails loudly (naming the torch it was built
for and the one it found) when that is not possible; see torch_ext/_loader.py.
"""

# The names outside __all__ are deprecated, kept for one release (torch_ext._api): each warns, naming its
# replacement.
from torch_ext import verify  # the module, callable: torch_ext.verify(step) is torch_ext.verify.verify(step)
from torch_ext.collectives import (
    check_collective_order,
    collective_check_count,
    collective_role,
    register_collective_backward,
    run_in_lane,
    unregister_collective_backward,
)
from torch_ext.collectives import collective_checks as collective_checks
from torch_ext.compiler import compile_backend
from torch_ext.current_node import current_node_supported as current_node_supported
from torch_ext.current_node import is_current_node_supported
from torch_ext.engine import Engine, backward, disable, enable, grad, is_enabled
from torch_ext.engine import enabled as enabled
from torch_ext.microbatch_overlap import MicrobatchOverlap, overlap_microbatches
from torch_ext.order import execution_order
from torch_ext.priority import (
    LAUNCH_FIRST,
    clear_priority,
    get_priority,
    is_auto_collective_priority_enabled,
    launch_first,
    set_auto_collective_priority_enabled,
    set_priority,
)
from torch_ext.priority import auto_collective_priority as auto_collective_priority
from torch_ext.priority import set_auto_collective_priority as set_auto_collective_priority
from torch_ext.split import (
    SplitState,
    backward_input,
    backward_weight,
    get_weight_accumulation_batching,
    set_weight_accumulation_batching,
)
from torch_ext.split import weight_accumulation_batching as weight_accumulation_batching
from torch_ext.tracing import Trace, trace
from torch_ext.verify import VerifyReport

__all__ = [
    "LAUNCH_FIRST",
    "Engine",
    "MicrobatchOverlap",
    "SplitState",
    "Trace",
    "VerifyReport",
    "backward",
    "backward_input",
    "backward_weight",
    "check_collective_order",
    "clear_priority",
    "collective_check_count",
    "collective_role",
    "compile_backend",
    "disable",
    "enable",
    "execution_order",
    "get_priority",
    "get_weight_accumulation_batching",
    "grad",
    "is_auto_collective_priority_enabled",
    "is_current_node_supported",
    "is_enabled",
    "kernels",
    "launch_first",
    "ops",
    "overlap_microbatches",
    "register_collective_backward",
    "run_in_lane",
    "set_auto_collective_priority_enabled",
    "set_priority",
    "set_weight_accumulation_batching",
    "trace",
    "unregister_collective_backward",
    "verify",
]


def __getattr__(name: str):
    # Submodules imported on first use. torch_ext.kernels: registering its ops imports torch._inductor
    # when triton is installed (torch.library.triton_op), about 2 s here on top of torch's 3 s.
    # torch_ext.ops registers the collective ops and imports torch.distributed.
    if name in ("kernels", "ops"):
        import importlib

        return importlib.import_module(f"torch_ext.{name}")
    raise AttributeError(f"module 'torch_ext' has no attribute {name!r}")
