"""Importing torch_ext fails loudly, naming the torch it was built for and the one it found, or a bad switch.

Each build case imports a copy of the built package (with its .so) from a temporary directory, in a
fresh interpreter, after changing the copy's build info or engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import torch_ext
from torch_ext import _loader
from torch_ext._loader import SWITCH_DEFAULTS, switch_on

PACKAGE_DIR = Path(torch_ext.__file__).parent
IMPORT_TIMEOUT_S = 120

# Imports torch_ext and reports the outcome on stdout.
IMPORT_PROBE = """
import sys
try:
    import torch_ext
except ImportError as error:
    print("ImportError:", error)
    print("engine loaded:", "torch_ext._C" in sys.modules)
    sys.exit(1)
print("imported:", torch_ext.__file__)
"""


def _matching_build_info(package: Path) -> None:
    _write_build_info(package, torch.__version__)


def _other_torch_version(package: Path) -> None:
    _write_build_info(package, "0.0.0")


def _missing_build_info(package: Path) -> None:
    (package / "_build_info.json").unlink()


def _broken_engine(package: Path) -> None:
    _write_build_info(package, torch.__version__)
    (engine,) = package.glob("_C*.so")
    engine.write_bytes(b"not a shared library")


def _write_build_info(package: Path, torch_version: str) -> None:
    (package / "_build_info.json").write_text(json.dumps({"torch_version": torch_version}))


@dataclass(frozen=True)
class ImportOutcome:
    package: Path
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def import_outcomes(tmp_path_factory) -> dict[Callable[[Path], None], ImportOutcome]:
    """Imports a changed copy of the built package in a fresh interpreter, for each way of changing it.

    The interpreters run at once: each spends seconds importing torch.
    """
    running = {}
    for change in (_matching_build_info, _other_torch_version, _missing_build_info, _broken_engine):
        root = tmp_path_factory.mktemp(change.__name__.strip("_"))
        package = root / "site" / "torch_ext"
        shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
        change(package)
        # PYTHONPATH replaced, not extended, and the working directory moved, so that only the
        # copy can be found.
        process = subprocess.Popen(
            [sys.executable, "-c", IMPORT_PROBE],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(package.parent)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        running[change] = (package, process)
    outcomes = {}
    try:
        for change, (package, process) in running.items():
            stdout, stderr = process.communicate(timeout=IMPORT_TIMEOUT_S)
            outcomes[change] = ImportOutcome(package, process.returncode, stdout, stderr)
    finally:
        for _, process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return outcomes


def _failed_import(outcome: ImportOutcome) -> str:
    """The ImportError's message, asserting the import failed with one."""
    assert outcome.returncode == 1, outcome
    assert outcome.stdout.startswith("ImportError: "), outcome
    return outcome.stdout


@pytest.mark.slow
def test_copy_with_matching_build_info_imports(import_outcomes):
    # The control: the copy itself is importable, so the failures below come from what was changed.
    outcome = import_outcomes[_matching_build_info]
    assert outcome.returncode == 0, outcome
    assert outcome.stdout.strip() == f"imported: {outcome.package / '__init__.py'}"


@pytest.mark.slow
def test_other_torch_version_raises_import_error_naming_both(import_outcomes):
    report = _failed_import(import_outcomes[_other_torch_version])
    assert "0.0.0" in report
    assert torch.__version__ in report
    # Checked before the engine is loaded, which against another torch fails with undefined symbols.
    assert "engine loaded: False" in report


@pytest.mark.slow
def test_missing_build_info_raises_import_error(import_outcomes):
    report = _failed_import(import_outcomes[_missing_build_info])
    assert "_build_info.json" in report
    assert "engine loaded: False" in report


@pytest.mark.slow
def test_engine_that_fails_to_load_raises_import_error_with_cause(import_outcomes):
    outcome = import_outcomes[_broken_engine]
    report = _failed_import(outcome)
    assert torch.__version__ in report
    (engine,) = outcome.package.glob("_C*.so")
    assert engine.name in report  # the loader's own error is part of the message


# The on/off environment switches: one parser, the same values and the same error for each.


@pytest.mark.parametrize("value, on", [("on", True), ("1", True), ("off", False), ("0", False)])
def test_every_switch_takes_the_same_values(monkeypatch, value, on):
    for variable in SWITCH_DEFAULTS:
        monkeypatch.setenv(variable, value)
        assert switch_on(variable) is on


def test_an_unset_or_empty_switch_is_its_default(monkeypatch):
    assert SWITCH_DEFAULTS == {
        "TORCH_EXT_CURRENT_NODE": True,
        "TORCH_EXT_PLAN_CACHE": True,
        "TORCH_EXT_TRITON": True,
        "TORCH_EXT_CHECK_COLLECTIVES": False,
    }
    for variable, default in SWITCH_DEFAULTS.items():
        monkeypatch.delenv(variable, raising=False)
        assert switch_on(variable) is default
        monkeypatch.setenv(variable, "")
        assert switch_on(variable) is default


@pytest.mark.parametrize("variable", SWITCH_DEFAULTS)
def test_loading_checks_every_switch_with_the_same_error(monkeypatch, variable):
    monkeypatch.setenv(variable, "maybe")
    expected = f"{variable} must be one of ('on', 'off', '1', '0'), got 'maybe'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        _loader._load_extension()


@pytest.mark.parametrize(("value", "forced_off"), [("0", True), ("off", True), ("on", False), ("", False)])
def test_current_node_switch_reaches_the_engine(monkeypatch, value, forced_off):
    # The loader parses TORCH_EXT_CURRENT_NODE, once, and tells the engine, which reads no variable itself. Recorded,
    # not applied: the engine settles its current-node path at its first backward, for the whole process.
    told = []
    monkeypatch.setattr(_loader._C, "_set_current_node_forced_off", told.append)
    monkeypatch.setenv("TORCH_EXT_CURRENT_NODE", value)
    _loader._load_extension()
    assert told == [forced_off]


@pytest.mark.slow
def test_import_refuses_a_bad_collective_check_switch():
    # Applied by torch_ext/_host.py; read by torch_ext.collectives.order_check once, which took any value but ""
    # and "0" for on.
    result = subprocess.run(
        [sys.executable, "-c", "import torch_ext"],
        env={**os.environ, "TORCH_EXT_CHECK_COLLECTIVES": "maybe"},
        capture_output=True,
        text=True,
        check=False,
        timeout=IMPORT_TIMEOUT_S,
    )
    assert result.returncode != 0
    assert (
        "ValueError: TORCH_EXT_CHECK_COLLECTIVES must be one of ('on', 'off', '1', '0'), got 'maybe'" in result.stderr
    )


def test_the_import_installed_the_host_once():
    """The engine reaches Python through one host, which torch_ext's import installed (torch_ext/_host.py); another
    cannot replace it."""
    assert torch_ext._C._collective_role_cache_size() >= 0  # raises without a host
    with pytest.raises(RuntimeError, match="torch_ext's host is installed once, when torch_ext is imported"):
        torch_ext._C.install_host(
            node_class_kind=lambda node_class: (0, False),
            lane_group=lambda ctx: None,
            twin_group_name=str,
            python_node=torch_ext._host._PythonNodeProbe.apply(torch.zeros((), requires_grad=True)).grad_fn,
        )
