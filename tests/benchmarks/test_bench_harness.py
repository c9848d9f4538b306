"""benchmarks/harness/: the sweep's settings, the git sha the CSVs carry, and a sweep's launcher without torch."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import torch

from torch_ext import bench


def test_sweeps_time_fewer_variants_in_a_quick_run():
    sweep = bench.benchmark_module("harness.sweep")
    config = sweep.SweepConfig(ratios=(1.0,), reps=2, warmup=1, calibration_reps=2, quick=True, timeline_png=None)
    assert sweep.timed_variants(config, ("a", "b", "c"), ("b",)) == ("a", "c")
    full = dataclasses.replace(config, quick=False)
    assert sweep.timed_variants(full, ("a", "b", "c"), ("b",)) == ("a", "b", "c")


def test_a_launcher_finds_a_module_without_importing_its_packages():
    sweep = bench.benchmark_module("harness.sweep")
    assert sweep.module_installed("email.mime.text") and sweep.module_installed("json")
    assert not sweep.module_installed("json.nonesuch") and not sweep.module_installed("nonesuch.json")
    assert not sweep.module_installed("json.decoder.nonesuch")  # a module, not a package, has no submodule


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


def sweeps() -> list[str]:
    """The declared benchmarks that are two-host sweeps: packages with a rank part (harness.sweep.run_sweep's)."""
    package = Path(bench.benchmark_module("registry").__file__).parent
    return [d.main_module for d in bench.registry() if (package / d.main_module / "rank.py").is_file()]


# Run in a fresh interpreter: each sweep's main up to the moment it would start its hosts, torch not imported by then.
LAUNCHERS = """
import importlib, sys
sweep = importlib.import_module("{package}.harness.sweep")


class HostsWouldStart(Exception):
    pass


def run_on_two_hosts(module, args, mode):
    torch_modules = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
    assert not torch_modules, (module, torch_modules[:5])
    raise HostsWouldStart(module)


sweep.run_on_two_hosts = run_on_two_hosts
for name in {sweeps!r}:
    main = importlib.import_module(f"{package}.{{name}}.__main__").main
    try:
        status = main(["--quick", "--out", "unused.csv"])
        # A full run's benchmark skips a quick run: its full launcher, then.
        status = main(["--out", "unused.csv"])
    except HostsWouldStart:
        print(name, "starts its hosts")
    else:
        print(name, "skipped", status)
"""


def test_a_sweeps_launcher_imports_no_torch(tmp_path):
    # The launcher starts the hosts and writes the CSV; importing torch there (~1.4 s, and ~3.3 s with deepspeed's
    # package, which finding deepspeed.moe used to import) would come before the ranks start, in every sweep of
    # bench --quick. Its ranks import the benchmark's rank module, which does.
    script = LAUNCHERS.format(package=bench.benchmarks_package(), sweeps=sweeps())
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=bench.benchmark_environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.partition(" ")[0] in sweeps()]
    assert len(lines) == len(sweeps()) >= 5 and "overlap starts its hosts" in lines, result.stdout
    results = bench.benchmark_module("harness.results")
    assert results.torch_version() == torch.__version__
