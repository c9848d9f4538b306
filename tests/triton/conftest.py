"""Runs torch_ext._triton_kernels' Triton kernels (the repository's triton_kernels/) on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

triton.jit reads TRITON_INTERPRET when a kernel is defined and the interpreter reads it again while a kernel
runs, but the rest of the suite must not see it: on a GPU machine torch_ext._triton_kernels.multi_tensor is compiled
for the GPU and tests/test_kernels.py uses it. So the ``interpreted`` fixture loads a private copy of a
kernel module with the variable set, and every test in this directory runs with it set. This works in one
process with the whole suite, whatever imported triton first. ``compiled_multi_tensor`` loads another copy
without it, for tests that compile the kernels for a GPU (Triton and ptxas need no GPU for that).
"""

import importlib.util
import os
import sys
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def interpret_triton(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            # CI installs triton through the [test] extra; a silent skip there would hide these tests.
            pytest.fail("triton is not installed; the [test] extra installs it (pip install -e '.[test]')")
        pytest.skip("triton is not installed: pip install 'triton==3.9.*'")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


_private_copies: dict[tuple[str, bool], ModuleType] = {}


def load_private_copy(module_name: str, interpret: bool) -> ModuleType:
    """A copy of ``module_name`` whose kernels run in Triton's interpreter (``interpret``) or compile for a
    GPU, loaded once per session under its own name, so the module itself is left as the process has it."""
    key = (module_name, interpret)
    if key not in _private_copies:
        copy_name = f"{module_name}__{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(copy_name, importlib.util.find_spec(module_name).origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules[copy_name] = module  # dataclasses look their module up there
        previous = os.environ.pop("TRITON_INTERPRET", None)
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            os.environ.pop("TRITON_INTERPRET", None)
            if previous is not None:
                os.environ["TRITON_INTERPRET"] = previous
        _private_copies[key] = module
    return _private_copies[key]


@pytest.fixture
def multi_tensor(interpret_triton) -> ModuleType:
    """torch_ext._triton_kernels.multi_tensor, interpreted."""
    return load_private_copy("torch_ext._triton_kernels.multi_tensor", interpret=True)


@pytest.fixture
def compiled_multi_tensor(interpret_triton, monkeypatch, tmp_path) -> ModuleType:
    """torch_ext._triton_kernels.multi_tensor compiled for a GPU, without Triton's cache (a fresh one per test)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return load_private_copy("torch_ext._triton_kernels.multi_tensor", interpret=False)
