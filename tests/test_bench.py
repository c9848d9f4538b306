"""`python -m torch_ext bench` (torch_ext/bench.py): the command end to end on one benchmark, the registry it reads,
the summary table of the benchmarks' CSVs, failures and stopping. Each benchmark's own summary and pieces are tested
in tests/benchmarks/."""

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_helpers import PNG_SIGNATURE, REPO, alive, overlap_sweep_rows, terminate_when, write_rows

from torch_ext import bench


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # The checkout under test, whatever torch_ext is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "torch_ext", *args], check=False, capture_output=True, text=True, env=env, timeout=240
    )


@pytest.mark.slow
def test_help_lists_the_options():
    result = run_cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--only", "--out"):
        assert option in result.stdout
    top = run_cli("--help")
    assert top.returncode == 0 and "bench" in top.stdout


@pytest.mark.slow
def test_only_rejects_an_unknown_benchmark(tmp_path):
    result = run_cli("bench", "--only", "engine_overhead,nonesuch", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "choose from engine_overhead" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_quick_engine_overhead_writes_the_results_folder(tmp_path):
    folder = tmp_path / "results"
    result = run_cli("bench", "--quick", "--only", "engine_overhead", "--out", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"results in {folder}" in result.stdout
    for name in ("engine_overhead.csv", "engine_overhead.log", "summary.csv", "summary.md", "engine_overhead.png"):
        assert (folder / name).is_file(), name
    # The printed table has one line per graph of engine_overhead.py.
    for case in ("fixed_cost", "chain", "fanin", "mlp", "mlp_grad_x", "mlp_double"):
        assert any(line.startswith(f"engine_overhead  {case} ") for line in result.stdout.splitlines()), case
    png = (folder / "engine_overhead.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    with open(folder / "summary.csv") as f:
        ratios = [float(row["value"]) for row in csv.DictReader(f) if row["metric"] == "ratio"]
    assert len(ratios) == 6 and all(0 < ratio < 10 for ratio in ratios)
    # Plans replayed and planned afresh are both reported.
    assert "first call" in (folder / "summary.md").read_text()
    assert "![engine_overhead](engine_overhead.png)" in (folder / "summary.md").read_text()


def test_default_folder_is_named_by_time_sha_and_quick():
    name = bench.default_folder(quick=True).name
    stamp, sha = name.split("-")[1:3]
    assert name.startswith("bench-") and name.endswith("-quick")
    assert time.strptime(stamp, "%Y%m%dT%H%M%SZ")
    assert sha == "nogit" or all(c in "0123456789abcdef" for c in sha)
    assert not bench.default_folder(quick=False).name.endswith("-quick")


def test_every_declared_benchmark_has_its_main_and_its_summary():
    # bench runs each declared module with python -m (a package: its __main__), and imports its summary module after
    # the runs.
    for declared in bench.registry():
        module = bench.benchmark_module(declared.main_module)
        if module.__spec__.submodule_search_locations is not None:
            module = bench.benchmark_module(f"{declared.main_module}.__main__")
        assert callable(module.main), declared.name
        summary = bench.benchmark_module(declared.summary_module)
        assert callable(summary.summary_rows) and callable(summary.plot), declared.name
    names = [declared.name for declared in bench.registry()]
    assert len(names) == len(set(names)) and names[0] == "engine_overhead"


def test_every_benchmark_is_declared():
    # A new benchmark that is not added to the registry would never run: this fails instead. A benchmark is a module
    # of the package that runs as a program, or a package with a __main__.
    package = Path(bench.benchmark_module("registry").__file__).parent
    runnable = {path.stem for path in package.glob("*.py") if 'if __name__ == "__main__":' in path.read_text()} | {
        path.parent.name for path in package.glob("*/__main__.py")
    }
    assert runnable == {declared.main_module for declared in bench.registry()}


def test_overlap_and_split_backward_summaries_from_csvs(tmp_path):
    write_rows(tmp_path / "overlap.csv", overlap_sweep_rows("plain loopback"))
    stage = "6x(256->1024)/t256"
    split = [("stock_full", "s", stage, "dI+dW_ms", 40, 39, 41), ("stock_full", "s", stage, "peak_full_mb", 2, 2, 2)]
    for variant, d_input, d_weight, peak in (("pipelining", 22, 22, 8.5), ("torch_ext", 20, 18, 3.2)):
        split += [
            (variant, "s", stage, "dI+dW_ms", d_input + d_weight, 0, 0),
            (variant, "s", stage, "dI_ms", d_input, 0, 0),
            (variant, "s", stage, "dW_ms", d_weight, 0, 0),
            (variant, "s", stage, "peak_dI_mb", peak - 1, 0, 0),
            (variant, "s", stage, "peak_dW_mb", peak, 0, 0),
            (variant, "s", stage, "held_after_dI_mb", 1.5, 0, 0),
        ]
    split += [
        ("torch_ext dI / pipelining dI", "s", stage, "ratio", 0.9, 0, 0),
        ("torch_ext dW / pipelining dW", "s", stage, "ratio", 0.8, 0, 0),
    ]
    write_rows(tmp_path / "split_backward.csv", split)

    rows = bench.summarize_folder(tmp_path, ["overlap", "split_backward"])
    overlap = {row.variant: row for row in rows if row.benchmark == "overlap"}
    assert list(overlap) == ["stock", "torch_ext"]
    assert overlap["torch_ext"].case == "plain loopback"

    split_rows = {row.variant: row for row in rows if row.benchmark == "split_backward"}
    assert split_rows["torch_ext"].values == {
        "dI/full": 0.5,
        "dW/full": 0.45,
        "(dI+dW)/full": 0.95,
        "peak_mb": 3.2,
        "stock_full_peak_mb": 2,
        "held_after_dI_mb": 1.5,
        "dI/pipelining": 0.9,
        "dW/pipelining": 0.8,
    }
    assert "dI/pipelining" not in split_rows["pipelining"].values
    table = bench.format_table(rows)
    assert len(table.splitlines()) == 1 + len(rows)
    assert "dI 0.50, dW 0.45, dI+dW 0.95" in table


def test_a_failing_benchmark_fails_the_run_and_says_which(tmp_path, capfd):
    script = tmp_path / "broken.py"
    # A real program, run as the benchmarks are (with --out and --quick), failing as a broken benchmark would.
    script.write_text("import sys\nprint('computing')\nsys.exit('broken: the gradients differ')\n")
    folder = tmp_path / "results"
    benchmarks = [bench.Benchmark("broken", (sys.executable, str(script)))]
    status = bench.run_all(benchmarks, folder, quick=True)
    captured = capfd.readouterr()
    assert status == 1
    assert "broken FAILED (exit status 1)" in captured.err
    assert "broken: the gradients differ" in captured.err
    assert "broken: failed" in captured.out
    # What there is still gets written.
    assert (folder / "summary.md").is_file() and (folder / "broken.log").is_file()
    assert "broken: failed" in (folder / "summary.md").read_text()


@pytest.mark.slow
def test_sigterm_to_bench_stops_the_benchmark_and_its_children(tmp_path):
    # A benchmark that spawns a child (as overlap.py spawns its ranks) and runs until stopped.
    script = tmp_path / "sleeper.py"
    pids = tmp_path / "pids"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(120)\n"
    )
    driver = (
        "import sys; from pathlib import Path; from torch_ext import bench\n"
        f"sleeper = bench.Benchmark('sleeper', (sys.executable, {str(script)!r}))\n"
        f"sys.exit(bench.run_all([sleeper], Path({str(tmp_path / 'out')!r}), True))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-c", driver], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    terminate_when(process, lambda: pids.is_file() and len(pids.read_text().split()) == 2, timeout_s=60)
    assert process.returncode != 0
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), pid


def test_an_earlier_runs_files_are_not_reported_as_this_runs(tmp_path, capfd):
    folder = tmp_path / "results"
    folder.mkdir()
    stale = ["overlap.csv", "overlap.png", "overlap_timeline.png", "overlap_timeline.json"]
    for name in stale:
        (folder / name).write_text("from an earlier run")
    # Exits 0 without writing its CSV, as a benchmark that skips itself.
    script = tmp_path / "skipping.py"
    script.write_text("print('skipped: nothing to measure here')\n")
    benchmark = bench.Benchmark(
        "overlap", (sys.executable, str(script)), bench.all_benchmarks()["overlap"].extra_outputs
    )
    assert bench.run_all([benchmark], folder, quick=True) == 0
    out = capfd.readouterr().out
    assert "overlap: skipped" in out
    assert "overlap_timeline.png" not in out
    for name in stale:
        assert not (folder / name).exists(), name


def test_fresh_folder_adds_a_suffix_when_the_folder_exists(tmp_path):
    path = tmp_path / "results" / "bench-x"
    assert bench.fresh_folder(path) == path and path.is_dir()
    assert bench.fresh_folder(path) == path.with_name("bench-x-2")
    assert bench.fresh_folder(path) == path.with_name("bench-x-3")


@pytest.mark.slow
def test_only_rejects_an_empty_selection(tmp_path):
    result = run_cli("bench", "--only", " , ", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "selects no benchmark" in result.stderr
    assert not (tmp_path / "out").exists()


def test_only_runs_each_benchmark_once(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(bench, "run_all", lambda benchmarks, folder, quick: ran.append([b.name for b in benchmarks]))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    bench.run(parser.parse_args(["--only", "overlap,engine_overhead,overlap", "--out", str(tmp_path)]), parser)
    assert ran == [["overlap", "engine_overhead"]]
