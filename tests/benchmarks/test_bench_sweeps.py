"""The two-host sweeps' summaries from their CSVs (recsys_torchrec, moe_sync, compile_overlap; overlap and
microbatch_overlap have files of their own), and recsys_torchrec's quick run checking TorchRec's bits."""

import csv
import importlib.util

import pytest
from bench_helpers import benchmark_command, run_benchmark, write_rows

from torch_ext import bench


def test_recsys_torchrec_summary_from_a_csv(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    scenario = "DLRM 8 tables x 256d table-wise"
    rows = [("comm", "recsys", f"{scenario}, {link}", "t_comm_ms", 36, 35, 37)]
    for ratio, layers, stock_step, ext_step, ext_exposed in ((0.5, 9, 150, 120, 18), (1, 18, 200, 170, 3.6)):
        size = f"{scenario}, {layers} dense layers, {link}"
        case = f"recsys x{ratio:g}"
        for variant, step, exposed in (("stock", stock_step, 36), ("torch_ext", ext_step, ext_exposed)):
            rows.append((variant, case, size, "step_ms", step, 0, 0))
            rows.append((variant, case, size, "backward_ms", step - 50, 0, 0))
            rows.append((variant, case, size, "exposed_ms", exposed, 0, 0))
            rows.append((variant, case, size, "efficiency", 1 - exposed / 36, 0, 0))
        rows.append(("comm", case, size, "backward_ms", 36, 35, 37))
    write_rows(tmp_path / "recsys_torchrec.csv", rows)
    summary = bench.summarize_folder(tmp_path, ["recsys_torchrec"])
    by_variant = {row.variant: row for row in summary}
    assert list(by_variant) == ["stock", "torch_ext"]
    ours = by_variant["torch_ext"]
    assert ours.case == link
    # The headline: the x1 point's efficiency beside its ideal, min(1, 1).
    assert ours.values["efficiency"] == pytest.approx(0.9) and ours.values["ideal_efficiency"] == 1.0
    assert ours.measured == "efficiency 0.90 (ideal 1.00)"
    assert ours.values["efficiency x0.5"] == pytest.approx(0.5) and ours.values["efficiency x1"] == pytest.approx(0.9)
    assert ours.values["exposed_ms"] == pytest.approx(3.6)
    # Step and backward / stock at x1.
    assert ours.values["ratio"] == pytest.approx(170 / 200) and ours.ratio == "0.85"
    assert ours.values["backward_ratio"] == pytest.approx(120 / 150)
    assert "x0.5: 0.50, x1: 0.90" in ours.notes
    assert by_variant["stock"].values["efficiency"] == pytest.approx(0.0)
    assert f"T_comm 36 ms, {scenario}" in by_variant["stock"].notes

    from matplotlib.figure import Figure

    figure = Figure()
    bench.benchmark_module("recsys_torchrec.summary").plot(summary, figure)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["torch_ext"].get_ydata()) == pytest.approx([0.5, 0.9])
    assert list(lines["ideal"].get_ydata()) == [0.5, 1]


@pytest.mark.distributed
@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("torchrec", "fbgemm_gpu")), reason="TorchRec is not installed"
)
def test_recsys_torchrec_quick_run_matches_stock_and_reports(tmp_path):
    """Its check of stock's bits (losses, dense gradients, tables after the fused update) passes at every sweep
    point, and the CSV holds both engines' step, backward, exposed communication and efficiency at each."""
    out = tmp_path / "recsys.csv"
    result = run_benchmark(
        [*benchmark_command("recsys_torchrec"), "--quick", "--reps", "2", "--ratios", "0.5,1", "--out", str(out)],
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out) as f:
        metrics = {(row["what"], row["case"], row["metric"]) for row in csv.DictReader(f)}
    for case in ("recsys x0.5", "recsys x1"):
        for variant in ("stock", "torch_ext"):
            for metric in ("step_ms", "backward_ms", "exposed_ms", "efficiency"):
                assert (variant, case, metric) in metrics
        assert ("comm", case, "backward_ms") in metrics
    assert ("comm", "recsys", "t_comm_ms") in metrics


