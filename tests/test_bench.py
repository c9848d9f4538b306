"""`python -m torch_ext bench`: the command end to end on one benchmark, the summary of each
benchmark's CSV, failures, the stock timeline of benchmarks/overlap.py, and the two-host launcher
(benchmarks/_hosts.py): results, fallback, a failed rank, stopping."""

import argparse
import csv
import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torch_ext import bench

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def test_benchmark_scripts_are_found():
    directory = bench.benchmarks_dir()
    for benchmark in bench.all_benchmarks().values():
        assert benchmark.script.is_file()
        # Each script owns its summary rows and its plot.
        module = bench.benchmark_module(benchmark.name)
        assert callable(module.summary_rows) and callable(module.plot)
        assert module.__file__ == str(benchmark.script)
    assert (directory / "_common.py").is_file()


def write_rows(path: Path, rows: list[tuple]) -> None:
    """A benchmark's CSV, as benchmarks/_common.py writes it."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("what", "case", "size", "metric", "median", "p20", "p80", "torch_version", "git_sha"))
        writer.writerows(row + ("2.13.0", "abc") for row in rows)


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


def overlap_sweep_rows(link: str) -> list[tuple]:
    """benchmarks/overlap.py's CSV of a three-point sweep (x0.5: 20 dense layers, x1: 40, x2: 80), T_comm 40 ms."""
    rows = [
        ("comm", "overlap", f"256d x 4096 rows, {link}", "t_comm_ms", 40, 36, 42),
        ("machine", "overlap", link, "runnable_tasks", 3, 2, 4),
    ]
    for ratio, layers, compute, ext_efficiency in ((0.5, 20, 50, 0.4), (1, 40, 80, 0.7), (2, 80, 110, 0.9)):
        size = f"256d x 4096 rows, {layers} dense layers, {link}"
        case = f"overlap x{ratio:g}"
        for variant, efficiency in (("stock", 0.1), ("torch_ext", ext_efficiency)):
            exposed = (1 - efficiency) * 40
            rows.append((variant, case, size, "backward_ms", compute + exposed, 0, 0))
            rows.append((variant, case, size, "exposed_ms", exposed, 0, 0))
            rows.append((variant, case, size, "efficiency", efficiency, 0, 0))
        rows.append(("compute", case, size, "backward_ms", compute, 0, 0))
        rows.append(("comm", case, size, "backward_ms", 40, 36, 42))
    return rows


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
    # A real script, run as the benchmarks are (with --out and --quick), failing as a broken benchmark would.
    script.write_text("import sys\nprint('computing')\nsys.exit('broken: the gradients differ')\n")
    folder = tmp_path / "results"
    benchmarks = [bench.Benchmark("broken", script)]
    status = bench.run_all(benchmarks, folder, quick=True)
    captured = capfd.readouterr()
    assert status == 1
    assert "broken FAILED (exit status 1)" in captured.err
    assert "broken: the gradients differ" in captured.err
    assert "broken: failed" in captured.out
    # What there is still gets written.
    assert (folder / "summary.md").is_file() and (folder / "broken.log").is_file()
    assert "broken: failed" in (folder / "summary.md").read_text()


