"""benchmarks/trainer_overlap: its summary from a CSV, its skip in a quick run, and a short run of every installed
library's loop, own and switched, whose bits check must pass."""

import csv

import pytest
from bench_helpers import benchmark_command, run_benchmark, write_rows

from torch_ext import bench


def test_trainer_overlap_summary_is_the_switchs_exposure_over_the_own_loops(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    rows = []
    for library, own_exposed, switch_exposed in (("megatron", 200, 80), ("torchtitan", 160, 120)):
        size = f"9 dense layers, {link}"
        rows.append(("comm", library, size, "t_comm_ms", 36, 35, 37))
        for variant, step, exposed in (
            ("compute", 500, None),
            ("own", 700, own_exposed),
            ("switch", 600, switch_exposed),
        ):
            rows.append((variant, library, size, "step_ms", step, step, step))
            if exposed is not None:
                rows.append((variant, library, size, "exposed_ms", exposed, exposed, exposed))
    write_rows(tmp_path / "trainer_overlap.csv", rows)
    summary = bench.summarize_folder(tmp_path, ["trainer_overlap"])
    assert [row.case for row in summary] == [
        f"Megatron-core, 9 dense layers, {link}",
        f"torchtitan, 9 dense layers, {link}",
    ]
    megatron = summary[0]
    assert (megatron.variant, megatron.baseline) == ("switch", "own loop")
    assert megatron.ratio == "0.40" and megatron.values["exposed_ratio"] == pytest.approx(0.4)
    assert megatron.values["step_ratio"] == pytest.approx(600 / 700)
    assert megatron.measured == "exposed 80.0 ms vs 200.0 ms"
    assert "T_comm 36 ms" in megatron.notes

    from matplotlib.figure import Figure

    figure = Figure()
    bench.benchmark_module("trainer_overlap.summary").plot(summary, figure)
    heights = [bar.get_height() for bar in figure.axes[0].patches]
    assert heights == pytest.approx([0.4, 0.75])


def test_trainer_overlap_is_skipped_by_a_quick_run(tmp_path):
    out = tmp_path / "trainer_overlap.csv"
    result = run_benchmark([*benchmark_command("trainer_overlap"), "--quick", "--out", str(out)], timeout_s=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not out.exists()
    assert result.stdout.strip().splitlines()[-1].startswith("trainer_overlap: skipped: a full run's benchmark")


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_overlap_runs_each_librarys_loop_with_and_without_its_switch(tmp_path):
    """Two repetitions on loopback: each installed library's own loop and its switch give the same gradients (the
    benchmark raises otherwise), and the CSV has each variant's step and exposure."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "trainer_overlap.csv"
    result = run_benchmark(
        [*benchmark_command("trainer_overlap"), "--reps", "2", "--network", "loopback", "--out", str(out)],
        timeout_s=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out) as f:
        metrics = {(row["what"], row["case"], row["metric"]) for row in csv.DictReader(f)}
    libraries = {case for what, case, metric in metrics if metric == "t_comm_ms"}
    assert "megatron" in libraries
    for library in libraries:
        for variant in ("compute", "own", "switch"):
            assert (variant, library, "step_ms") in metrics
        for variant in ("own", "switch"):
            assert (variant, library, "exposed_ms") in metrics
