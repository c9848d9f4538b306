"""benchmarks/harness/: the sweep's settings, the git sha the CSVs carry, and a sweep's launcher without torch."""

import dataclasses
import subprocess
import sys

import torch

from torch_ext import bench


def test_sweeps_time_fewer_variants_in_a_quick_run():
    sweep = bench.benchmark_module("harness.sweep")
    config = sweep.SweepConfig(ratios=(1.0,), reps=2, warmup=1, calibration_reps=2, quick=True, timeline_png=None)
    assert sweep.timed_variants(config, ("a", "b", "c"), ("b",)) == ("a", "c")
    full = dataclasses.replace(config, quick=False)
    assert sweep.timed_variants(full, ("a", "b", "c"), ("b",)) == ("a", "b", "c")


def test_git_sha_ignores_a_repository_around_an_installed_package(monkeypatch, tmp_path):
    # A wheel installed into a virtualenv inside some other project's repository.
    package = tmp_path / "project" / ".venv" / "site-packages" / "torch_ext"
    (package / "benchmarks" / "harness").mkdir(parents=True)
    git = ["git", "-C", str(tmp_path / "project"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "project"], check=True)
    results = bench.benchmark_module("harness.results")
    monkeypatch.setattr(results, "__file__", str(package / "benchmarks" / "harness" / "results.py"))
    assert results.git_sha() == "nogit"
    # The checkout's own sha otherwise: the CSVs and the results folder name use this one helper.
    monkeypatch.undo()
    sha = results.git_sha()
    assert sha == "nogit" or all(c in "0123456789abcdef" for c in sha)
    assert f"-{sha}-quick" in bench.default_folder(quick=True).name


SWEEPS = ("overlap", "recsys_torchrec", "moe_sync", "compile_overlap", "microbatch_overlap")


def test_a_sweeps_launcher_imports_no_torch():
    # The launcher starts the hosts and writes the CSV; importing torch there (~1.4 s) would come before the ranks
    # start, in every sweep of bench --quick. Its ranks import the benchmark's rank module, which does.
    imports = "; ".join(f"import {bench.benchmarks_package()}.{name}.__main__" for name in SWEEPS)
    check = f"import sys; {imports}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    result = subprocess.run(
        [sys.executable, "-c", check], env=bench.benchmark_environment(), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    results = bench.benchmark_module("harness.results")
    assert results.torch_version() == torch.__version__
