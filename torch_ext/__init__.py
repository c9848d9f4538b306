"""torch_ext: a reimplemented autograd engine for PyTorch, with control over backward order.

Importing torch_ext loads its C++ engine first and fails loudly (naming the torch it was built
for and the one it found) when that is not possible; see torch_ext/_loader.py.
"""

from torch_ext.engine import Engine, backward, disable, enable, enabled, grad, is_enabled

__all__ = ["Engine", "backward", "disable", "enable", "enabled", "grad", "is_enabled"]
