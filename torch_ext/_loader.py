"""Loads the compiled engine, failing loudly when it does not match the torch in use."""

import importlib

import torch


def _built_for() -> str | None:
    try:
        from torch_ext._build_info import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


def load_extension():
    built_for = _built_for()
    found = torch.__version__
    if built_for is None:
        raise ImportError(
            "torch_ext's C++ engine is not built (torch_ext/_build_info.py is missing). "
            "Install with: pip install --no-build-isolation -e ."
        )
    if built_for != found:
        raise ImportError(
            f"torch_ext was built for torch {built_for} but torch {found} is installed. "
            "Rebuild torch_ext against this torch (pip install --no-build-isolation -e .) "
            f"or install torch=={built_for.split('+')[0]}."
        )
    try:
        return importlib.import_module("torch_ext._C")
    except ImportError as e:
        raise ImportError(
            f"torch_ext's C++ engine (built for torch {built_for}, found torch {found}) failed to load: {e}"
        ) from e