def test_overlap_summary_is_the_sweep_and_its_plot_the_curve(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    write_rows(tmp_path / "overlap.csv", overlap_sweep_rows(link))
    rows = bench.summarize_folder(tmp_path, ["overlap"])
    summary = {row.variant: row for row in rows}
    # Only variants with a collective; compute and comm are their baselines.
    assert list(summary) == ["stock", "torch_ext"]
    ours = summary["torch_ext"]
    assert ours.case == link
    # The headline is the x1 point's efficiency, beside its ideal (min(1, 1)); the curve is in the notes.
    assert ours.values["efficiency"] == pytest.approx(0.7) and ours.values["ideal_efficiency"] == 1.0
    assert ours.measured == "efficiency 0.70 (ideal 1.00)"
    assert ours.values["efficiency x0.5"] == 0.4 and ours.values["efficiency x2"] == 0.9
    assert ours.values["exposed_ms"] == pytest.approx(12)
    # Backward / stock at x1: (80 + 12) / (80 + 36).
    assert ours.values["ratio"] == pytest.approx(92 / 116)
    assert "headline at x1; efficiency by dense/comm ratio x0.5: 0.40, x1: 0.70, x2: 0.90" in ours.notes
    # With what else ran on the machine meanwhile: overlap figures move under other processes' load.
    assert "T_comm 40 ms, 256d x 4096 rows; runnable tasks 3 (the ranks: 2)" in summary["stock"].notes

    from matplotlib.figure import Figure

    figure = Figure()
    bench.benchmark_module("overlap").plot(rows, figure)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["torch_ext"].get_xdata()) == [0.5, 1, 2]
    assert list(lines["torch_ext"].get_ydata()) == [0.4, 0.7, 0.9]
    assert list(lines["stock"].get_ydata()) == [0.1, 0.1, 0.1]
    # The ideal, dashed, with its corner at ratio 1.
    assert list(lines["ideal"].get_xdata()) == [0.5, 1, 2] and list(lines["ideal"].get_ydata()) == [0.5, 1, 1]
    assert lines["ideal"].get_linestyle() == "--"
    assert bench.write_plots(tmp_path, rows) == [tmp_path / "overlap.png"]


def test_the_ideal_is_the_ratio_each_point_measured_and_step_time_stands_beside_the_efficiency(tmp_path):
    # A point's compute-only backward can exceed the ratio it asked for (x0.5 asked 20 ms of dense layers; the whole
    # compute-only backward took 50 ms, 1.25 x T_comm): its ideal is min(1, 1.25), not 0.5, so an efficiency of
    # 0.92 there does not beat it.
    link = "2 hosts over a veth shaped to 1gbit"
    rows = overlap_sweep_rows(link)
    for ratio, compute, by_step in ((0.5, 50, 0.7), (1, 80, 0.75), (2, 110, 0.8)):
        case = f"overlap x{ratio:g}"
        size = next(row[2] for row in rows if row[1] == case)
        rows.append(("compute", case, size, "measured_ratio", compute / 40, compute / 40, compute / 40))
        rows.append(("torch_ext", case, size, "step_efficiency", by_step, 0, 0))
        rows.append(("stock", case, size, "step_efficiency", 0.0, 0, 0))
    write_rows(tmp_path / "overlap.csv", rows)
    summary = {row.variant: row for row in bench.summarize_folder(tmp_path, ["overlap"])}
    ours = summary["torch_ext"]
    assert ours.values["ideal_efficiency"] == 1.0
    assert ours.values["step_efficiency"] == pytest.approx(0.75)
    assert ours.measured == "efficiency 0.70 (ideal 1.00), by step time 0.75"
    assert "x0.5 (measured x1.2): 0.40, x1 (measured x2): 0.70, x2 (measured x2.8): 0.90" in ours.notes

    from matplotlib.figure import Figure

    figure = Figure()
    bench.benchmark_module("overlap").plot(list(summary.values()), figure)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    ideal = lines["ideal (measured ratio)"]
    assert list(ideal.get_xdata()) == [0.5, 1, 2] and list(ideal.get_ydata()) == [1.0, 1.0, 1.0]


def test_sweeps_time_fewer_variants_in_a_quick_run():
    common = bench._common()
    config = common.SweepConfig(ratios=(1.0,), reps=2, warmup=1, calibration_reps=2, quick=True, timeline_png=None)
    assert common.timed_variants(config, ("a", "b", "c"), ("b",)) == ("a", "c")
    full = dataclasses.replace(config, quick=False)
    assert common.timed_variants(full, ("a", "b", "c"), ("b",)) == ("a", "b", "c")


