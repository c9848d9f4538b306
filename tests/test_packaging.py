"""What setup.py installs: torch_ext and nothing beside it at the top level. In particular the Triton kernels (the
repository's triton_kernels/ folder) go in as ``torch_ext._triton_kernels``: PyPI's triton-kernels, Triton's own,
installs a top-level ``triton_kernels``, which ours would overwrite or be shadowed by; and the benchmarks
(benchmarks/) as ``torch_ext.benchmarks``, which ``python -m torch_ext bench`` runs from a wheel."""

from __future__ import annotations

import importlib.metadata
import json
import runpy
import sys
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_arguments() -> dict:
    """The keyword arguments setup.py passes to ``setuptools.setup``, read by running it with setup() recorded."""
    recorded = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setuptools, "setup", lambda **arguments: recorded.update(arguments))
        patch.chdir(REPO)  # its package discovery and source globs are relative
        patch.setattr(sys, "argv", ["setup.py"])
        runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    return recorded


def test_setup_installs_only_torch_ext_at_the_top_level(setup_arguments):
    packages = setup_arguments["packages"]
    assert {package.split(".")[0] for package in packages} == {"torch_ext"}
    assert "torch_ext._triton_kernels" in packages
    assert setup_arguments["package_dir"]["torch_ext._triton_kernels"] == "triton_kernels"


def test_the_benchmarks_ship_inside_torch_ext(setup_arguments):
    # `python -m torch_ext bench` runs them from a wheel too (setup.py says so): every package of benchmarks/ goes in
    # as torch_ext.benchmarks.<...>, a new benchmark's included.
    folders = {path.parent.relative_to(REPO).as_posix() for path in (REPO / "benchmarks").rglob("__init__.py")}
    assert {"benchmarks", "benchmarks/harness", "benchmarks/microbatch_overlap"} <= folders
    package_dir = setup_arguments["package_dir"]
    assert {package_dir[f"torch_ext.{folder.replace('/', '.')}"] for folder in folders} == folders


def test_every_package_setup_names_is_a_folder(setup_arguments):
    package_dir = setup_arguments["package_dir"]
    for package in setup_arguments["packages"]:
        folder = REPO / package_dir.get(package, package.replace(".", "/"))
        assert folder.is_dir(), package


def _installed_from_this_checkout() -> importlib.metadata.Distribution | None:
    try:
        distribution = importlib.metadata.distribution("torch_ext")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(distribution.read_text("direct_url.json") or "{}").get("url", "")
    return distribution if url == REPO.as_uri() else None


def test_the_installed_distribution_has_no_top_level_triton_kernels():
    distribution = _installed_from_this_checkout()
    if distribution is None:
        pytest.skip("torch_ext is not installed from this checkout (pip install --no-build-isolation -e .)")
    # top_level.txt: what the install puts at the top of site-packages, from a wheel and from an editable install.
    assert (distribution.read_text("top_level.txt") or "").split() == ["torch_ext"]
    assert not [path for path in distribution.files or () if path.parts[0] == "triton_kernels"]


def test_torch_ext_imports_its_kernels_under_its_own_name():
    import torch_ext.kernels

    assert torch_ext.kernels.pack_ref.__module__ == "torch_ext._triton_kernels.multi_tensor_ref"
    assert Path(sys.modules["torch_ext._triton_kernels"].__file__).parent == REPO / "triton_kernels"
    kernels = torch_ext.kernels._multi_tensor_kernels()
    assert kernels is None or kernels.__name__ == "torch_ext._triton_kernels.multi_tensor"  # None: no triton
