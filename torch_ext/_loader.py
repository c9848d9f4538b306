"""Loads the compiled engine, failing loudly when it does not match the torch in use, and reads the switches.

Every module of torch_ext takes the engine from here, ``from torch_ext._loader import _C``, and reads an
on/off environment switch with :func:`switch_on`.
"""

import importlib
import json
import os

import torch

# Written by setup.py beside the compiled engine. Read by path, not imported: an editable install's
# import hook resolves torch_ext's submodules from the source tree it was installed from, which
# would hide a copy's missing or different file.
BUILD_INFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")


def _built_for() -> str | None:
    try:
        with open(BUILD_INFO) as f:
            return json.load(f)["torch_version"]
    except FileNotFoundError:
        return None


# torch_ext's on/off environment switches, each with what unset (or empty) means. Every one is checked when
# torch_ext is imported, so a mistyped value fails there, naming the variable, whichever module reads it.
#
# TORCH_EXT_CURRENT_NODE: on makes each node the current autograd node while it runs where that can be done
# safely; off forces the portable path (torch_ext.debug.is_current_node_supported()).
CURRENT_NODE_VARIABLE = "TORCH_EXT_CURRENT_NODE"
# TORCH_EXT_PLAN_CACHE: on replays a backward plan on later calls of the same graph structure
# (csrc/engine/plan/plan_cache.h); off plans every call afresh.
PLAN_CACHE_VARIABLE = "TORCH_EXT_PLAN_CACHE"
# TORCH_EXT_TRITON: on runs torch_ext.kernels' ops on CUDA through their Triton kernels; off, the references.
TRITON_VARIABLE = "TORCH_EXT_TRITON"
# TORCH_EXT_CHECK_COLLECTIVES: on switches the collective order check on (torch_ext.check_collective_order).
CHECK_COLLECTIVES_VARIABLE = "TORCH_EXT_CHECK_COLLECTIVES"
SWITCH_DEFAULTS = {
    CURRENT_NODE_VARIABLE: True,
    PLAN_CACHE_VARIABLE: True,
    TRITON_VARIABLE: True,
    CHECK_COLLECTIVES_VARIABLE: False,
}
SWITCH_VALUES = ("on", "off", "1", "0")


def switch_on(variable: str) -> bool:
    """Whether the environment switch ``variable`` (one of :data:`SWITCH_DEFAULTS`) is on.

    ``on`` or ``1`` is on, ``off`` or ``0`` off, unset or empty its default; any other value raises ValueError.
    """
    value = os.environ.get(variable, "")
    if value == "":
        return SWITCH_DEFAULTS[variable]
    if value not in SWITCH_VALUES:
        raise ValueError(f"{variable} must be one of {SWITCH_VALUES}, got {value!r}")
    return value in ("on", "1")


def _load_extension():
    """The compiled engine, ``torch_ext._C``, once its build is checked against the torch in use."""
    switches = {variable: switch_on(variable) for variable in SWITCH_DEFAULTS}
    built_for = _built_for()
    found = torch.__version__
    if built_for is None:
        raise ImportError(
            f"torch_ext's C++ engine is not built ({BUILD_INFO} is missing). "
            "Install with: pip install --no-build-isolation -e ."
        )
    if built_for != found:
        raise ImportError(
            f"torch_ext was built for torch {built_for} but torch {found} is installed. "
            "Rebuild torch_ext against this torch (pip install --no-build-isolation -e .) "
            f"or install torch=={built_for.split('+')[0]}."
        )
    try:
        extension = importlib.import_module("torch_ext._C")
    except ImportError as e:
        raise ImportError(
            f"torch_ext's C++ engine (built for torch {built_for}, found torch {found}) failed to load: {e}"
        ) from e
    # The one parse of TORCH_EXT_CURRENT_NODE: the engine is told, not left to read the variable itself.
    extension._set_current_node_forced_off(not switches[CURRENT_NODE_VARIABLE])
    if not switches[PLAN_CACHE_VARIABLE]:
        extension._set_plan_cache(False)
    return extension


_C = _load_extension()
