"""The single-process benchmarks' lines of bench's table (and split_backward's plot), from their CSVs:
engine_overhead, split_backward, backward_memory, trace_overhead, order_check_scale; and a quick run of
order_check_scale."""

import csv

from bench_helpers import benchmark_command, run_benchmark, write_rows

from torch_ext import bench


def test_engine_overhead_summary_from_a_csv(tmp_path):
    write_rows(
        tmp_path / "engine_overhead.csv",
        [
            ("graph", "chain", "10000", "nodes", 10002, 10002, 10002),
            ("stock", "chain", "10000", "backward_us", 50000, 48000, 52000),
            ("stock", "chain", "10000", "us_per_node", 5.0, 4.8, 5.2),
            ("torch_ext", "chain", "10000", "backward_us", 35000, 34000, 36000),
            ("torch_ext", "chain", "10000", "us_per_node", 3.5, 3.4, 3.6),
            ("torch_ext/stock", "chain", "10000", "ratio", 0.71, 0.68, 0.74),
        ],
    )
    (row,) = bench.summarize_folder(tmp_path, ["engine_overhead"])
    assert (row.benchmark, row.case, row.variant) == ("engine_overhead", "chain", "torch_ext")
    assert row.values == {
        "stock_us_per_node": 5.0,
        "torch_ext_us_per_node": 3.5,
        "ratio": 0.7,
        "paired_ratio_p20": 0.68,
        "paired_ratio_p80": 0.74,
    }
    assert (row.baseline, row.measured, row.ratio) == ("stock 5 us/node", "3.5 us/node", "0.70")
    assert "10002 nodes" in row.notes


def test_engine_overhead_fixed_cost_is_per_call_with_the_first_call_ratio(tmp_path):
    write_rows(
        tmp_path / "engine_overhead.csv",
        [
            ("graph", "fixed_cost", "3 ops", "nodes", 4, 4, 4),
            ("stock", "fixed_cost", "3 ops", "us_per_node", 5.0, 4.8, 5.2),
            ("torch_ext", "fixed_cost", "3 ops", "us_per_node", 4.0, 3.9, 4.1),
            ("torch_ext_first", "fixed_cost", "3 ops", "us_per_node", 4.5, 4.4, 4.6),
            ("torch_ext/stock", "fixed_cost", "3 ops", "ratio", 0.8, 0.78, 0.82),
            ("torch_ext_first/stock", "fixed_cost", "3 ops", "ratio", 0.9, 0.88, 0.92),
        ],
    )
    (row,) = bench.summarize_folder(tmp_path, ["engine_overhead"])
    assert (row.baseline, row.measured, row.ratio) == ("stock 20 us/call", "16 us/call", "0.80")
    assert "first call 0.90" in row.notes and row.values["first_call_ratio"] == 0.9


def test_split_backward_summary_uses_the_paired_ratios(tmp_path, monkeypatch):
    stage = "6x(256->1024)/t256"
    split = [("stock_full", "s", stage, "dI+dW_ms", 40, 39, 41), ("stock_full", "s", stage, "peak_full_mb", 2, 2, 2)]
    # dI+dW_ms is the median of the per-repetition totals, not the sum of the passes' medians.
    for variant, d_input, d_weight, total in (("pipelining", 22, 22, 46), ("torch_ext", 20, 18, 39)):
        split += [
            (variant, "s", stage, "dI+dW_ms", total, 0, 0),
            (variant, "s", stage, "dI_ms", d_input, 0, 0),
            (variant, "s", stage, "dW_ms", d_weight, 0, 0),
            (variant, "s", stage, "peak_dI_mb", 1, 0, 0),
            (variant, "s", stage, "peak_dW_mb", 1, 0, 0),
            (variant, "s", stage, "held_after_dI_mb", 1, 0, 0),
        ]
    split += [
        ("torch_ext dI / stock full", "s", stage, "ratio", 0.53, 0.5, 0.56),
        ("torch_ext dI+dW / stock full", "s", stage, "ratio", 0.96, 0.9, 1.0),
        ("pipelining dI+dW / stock full", "s", stage, "ratio", 1.12, 1.1, 1.2),
        ("torch_ext dI / pipelining dI", "s", stage, "ratio", 0.9, 0, 0),
        ("torch_ext dW / pipelining dW", "s", stage, "ratio", 0.8, 0, 0),
    ]
    write_rows(tmp_path / "split_backward.csv", split)
    rows = {row.variant: row for row in bench.summarize_folder(tmp_path, ["split_backward"])}
    assert rows["torch_ext"].values["dI/full"] == 0.53
    assert rows["torch_ext"].values["(dI+dW)/full"] == 0.96
    assert rows["pipelining"].values["(dI+dW)/full"] == 1.12
    # No paired row for pipelining's dI: the ratio of the medians.
    assert rows["pipelining"].values["dI/full"] == 22 / 40
    assert "dI+dW 0.96" in rows["torch_ext"].ratio
    # The plot draws the same numbers.
    drawn = []
    split_backward = bench.benchmark_module("split_backward")
    real_bar_chart = split_backward.bar_chart

    def recording_bar_chart(ax, labels, series, ylabel, line):
        drawn.append(series)
        real_bar_chart(ax, labels, series, ylabel, line)

    monkeypatch.setattr(split_backward, "bar_chart", recording_bar_chart)
    bench.write_plots(tmp_path, list(rows.values()))
    assert drawn == [{"pipelining": [22 / 40, 22 / 40, 1.12], "torch_ext": [0.53, 18 / 40, 0.96]}]