def test_moe_sync_summary_from_a_csv(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    rows = [("comm", "megatron", f"2048 tokens x 256d per expert, {link}", "t_comm_ms", 36, 35, 38)]
    for ratio, layers, lane_efficiency in ((0.5, 4, 0.3), (1, 7, 0.6), (2, 14, 0.7)):
        size = f"2048 tokens x 256d per expert, {layers} dense layers, {link}"
        case = f"megatron x{ratio:g}"
        for variant, backward, step, efficiency in (
            ("compute", 30, 60, None),
            ("stock", 70, 160, -0.1),
            ("priority", 70, 160, 0.0),
            ("lane", 56, 140, lane_efficiency),
        ):
            rows.append((variant, case, size, "backward_ms", backward, backward, backward))
            rows.append((variant, case, size, "step_ms", step, step, step))
            if efficiency is not None:
                rows.append((variant, case, size, "efficiency", efficiency, efficiency, efficiency))
    write_rows(tmp_path / "moe_sync.csv", rows)
    summary = {row.variant: row for row in bench.summarize_folder(tmp_path, ["moe_sync"])}
    assert list(summary) == ["stock", "priority", "lane"]
    lane = summary["lane"]
    assert lane.case == f"Megatron-core, {link}"
    assert lane.values["efficiency"] == pytest.approx(0.6) and lane.values["ideal_efficiency"] == 1.0
    assert lane.values["step_ratio"] == pytest.approx(140 / 160) and lane.ratio == "0.80"
    assert lane.values["efficiency x0.5"] == pytest.approx(0.3) and lane.values["efficiency x2"] == pytest.approx(0.7)
    assert "x0.5: 0.30, x1: 0.60, x2: 0.70" in lane.notes
    assert "T_comm 36 ms" in summary["stock"].notes


def test_compile_overlap_summary_from_a_csv(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    case = "compile_overlap x1"
    size = f"2048 tokens x 256d per expert, 26 dense layers, {link}"
    rows = [
        ("comm", "compile_overlap", f"2048 tokens x 256d per expert, {link}", "t_comm_ms", 68, 66, 70),
        ("compute", case, size, "measured_ratio", 1.1, 1.1, 1.1),
    ]
    for variant, backward, step, efficiency, compute_step in (
        ("stock", 200, 330, -0.07, 210),
        ("torch_ext", 130, 275, 1.0, 210),
        ("compiled", 205, 345, -0.04, 215),
        ("reordered", 200, 340, 0.06, 215),
        ("torch_ext_compiled", 150, 300, 0.98, 215),
    ):
        for metric, value in (
            ("backward_ms", backward),
            ("step_ms", step),
            ("efficiency", efficiency),
            ("step_efficiency", efficiency - 0.3),
            ("compute_step_ms", compute_step),
        ):
            rows.append((variant, case, size, metric, value, value, value))
    write_rows(tmp_path / "compile_overlap.csv", rows)
    summary = {row.variant: row for row in bench.summarize_folder(tmp_path, ["compile_overlap"])}
    assert list(summary) == ["stock", "torch_ext", "compiled", "reordered", "torch_ext_compiled"]
    ours = summary["torch_ext_compiled"]
    assert ours.case == f"compiled MoE block, {link}"
    assert ours.values["efficiency"] == pytest.approx(0.98) and ours.values["ideal_efficiency"] == 1.0
    assert ours.values["step_efficiency"] == pytest.approx(0.68)
    assert ours.values["step_ratio"] == pytest.approx(300 / 330) and ours.ratio == "0.75"
    assert "its compute-only step 215 ms" in ours.notes
    assert "T_comm 68 ms" in summary["stock"].notes
