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
CURRENT_NODE_MODES = ("on", "off")


def _check_current_node_mode() -> None:
    mode = os.environ.get(CURRENT_NODE_VARIABLE, "on")
    if mode not in CURRENT_NODE_MODES:
        raise ValueError(f"{CURRENT_NODE_VARIABLE} must be one of {CURRENT_NODE_MODES}, got {mode!r}")


# TORCH_EXT_PLAN_CACHE: "on" (the default) replays a backward plan on later calls of the same graph
# structure (csrc/plan_cache.h); "off" plans every call afresh.
PLAN_CACHE_VARIABLE = "TORCH_EXT_PLAN_CACHE"
PLAN_CACHE_MODES = ("on", "off")


def _plan_cache_mode() -> str:
    mode = os.environ.get(PLAN_CACHE_VARIABLE, "on")
    if mode not in PLAN_CACHE_MODES:
        raise ValueError(f"{PLAN_CACHE_VARIABLE} must be one of {PLAN_CACHE_MODES}, got {mode!r}")
    return mode


def load_extension():
    _check_current_node_mode()
    plan_cache_on = _plan_cache_mode() == "on"
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
    if not plan_cache_on:
        extension._set_plan_cache(False)
    return extension
