"""torch_ext: a reimplemented autograd engine for PyTorch, with control over backward order.

Importing torch_ext loads its C++ engine first and fails loudly (naming the torch it was built
for and the one it found) when that is not possible; see torch_ext/_loader.py.
"""

from torch_ext.engine import Engine, backward, disable, enable, enabled, grad, is_enabled
from torch_ext.priority import LAUNCH_FIRST, clear_priority, get_priority, launch_first, set_priority


def __getattr__(name):
    # torch_ext.kernels is imported on first use: registering its ops imports torch._inductor when triton is
    # installed (torch.library.triton_op), about 2 s here on top of torch's 3 s.
    if name == "kernels":
        import torch_ext.kernels

        return torch_ext.kernels
    raise AttributeError(f"module 'torch_ext' has no attribute {name!r}")


__all__ = [
    "LAUNCH_FIRST",
    "Engine",
    "backward",
    "clear_priority",
    "disable",
    "enable",
    "enabled",
    "get_priority",
    "grad",
    "is_enabled",
    "kernels",
    "launch_first",
    "set_priority",
]