def test_backward_memory_summary_from_a_csv(tmp_path):
    mib = 2**20
    write_rows(
        tmp_path / "backward_memory.csv",
        [
            ("stock", "deep_mlp", "8x Linear", "peak_bytes", 4 * mib, 4 * mib, 4 * mib),
            ("torch_ext", "deep_mlp", "8x Linear", "peak_bytes", 4 * mib, 4 * mib, 4 * mib),
            ("torch_ext_replayed", "deep_mlp", "8x Linear", "peak_bytes", 4 * mib, 4 * mib, 4 * mib),
            ("stock", "fan_in_priority", "64 branches", "peak_bytes", 2 * mib, 2 * mib, 2 * mib),
            ("torch_ext", "fan_in_priority", "64 branches", "peak_bytes", 3 * mib, 3 * mib, 3.5 * mib),
            ("torch_ext_replayed", "fan_in_priority", "64 branches", "peak_bytes", 3 * mib, 3 * mib, 3 * mib),
        ],
    )
    rows = bench.summarize_folder(tmp_path, ["backward_memory"])
    assert [row.case for row in rows] == ["deep_mlp", "fan_in_priority"]
    mlp, fan_in = rows
    assert (mlp.baseline, mlp.measured, mlp.ratio) == ("stock 4 MiB", "4 MiB", "1.00")
    assert "differ" not in mlp.notes
    assert (fan_in.ratio, fan_in.values["replayed_ratio"]) == ("1.50", 1.5)
    assert "peaks differ between runs" in fan_in.notes


def test_trace_overhead_summary_from_a_csv(tmp_path):
    write_rows(
        tmp_path / "trace_overhead.csv",
        [
            ("graph", "chain", "10000", "nodes", 10002, 10002, 10002),
            ("torch_ext/off", "chain", "10000", "us_per_node", 2.0, 1.9, 2.1),
            ("torch_ext/on", "chain", "10000", "us_per_node", 2.5, 2.4, 2.6),
            ("torch_ext/collect", "chain", "10000", "us_per_node", 0.7, 0.6, 0.8),
            ("on-off", "chain", "10000", "us_per_node", 0.4, 0.1, 0.6),
        ],
    )
    (row,) = bench.summarize_folder(tmp_path, ["trace_overhead"])
    assert (row.case, row.baseline, row.measured, row.ratio) == ("chain", "off 2 us/node", "2.5 us/node", "1.25")
    assert row.values["added_us_per_node"] == 0.5 and row.values["collect_us_per_node"] == 0.7
    assert "10002 nodes" in row.notes and "paired p20-p80 0.100-0.600" in row.notes


def test_order_check_scale_summary_from_a_csv(tmp_path):
    rows = []
    for variant, costs in (("ep", (1300, 1320, 1310)), ("ep+dp", (2000, 2100, 4100))):
        for world, cost in zip((8, 1024, 8192), costs, strict=True):
            rows.append(("begin", f"{variant}, {world} ranks", str(world), "us", cost, cost - 50, cost + 50))
            rows.append(("exchange", f"{variant}, {world} ranks", str(world), "bytes", 16, 16, 16))
    write_rows(tmp_path / "order_check_scale.csv", rows)
    ep, ep_dp = bench.summarize_folder(tmp_path, ["order_check_scale"])
    assert (ep.case, ep.variant, ep.baseline, ep.measured, ep.ratio) == (
        "ep",
        "begin at 8,192 ranks",
        "8 ranks 1300 us",
        "1310 us",
        "1.01",
    )
    # A cost that grew past the aim shows in the ratio, against the smallest world's.
    assert ep_dp.ratio == "2.05" and "aim <= 2" in ep_dp.notes
    assert "bytes per backward 16 at 8 ranks, 16 at 8,192" in ep.notes
    assert ep_dp.values["begin_us_1024"] == 2100 and ep_dp.values["bytes_8192"] == 16


def test_order_check_scale_runs_the_checks_begin_as_the_engine_calls_it(tmp_path):
    """A quick run (~3 s): its synthetic worlds go through the collective order check's begin and wait with the
    arguments the engine passes, so a change of their signature fails here, not only in bench."""
    out = tmp_path / "order_check_scale.csv"
    result = run_benchmark([*benchmark_command("order_check_scale"), "--quick", "--out", str(out)], timeout_s=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out) as f:
        assert any(row["what"] == "begin" for row in csv.DictReader(f))
