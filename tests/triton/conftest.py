"""Runs triton_kernels' Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

triton.jit reads TRITON_INTERPRET when a kernel is defined and the interpreter reads it again while a kernel
runs, but the rest of the suite must not see it: on a GPU machine triton_kernels.multi_tensor is compiled
for the GPU and tests/test_kernels.py uses it. So the ``interpreted`` fixture loads a private copy of a
kernel module with the variable set, and every test in this directory runs with it set. This works in one
process with the whole suite, whatever imported triton first.
"""

import importlib.util
import os
import sys
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def interpret_triton(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI"):
            # CI installs triton through the [test] extra; a silent skip there would hide these tests.
            pytest.fail("triton is not installed; the [test] extra installs it (pip install -e '.[test]')")
        pytest.skip("triton is not installed: pip install 'triton==3.9.*'")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


_interpreted_copies: dict[str, ModuleType] = {}


def load_interpreted(module_name: str) -> ModuleType:
    """A copy of ``module_name`` whose kernels run in Triton's interpreter, loaded once per session."""
    if module_name not in _interpreted_copies:
        copy_name = f"{module_name}__interpreted"
        spec = importlib.util.spec_from_file_location(copy_name, importlib.util.find_spec(module_name).origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules[copy_name] = module  # dataclasses look their module up there
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
        _interpreted_copies[module_name] = module
    return _interpreted_copies[module_name]


@pytest.fixture
def multi_tensor(interpret_triton) -> ModuleType:
    """triton_kernels.multi_tensor, interpreted."""
    return load_interpreted("triton_kernels.multi_tensor")