def test_stock_backward_events_in_the_trace_format(monkeypatch):
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import overlap

    x = torch.linspace(0.5, 1.0, 4).requires_grad_()
    loss = (x * 2.0).sin().sum()
    start = time.perf_counter_ns()
    events = overlap.stock_backward_events(loss)
    end = time.perf_counter_ns()

    assert x.grad is not None
    assert [e["kind"] for e in events] == ["backward", "node", "node", "node", "node"]
    backward, *nodes = events
    assert [e["name"] for e in nodes] == [
        "SumBackward0",
        "SinBackward0",
        "MulBackward0",
        "torch::autograd::AccumulateGrad",
    ]
    assert [e["sequence_nr"] for e in nodes[:3]] == sorted((e["sequence_nr"] for e in nodes[:3]), reverse=True)
    # AccumulateGrad has none: -1, as in torch_ext.trace()'s events (not UINT64_MAX).
    assert nodes[3]["sequence_nr"] == -1
    assert [e["id"] for e in events] == list(range(len(events)))
    # On perf_counter_ns's clock: inside the backward call, one after the other.
    assert start <= backward["start_ns"] <= nodes[0]["start_ns"]
    assert nodes[-1]["end_ns"] <= backward["end_ns"] <= end
    for earlier, later in itertools.pairwise(nodes):
        assert earlier["start_ns"] < earlier["end_ns"] <= later["start_ns"]
    assert set(events[0]) == {
        "id", "kind", "name", "sequence_nr", "priority", "priority_from", "priority_origin", "start_ns", "end_ns",
        "thread", "backward_id", "collective", "wait_for",
    }  # fmt: skip
    assert not any(e["collective"] for e in events)


def test_stock_backward_events_mark_the_collective_and_its_wait(monkeypatch, one_rank_world):
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import overlap
    import torch.distributed._functional_collectives as funcol

    rows = torch.randn(8, 4, requires_grad=True)
    exchanged = funcol.all_to_all_single_autograd(rows * 2.0, None, None, dist.group.WORLD)
    all_to_all_node = exchanged.grad_fn.next_functions[0][0]
    events = overlap.stock_backward_events(torch.relu(exchanged).sum())

    collective = [e for e in events if e["kind"] == "node" and e["collective"]]
    assert [e["name"] for e in collective] == [all_to_all_node.name()]
    assert collective[0]["sequence_nr"] == all_to_all_node._sequence_nr()
    (wait,) = [e for e in events if e["kind"] == "collective_wait"]
    assert wait["name"] == "_c10d_functional::wait_tensor"
    # Stock waits inside the collective's own node; wait_for is that node's event's id, its index.
    assert [e["id"] for e in events] == list(range(len(events)))
    assert events[wait["wait_for"]] is collective[0]
    assert wait["sequence_nr"] == all_to_all_node._sequence_nr()
    from torch_ext.tracing import _launch_wait_pairs

    assert _launch_wait_pairs(events) == [(collective[0], wait)]
    assert collective[0]["start_ns"] <= wait["start_ns"] <= wait["end_ns"] <= collective[0]["end_ns"]
    nodes = [e["name"] for e in events if e["kind"] == "node"]
    assert nodes.index("ReluBackward0") < nodes.index(all_to_all_node.name()) < nodes.index("MulBackward0")


@pytest.mark.distributed
def test_overlap_timeline_of_stock_and_torch_ext(tmp_path):
    png = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, str(bench.benchmarks_dir() / "overlap.py"), "--quick", "--reps", "2", "--network", "loopback"]
        + ["--ratios", "1", "--timeline", str(png), "--out", str(tmp_path / "overlap.csv")],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 10_000
    rows = json.loads(png.with_suffix(".json").read_text())
    assert [row["label"] for row in rows] == ["stock PyTorch", "torch_ext"]
    for row in rows:
        kinds = {event["kind"] for event in row["events"]}
        assert {"backward", "node", "collective_wait"} <= kinds, row["label"]
        collective = [e for e in row["events"] if e["kind"] == "node" and e["collective"]]
        assert len(collective) == 1, row["label"]
    # The point of the picture: stock launches the all_to_all after the dense MLP, torch_ext before it.
    # The last AddmmBackward0 to start is the first dense layer's (the overarch's run first on both).
    launches, last_addmms = [], []
    for row in rows:
        nodes = [e for e in row["events"] if e["kind"] == "node"]
        launches.append(next(e["start_ns"] for e in nodes if e["collective"]))
        last_addmms.append(max(e["start_ns"] for e in nodes if e["name"] == "AddmmBackward0"))
    stock_launch, ext_launch = launches
    stock_last_addmm, ext_last_addmm = last_addmms
    assert stock_launch > stock_last_addmm
    assert ext_launch < ext_last_addmm


