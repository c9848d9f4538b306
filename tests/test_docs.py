"""The API reference (docs/api.rst) documents every public name; the Sphinx build itself runs in .ci/run."""

import re
from pathlib import Path

import torch_ext
import torch_ext.ops

API_REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "api.rst"


def documented_names(module: str) -> set[str]:
    """Names ``module.<name>`` that an autodoc directive of docs/api.rst documents."""
    pattern = rf"^\.\. (?:auto\w+|py:\w+):: {re.escape(module)}\.(\w+)\s*$"
    return set(re.findall(pattern, API_REFERENCE.read_text(), flags=re.MULTILINE))


def test_api_reference_covers_every_public_name():
    # The submodules in __all__ are documented as modules: torch_ext.ops by its functions, kernels by automodule.
    missing = set(torch_ext.__all__) - {"kernels", "ops"} - documented_names("torch_ext")
    assert not missing, f"add to docs/api.rst: {sorted(missing)}"
    missing_ops = set(torch_ext.ops.__all__) - documented_names("torch_ext.ops")
    assert not missing_ops, f"add to docs/api.rst: {sorted(missing_ops)}"
    assert ".. automodule:: torch_ext.kernels" in API_REFERENCE.read_text()
