"""torch_ext: a reimplemented autograd engine for PyTorch, with control over backward order.

Importing torch_ext loads its C++ engine first and fails loudly (naming the torch it was built
for and the one it found) when that is not possible; see torch_ext/_loader.py.
"""


def _import_checkout_triton_kernels() -> None:
    """Imports the repository's top-level triton_kernels/ folder as ``torch_ext._triton_kernels`` when torch_ext
    runs from a checkout that does not have that name.

    setup.py installs the folder under that name (its package_dir), in a wheel and in an editable install, so
    that torch_ext takes no top-level name besides its own: PyPI's triton-kernels installs a ``triton_kernels``.
    """
    import importlib.util  # here, not at the top: torch_ext's namespace holds only its API
    import os
    import sys

    name = f"{__name__}._triton_kernels"
    if importlib.util.find_spec(name) is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "triton_kernels")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init):  # neither installed nor a checkout: torch_ext.kernels' import names the module
        return
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_import_checkout_triton_kernels()
del _import_checkout_triton_kernels

# First: installs the engine's host, Python's answers to its questions, before anything can run a backward.
from torch_ext import _host  # noqa: F401, I001 - imported for its installation

from torch_ext import (
    debug,
    verify,  # the module, callable: torch_ext.verify(step) is torch_ext.verify.verify(step)
)
from torch_ext.collectives import (
    check_collective_order,
    collective_role,
    register_collective_backward,
    run_in_lane,
    unregister_collective_backward,
)
from torch_ext.compiler import compile_backend
from torch_ext.engine import Engine, backward, disable, enable, grad, is_enabled
from torch_ext.microbatch_overlap import MicrobatchOverlap, overlap_microbatches
from torch_ext.priority import (
    LAUNCH_FIRST,
    clear_priority,
    get_priority,
    is_auto_collective_priority_enabled,
    launch_first,
    set_auto_collective_priority_enabled,
    set_priority,
)
from torch_ext.split import (
    SplitState,
    backward_input,
    backward_weight,
    get_weight_accumulation_batching,
    set_weight_accumulation_batching,
)
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
    "collective_role",
    "compile_backend",
    "debug",
    "disable",
    "enable",
    "get_priority",
    "get_weight_accumulation_batching",
    "grad",
    "is_auto_collective_priority_enabled",
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