# A script run by _hosts.run_on_two_hosts: both ranks all_reduce and hand back what they saw; with --fail-rank R,
# rank R fails after joining the process group while the other waits in the all_reduce.
RANK_SCRIPT = """
import argparse, os, socket, sys
sys.path.insert(0, {benchmarks!r})
import torch, torch.distributed as dist
from _hosts import leave_rank, write_rank_result
parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int)
parser.add_argument("--rank-results")
args = parser.parse_args()
dist.init_process_group("gloo")
if dist.get_rank() == args.fail_rank:
    sys.exit("failing on purpose")
value = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(value)
write_rank_result(args.rank_results, {{"rank": dist.get_rank(), "sum": value.item(), "host": socket.gethostname()}})
dist.destroy_process_group()
leave_rank()
"""


@pytest.fixture
def hosts(monkeypatch, tmp_path):
    """benchmarks/_hosts.py, and a rank script for it."""
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import _hosts

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(benchmarks=str(bench.benchmarks_dir())))
    return _hosts, str(script)


def _our_namespaces() -> list[str]:
    """This process's hosts' namespaces (named with its pid): a benchmark running beside the tests has its own."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith("torch_ext_host")]
    return [name for name in names if name.endswith(f"_{os.getpid()}")]


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc", "unshare", "hostname"))


@pytest.mark.distributed
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and util-linux")
def test_two_hosts_run_torchrun_in_their_namespaces(hosts):
    _hosts, script = hosts
    run = _hosts.run_on_two_hosts(script, [], timeout_s=120)
    assert run.network.mode == "two-hosts" and "veth" in run.network.label
    assert run.results == [{"rank": 0, "sum": 3.0, "host": "host0"}, {"rank": 1, "sum": 3.0, "host": "host1"}]
    assert not _our_namespaces()
    assert not list(_hosts.NETNS_ETC.glob(f"{_hosts.NETNS_PREFIX}*_{os.getpid()}"))


@pytest.mark.distributed
def test_hosts_fall_back_to_loopback_and_say_why(hosts, monkeypatch, capfd):
    _hosts, script = hosts
    monkeypatch.setattr(_hosts.os, "geteuid", lambda: 1000)
    run = _hosts.run_on_two_hosts(script, [], timeout_s=120)
    assert run.network.mode == "loopback"
    assert run.network.label.startswith("plain loopback (fallback; no two-hosts: ")
    assert "need root" in run.network.label and ", " not in run.network.label
    assert [result["sum"] for result in run.results] == [3.0, 3.0]
    assert "cannot run as two-hosts" in capfd.readouterr().err


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["two-hosts", "loopback"])
def test_a_failed_rank_is_reported_promptly_and_nothing_is_left(hosts, mode):
    _hosts, script = hosts
    if mode == "two-hosts" and not _can_make_namespaces():
        pytest.skip("needs root, iproute2 and util-linux")
    before = _descendants(os.getpid())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host[01] failed \(exit status 1\)"):
        _hosts.run_on_two_hosts(script, ["--fail-rank", "1"], mode=mode, timeout_s=120)
    assert time.monotonic() - start < 60
    assert _descendants(os.getpid()) == before
    assert not _our_namespaces()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if _alive(child):
                found.add(child)
            pending.append(child)
    return found


@pytest.mark.distributed
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and util-linux")
def test_sigterm_to_overlap_stops_both_hosts_and_deletes_the_namespaces(tmp_path):
    process = subprocess.Popen(
        [sys.executable, str(bench.benchmarks_dir() / "overlap.py"), "--quick", "--out", str(tmp_path / "o.csv")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    started = set()

    def both_ranks_run() -> bool:
        # Two torchruns and their workers: the processes given the script's --rank-results.
        ranks = {pid for pid in _descendants(process.pid) if b"--rank-results" in _cmdline(pid)}
        started.update(ranks)
        return len(ranks) >= 4

    _terminate_when(process, both_ranks_run, timeout_s=120)
    assert process.returncode != 0
    assert not any(_alive(pid) for pid in started)
    assert not _our_namespaces()


@pytest.mark.distributed
def test_overlap_started_by_torchrun_reports_on_rank_0(tmp_path):
    # As on two real machines (README "Across machines"), here as one torchrun with 2 ranks.
    out = tmp_path / "overlap.csv"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [
            str(bench.benchmarks_dir() / "overlap.py"),
            "--quick",
            "--reps",
            "2",
            "--ratios",
            "0.5,1",
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("backward ms: median") == 1
    rows = {(row["what"], row["case"], row["metric"]): row for row in csv.DictReader(out.read_text().splitlines())}
    for case in ("overlap x0.5", "overlap x1"):
        assert rows[("torch_ext", case, "efficiency")]["size"].endswith(", torchrun with 2 ranks")
    assert rows[("comm", "overlap", "t_comm_ms")]["size"].endswith(", torchrun with 2 ranks")


def _terminate_when(process: subprocess.Popen, ready, timeout_s: float) -> None:
    """SIGTERM to ``process`` once ``ready()`` (it must not exit before), and waits for it to end."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.1)
        process.terminate()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


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
        f"sys.exit(bench.run_all([bench.Benchmark('sleeper', Path({str(script)!r}))], Path({str(tmp_path / 'out')!r}), True))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-c", driver], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _terminate_when(process, lambda: pids.is_file() and len(pids.read_text().split()) == 2, timeout_s=60)
    assert process.returncode != 0
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), pid


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


