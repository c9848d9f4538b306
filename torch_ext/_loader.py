"""Loads the compiled engine, failing loudly when it does not match the torch in use."""

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


# TORCH_EXT_CURRENT_NODE: "on" (the default) makes each node the current autograd node while it runs
# where that can be done safely; "off" forces the portable path (torch_ext.current_node_supported()).
CURRENT_NODE_VARIABLE = "TORCH_EXT_CURRENT_NODE"
# TORCH_EXT_PLAN_CACHE: "on" (the default) replays a backward plan on later calls of the same graph
# structure (csrc/engine/plan/plan_cache.h); "off" plans every call afresh.
PLAN_CACHE_VARIABLE = "TORCH_EXT_PLAN_CACHE"
SWITCH_MODES = ("on", "off")


def _switch(variable: str) -> bool:
    """Whether the on/off environment switch ``variable`` is on (the default); any other value is an error."""
    mode = os.environ.get(variable, "on")
    if mode not in SWITCH_MODES:
        raise ValueError(f"{variable} must be one of {SWITCH_MODES}, got {mode!r}")
    return mode == "on"


def load_extension():
    current_node_on = _switch(CURRENT_NODE_VARIABLE)
    plan_cache_on = _switch(PLAN_CACHE_VARIABLE)
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
    if not current_node_on:
        extension._set_current_node_forced_off(True)
    if not plan_cache_on:
        extension._set_plan_cache(False)
    return extension
