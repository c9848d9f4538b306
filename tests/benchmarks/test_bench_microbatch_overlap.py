"""benchmarks/microbatch_overlap: its summary against the limit from a CSV, its compute variants, the split of a
traced step, and its options."""

import pytest
import torch
import torch.distributed as dist
from bench_helpers import write_rows

from torch_ext import bench


def microbatch_overlap_sweep_rows(link: str) -> list[tuple]:
    """benchmarks/microbatch_overlap's CSV, in the order it writes its shapes: a quick run's pre-path shape at one
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
    bench.benchmark_module("microbatch_overlap.summary").plot(rows, figure)
    # dispatch-first's exposure plot (its second row) draws the limit; pre-path's, from a quick run, has none.
    assert "limit" not in {line.get_label() for line in figure.axes[0].get_lines()}
    limit = {line.get_label(): line for line in figure.axes[2].get_lines()}["limit"]
    assert list(limit.get_xdata()) == [0.5, 1] and list(limit.get_ydata()) == pytest.approx([80 / 600, 158 / 620])


def test_microbatch_overlaps_compute_variants_make_no_collective():
    # No process group: any c10d collective, the overlap's own included, would raise. compute_overlapped (the
    # limit's two threads) must time compute alone, and give the serial compute step's gradients.
    microbatch_overlap = bench.benchmark_module("microbatch_overlap")
    shapes = bench.benchmark_module("microbatch_overlap.shapes")
    variants = bench.benchmark_module("microbatch_overlap.variants")

    assert not dist.is_initialized()

    def refused(group, tokens):
        raise AssertionError("a compute variant called the all_to_all")

    class Undeclared(torch.autograd.Function):
        pass

    batches = [torch.randn(64, microbatch_overlap.DIM) for _ in range(microbatch_overlap.N_MICROBATCHES)]
    for shape in shapes.SHAPES:
        model = shape.build(refused, 3)
        grads = {}
        for variant in microbatch_overlap.COMPUTE_VARIANTS:
            model.zero_grad(set_to_none=True)
            with variants.variant_engine(variant, Undeclared):
                variants.accumulate(model, batches, variant)
            grads[variant] = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads["compute"])
        assert all(torch.equal(a, b) for a, b in zip(grads["compute"], grads["compute_overlapped"], strict=True))


def test_step_split_sorts_the_time_both_threads_waited_into_edges_and_middle():
    step_split = bench.benchmark_module("microbatch_overlap.step_split")
    union, minus, within, split_step = step_split.union, step_split.minus, step_split.within, step_split.split_step

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
    times = step_split.compute_thread_times(
        {1: (10, 1), 2: (5, 0), 3: (7, 7)}, {1: (30, 4), 2: (9, 2), 3: (7, 7), 4: (6, 1)}, compute_threads={1, 4, 5}
    )
    assert times == step_split.ComputeThreadTimes(on_core_ns=26, ready_ns=4)


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
def test_a_traced_microbatch_overlap_step_accounts_for_its_whole_time(one_rank_world, rule):
    microbatch_overlap = bench.benchmark_module("microbatch_overlap")
    traces = bench.benchmark_module("microbatch_overlap.traces")
    shape = bench.benchmark_module("microbatch_overlap.shapes").DISPATCH_FIRST
    model = shape.build(_OneRankAllToAll.apply, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = [torch.randn(16, microbatch_overlap.DIM) for _ in range(microbatch_overlap.N_MICROBATCHES)]
    parts, events = traces.traced_step(model, optimizer, batches, rule, _OneRankAllToAll)
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


def test_microbatch_overlap_refuses_an_unknown_shape_and_a_pinned_depth_without_one_point(capsys):
    shapes = bench.benchmark_module("microbatch_overlap.shapes")
    main = bench.benchmark_module("microbatch_overlap.__main__").main

    assert shapes.parse_shapes("dispatch-first, pre-path") == (shapes.DISPATCH_FIRST, shapes.PRE_PATH)
    for argv, message in (
        (["--shapes", "dispatch-last"], "unknown shape 'dispatch-last'; the shapes: pre-path, dispatch-first"),
        (["--dense-layers", "16"], "--dense-layers takes a positive number of layers and one --ratios point"),
        (["--dense-layers", "16", "--ratios", "1,2"], "--dense-layers takes a positive number"),
        (["--dense-layers", "0", "--ratios", "1"], "--dense-layers takes a positive number"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