def test_an_earlier_runs_files_are_not_reported_as_this_runs(tmp_path, capfd):
    folder = tmp_path / "results"
    folder.mkdir()
    stale = ["overlap.csv", "overlap.png", "overlap_timeline.png", "overlap_timeline.json"]
    for name in stale:
        (folder / name).write_text("from an earlier run")
    # Exits 0 without writing its CSV, as a benchmark that skips itself.
    script = tmp_path / "skipping.py"
    script.write_text("print('skipped: nothing to measure here')\n")
    benchmark = bench.Benchmark("overlap", script, bench.EXTRA_OUTPUTS["overlap"])
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


def test_git_sha_ignores_a_repository_around_an_installed_package(monkeypatch, tmp_path):
    # A wheel installed into a virtualenv inside some other project's repository.
    package = tmp_path / "project" / ".venv" / "site-packages" / "torch_ext"
    (package / "benchmarks").mkdir(parents=True)
    git = ["git", "-C", str(tmp_path / "project"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "project"], check=True)
    common = bench._common()
    monkeypatch.setattr(common, "__file__", str(package / "benchmarks" / "_common.py"))
    assert common.git_sha() == "nogit"
    # The checkout's own sha otherwise: the CSVs and the results folder name use this one helper.
    monkeypatch.undo()
    sha = common.git_sha()
    assert sha == "nogit" or all(c in "0123456789abcdef" for c in sha)
    assert f"-{sha}-quick" in bench.default_folder(quick=True).name


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
    bench.benchmark_module("recsys_torchrec").plot(summary, figure)
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
    result = subprocess.run(
        [
            sys.executable,
            str(bench.benchmarks_dir() / "recsys_torchrec.py"),
            "--quick",
            "--reps",
            "2",
            "--ratios",
            "0.5,1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
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


def test_bench_runs_every_benchmark_script():
    # A new script in benchmarks/ that is not added to BENCHMARK_NAMES would never run: this fails instead.
    scripts = {path.stem for path in bench.benchmarks_dir().glob("*.py") if not path.name.startswith("_")}
    assert scripts == set(bench.BENCHMARK_NAMES)
    assert len(bench.BENCHMARK_NAMES) == len(set(bench.BENCHMARK_NAMES))


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


def microbatch_overlap_sweep_rows(link: str) -> list[tuple]:
    """benchmarks/microbatch_overlap.py's CSV, in the order it writes its shapes: a quick run's pre-path shape at one
    point (no turns, no compute_overlapped, so no limit), then a full run's dispatch-first shape at two (T_comm 70
    ms: the link's time for a step's bytes is 8 x 70 = 560 ms)."""
    size = f"1024 tokens x 256d a microbatch, 7 dense layers, {link}"
    rows = [
        ("comm", "megatron", f"1024 tokens x 256d a microbatch, {link}", "t_comm_ms", 33, 32, 35),
        ("compute", "megatron x1", size, "step_ms", 560, 560, 560),
        ("stock", "megatron x1", size, "one_microbatch_mib", 7, 7, 7),
    ]
    for variant, exposed in (("stock", 320), ("lane", 230), ("overlap", 140)):
        rows += [
            (variant, "megatron x1", size, "step_ms", 560 + exposed, 560 + exposed, 560 + exposed),
            (variant, "megatron x1", size, "exposed_ms", exposed, exposed, exposed),
            (variant, "megatron x1", size, "saved_peak_mib", 7, 7, 7),
        ]
    rows.append(
        ("comm", "megatron dispatch-first", f"1024 tokens x 256d a microbatch, {link}", "t_comm_ms", 70, 68, 72)
    )
    # Per point: the compute step, what two threads added to it, stock's CPU time above the compute step's, and
    # each variant's (step, exposed, forward exposed, backward exposed).
    points = {
        0.5: (480, 10, 16, {"stock": (1080, 600, 240, 320), "lane": (960, 480, 248, 160)}),
        1: (900, 38, 80, {"stock": (1520, 620, 256, 336), "lane": (1360, 460, 264, 144)}),
    }
    rules = {0.5: {"overlap": 300, "turns": 260}, 1: {"overlap": 250, "turns": 200}}
    for ratio, (compute, added, stock_cpu_added, phased) in points.items():
        case = f"megatron dispatch-first x{ratio:g}"
        size = f"1024 tokens x 256d a microbatch, {int(20 * ratio)} dense layers, {link}"
        rows += [
            ("compute", case, size, "step_ms", compute, compute, compute),
            ("compute_overlapped", case, size, "step_ms", compute + added, compute + added, compute + added),
            ("compute_overlapped", case, size, "added_ms", added, added, added),
            ("stock", case, size, "one_microbatch_mib", 8, 8, 8),
            ("stock", case, size, "cpu_added_ms", stock_cpu_added, stock_cpu_added, stock_cpu_added),
        ]
        for variant, (step, exposed, forward, backward) in phased.items():
            rows += [
                (variant, case, size, "step_ms", step, step, step),
                (variant, case, size, "exposed_ms", exposed, exposed, exposed),
                (variant, case, size, "forward_exposed_ms", forward, forward, forward),
                (variant, case, size, "backward_exposed_ms", backward, backward, backward),
                (variant, case, size, "saved_peak_mib", 8, 8, 8),
            ]
        for variant, exposed in rules[ratio].items():
            rows += [
                (variant, case, size, "step_ms", compute + exposed, compute + exposed, compute + exposed),
                (variant, case, size, "exposed_ms", exposed, exposed, exposed),
                (variant, case, size, "saved_peak_mib", 9, 9, 9),
            ]
    return rows


def test_microbatch_overlap_summary_reads_each_rule_against_the_limit(tmp_path):
    link = "2 hosts over a veth shaped to 1gbit"
    write_rows(tmp_path / "microbatch_overlap.csv", microbatch_overlap_sweep_rows(link))
    rows = bench.summarize_folder(tmp_path, ["microbatch_overlap"])
    # One group of rows per (library, shape), the pre-path shape's named as before dispatch-first existed.
    pre_path = {row.variant: row for row in rows if row.case == f"Megatron-core, 8 microbatches, {link}"}
    first = {
        row.variant: row
        for row in rows
        if row.case == f"Megatron-core, dispatch-first, 2 MoE layers, 8 microbatches, {link}"
    }
    assert list(pre_path) == ["stock", "lane", "overlap"] and len(rows) == 7
    assert list(first) == ["stock", "lane", "overlap", "turns"]
    # A quick run timed no compute_overlapped: no limit, no gap.
    assert "limit_exposed_ms" not in pre_path["stock"].values and "gap_closed" not in pre_path["overlap"].values
    assert pre_path["overlap"].measured == "exposed 0.44 of stock's"

    stock = first["stock"]
    # x1, the headline: the edges, one microbatch's forward and backward exposure (the lesser of stock's and the
    # lane's, over 8 microbatches), (256 + 144) / 8 = 50 ms, two threads' 38 ms, and the communication's CPU time
    # beyond the edges', 80 x 7 / 8 = 70 ms, above the link's 560 ms less the 900 ms compute step.
    assert stock.values["limit_exposed_ms"] == pytest.approx(158)
    assert stock.values["limit_fraction"] == pytest.approx(158 / 620)
    assert "edges 50.0 + two threads 38.0 + the communication's CPU 70.0, link 560.0 - compute 900.0" in stock.notes
    # x0.5: the link, 560 - 480 = 80 ms, above (240 + 160) / 8 + 10 + 16 x 7 / 8 = 74 ms.
    assert stock.values["limit_fraction x0.5"] == pytest.approx(80 / 600)
    # Each rule: the fraction of the gap between stock's exposure and the limit it closes.
    overlap = first["overlap"]
    assert overlap.values["gap_closed"] == pytest.approx((620 - 250) / (620 - 158))
    assert overlap.values["gap_closed x0.5"] == pytest.approx((600 - 300) / (600 - 80))
    assert overlap.measured == "exposed 0.40 of stock's, 0.80 of the gap to the limit closed"
    assert first["turns"].values["gap_closed"] == pytest.approx((620 - 200) / (620 - 158))
    assert first["lane"].values["gap_closed"] == pytest.approx((620 - 460) / (620 - 158))
    assert "gap to the limit closed by ratio x0.5: 0.58, x1: 0.80" in overlap.notes

    from matplotlib.figure import Figure

    figure = Figure()
    bench.benchmark_module("microbatch_overlap").plot(rows, figure)
    # dispatch-first's exposure plot (its second row) draws the limit; pre-path's, from a quick run, has none.
    assert "limit" not in {line.get_label() for line in figure.axes[0].get_lines()}
    limit = {line.get_label(): line for line in figure.axes[2].get_lines()}["limit"]
    assert list(limit.get_xdata()) == [0.5, 1] and list(limit.get_ydata()) == pytest.approx([80 / 600, 158 / 620])


def test_microbatch_overlaps_compute_variants_make_no_collective(monkeypatch):
    # No process group: any c10d collective, the overlap's own included, would raise. compute_overlapped (the
    # limit's two threads) must time compute alone, and give the serial compute step's gradients.
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import microbatch_overlap

    assert not dist.is_initialized()

    def refused(group, tokens):
        raise AssertionError("a compute variant called the all_to_all")

    class Undeclared(torch.autograd.Function):
        pass

    batches = [torch.randn(64, microbatch_overlap.DIM) for _ in range(microbatch_overlap.N_MICROBATCHES)]
    for shape in microbatch_overlap.SHAPES:
        model = shape.build(refused, 3)
        grads = {}
        for variant in microbatch_overlap.COMPUTE_VARIANTS:
            model.zero_grad(set_to_none=True)
            with microbatch_overlap.variant_engine(variant, Undeclared):
                microbatch_overlap._accumulate(model, batches, variant)
            grads[variant] = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads["compute"])
        assert all(torch.equal(a, b) for a, b in zip(grads["compute"], grads["compute_overlapped"], strict=True))


def test_step_split_sorts_the_time_both_threads_waited_into_edges_and_middle(monkeypatch):
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    from _step_split import ComputeThreadTimes, compute_thread_times, minus, split_step, union, within

    assert union([(5, 9), (0, 2), (2, 4), (8, 12), (7, 7)]) == [(0, 4), (5, 12)]
    assert minus((0, 10), [(2, 3), (8, 15), (-5, 1)]) == [(1, 2), (3, 8)]
    assert within([(0, 4), (3, 6), (9, 20)], (2, 10)) == 5
    # A step of two microbatches, 0-100. The forward thread waits in microbatch 0's all_to_all (10-20, no backward
    # yet), its hand-over (30-32), microbatch 1's all_to_all (50-60), its hand-over (70-72, the last) and the close
    # (80-95). The backward thread runs backward 0 (32-70), waiting on a collective at 50-55, and backward 1
    # (72-95), waiting at 85-95.
    split = split_step(
        (0, 100),
        forward_waits=[(10, 20), (30, 32), (50, 60), (70, 72), (80, 95)],
        backward_calls=[(32, 70), (72, 95)],
        backward_waits=[(50, 55), (85, 95)],
        last_hand_over_end=72,
    )
    # Both waited: 10-20 and 30-32 before the first backward (leading), 50-55 and 70-72 in between, 85-95 after
    # the last hand-over (trailing).
    assert (split.idle_leading_ns, split.idle_middle_ns, split.idle_trailing_ns) == (12, 7, 10)
    assert split.busy_ns == 71 and split.step_ns == 100
    # The kernel's counts (ns on a core, ns ready) at the step's start and end: threads 1 and 4 (started during the
    # step) compute, thread 2 is gloo's, thread 5 computed but had ended by the end (no count).
    times = compute_thread_times(
        {1: (10, 1), 2: (5, 0), 3: (7, 7)}, {1: (30, 4), 2: (9, 2), 3: (7, 7), 4: (6, 1)}, compute_threads={1, 4, 5}
    )
    assert times == ComputeThreadTimes(on_core_ns=26, ready_ns=4)


class _OneRankAllToAll(torch.autograd.Function):
    """A real all_to_all on a one-rank gloo group, forward and backward, for a traced step of the benchmark."""

    @staticmethod
    def forward(ctx, group, tokens):
        ctx.group = group
        exchanged = torch.empty_like(tokens)
        dist.all_to_all_single(exchanged, tokens.contiguous(), group=group)
        return exchanged

    @staticmethod
    def backward(ctx, grad):
        exchanged = torch.empty_like(grad)
        dist.all_to_all_single(exchanged, grad.contiguous(), group=ctx.group)
        return None, exchanged


@pytest.mark.parametrize("rule", ["overlap", "turns", "twins"])
def test_a_traced_microbatch_overlap_step_accounts_for_its_whole_time(monkeypatch, one_rank_world, rule):
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import microbatch_overlap

    shape = microbatch_overlap.DISPATCH_FIRST
    model = shape.build(_OneRankAllToAll.apply, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = [torch.randn(16, microbatch_overlap.DIM) for _ in range(microbatch_overlap.N_MICROBATCHES)]
    parts, events = microbatch_overlap._traced_step(model, optimizer, batches, rule, _OneRankAllToAll)
    assert model.all_to_all == _OneRankAllToAll.apply  # the timing wrapper is gone
    idle = parts["idle_leading_ms"] + parts["idle_middle_ms"] + parts["idle_trailing_ms"]
    assert parts["busy_ms"] + idle == pytest.approx(parts["step_ms"])
    assert min(parts.values()) >= 0 and parts["busy_ms"] > 0
    # The forward thread's waits: two all_to_alls a MoE layer a microbatch, a hand-over a microbatch, the wait for the
    # last backward, the close.
    forward_names = ("all_to_all", "hand-over", "last backward", "close")
    forward = [e for e in events if e["kind"] == "collective_wait" and e["name"] in forward_names]
    names = [e["name"] for e in forward]
    n = microbatch_overlap.N_MICROBATCHES
    assert names.count("all_to_all") == 2 * shape.moe_layers * n
    assert names.count("hand-over") == n and names.count("last backward") == names.count("close") == 1
    # The kernel's counts: the compute threads ran, and the others' time is the rest of the process's CPU time.
    assert 0 < parts["compute_threads_on_core_ms"] <= parts["cpu_ms"]
    assert parts["other_threads_on_core_ms"] == pytest.approx(parts["cpu_ms"] - parts["compute_threads_on_core_ms"])
    # Every microbatch's backward was traced, on a thread of its own.
    backward_calls = [e for e in events if e["kind"] == "backward"]
    assert len(backward_calls) == n
    assert {e["thread"] for e in backward_calls}.isdisjoint({e["thread"] for e in forward})


def test_microbatch_overlap_refuses_an_unknown_shape_and_a_pinned_depth_without_one_point(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(bench.benchmarks_dir()))
    import microbatch_overlap

    assert microbatch_overlap._parse_shapes("dispatch-first, pre-path") == (
        microbatch_overlap.DISPATCH_FIRST,
        microbatch_overlap.PRE_PATH,
    )
    for argv, message in (
        (["--shapes", "dispatch-last"], "unknown shape 'dispatch-last'; the shapes: pre-path, dispatch-first"),
        (["--dense-layers", "16"], "--dense-layers takes a positive number of layers and one --ratios point"),
        (["--dense-layers", "16", "--ratios", "1,2"], "--dense-layers takes a positive number"),
        (["--dense-layers", "0", "--ratios", "1"], "--dense-layers takes a positive number"),
    ):
        with pytest.raises(SystemExit) as exited:
            microbatch_overlap.main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
