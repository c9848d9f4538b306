"""Split backward on a matmul-heavy pipeline stage: stock's full backward, torch.distributed.pipelining's
split and torch_ext's split, timed and memory-profiled in one process.

The stage: ``depth`` blocks of Linear(width, 4*width) -> GELU -> Linear(4*width, width) -> +residual,
on ``tokens`` rows, with an input that requires grad (a middle pipeline stage) and a random output
gradient (what the next stage sends back). Nearly all of backward is matmuls: a full backward does
two per Linear (input and weight gradient), the input pass (dI) one, the weight pass (dW) the other.
A second case wraps each block in non-reentrant activation checkpointing: each pass of a split
backward is its own graph task and recomputes the blocks it needs, so a split costs one more
forward of the stage than a full backward.

Variants, each asked for the stage's input gradient and its weights' .grad:

  stock_full       ``torch.autograd.backward(out, grad)``: dI and dW in one pass (stock engine).
  pipelining       ``torch.distributed.pipelining._backward.stage_backward_input`` then
                   ``stage_backward_weight``: a Python graph walk, node pre-hooks and two
                   ``autograd.grad`` calls on the stock engine, the first retaining the graph.
  torch_ext        ``torch_ext.pipelining.stage_backward_input`` then ``stage_backward_weight`` (the
                   drop-ins, same interface and bookkeeping as pipelining's), on torch_ext's engine.

Time: the variants alternate in one process, in that order in every repetition, after warmup
repetitions that are not recorded. The stage's forward is rebuilt before each variant (untimed) and
.grad reset; dI and dW are timed separately (time.perf_counter_ns, Python's cyclic GC off during each
call), dI+dW is their sum; for stock_full the single call counts as dI+dW. Reported: medians, 20th and
80th percentiles, and the ratios the issue sets targets for: torch_ext dI / stock full (aim <= 0.6),
torch_ext dI+dW / stock full (aim <= 1.05), and torch_ext / pipelining per pass (aim < 1).

Memory: CPU has no allocator statistics, so each variant runs once more (untimed, after timing)
under ``torch.profiler`` with ``profile_memory=True``, which reports every CPU allocation and free
(size and time) made while it is on, from the start of the forward, so every activation the backward
frees is counted. ``record_function`` ranges mark each pass. The live bytes at each event are the
running sum of sizes; per pass the script reports the peak above the live bytes when backward started,
and what stayed alive after dI (the saved tensors and gradients kept for dW, minus the activations
already freed; negative when dI freed more than it kept).

Before anything is timed, all three variants must give torch.equal input gradients and weight
gradients, or the script fails.

    python -m benchmarks.split_backward [--quick] [--reps N] [--out results/split_backward.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import _backward as pipelining_backward
from torch.utils.checkpoint import checkpoint

import torch_ext.pipelining

from .harness.report import SummaryRow, bar_chart
from .harness.results import csv_cases, csv_row, git_sha, print_columns, progress, write_csv
from .harness.timing import Summary, summarize, timed_call

WARMUP_REPS = 2
# Both engines run CPU nodes on the calling thread; intra-op threads only change the matmuls. One
# thread, as in engine_overhead.py: two OpenMP threads on the shared 2-core machine stalled.
DEFAULT_THREADS = 1


@dataclass(frozen=True)
class StageConfig:
    name: str = "mlp_stage"
    depth: int = 6
    width: int = 256
    tokens: int = 256
    # Non-reentrant activation checkpointing around each block (pytorch#136766: stock's split ran
    # out of memory with it).
    checkpointed: bool = False
    # Measured here: ~170 ms per repetition of all three variants, forwards included (stock full
    # backward ~55 ms); ~230 ms checkpointed. The defaults run in ~25 s in all.
    reps: int = 40
    quick_reps: int = 6

    @property
    def size(self) -> str:
        return f"{self.depth}x({self.width}->{4 * self.width})/t{self.tokens}"


CASES = (StageConfig(), StageConfig(name="mlp_stage_checkpointed", checkpointed=True, reps=30))


class Block(nn.Module):
    def __init__(self, width: int, checkpointed: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


@dataclass
class StageRun:
    """One microbatch's forward, ready for backward."""

    x: torch.Tensor
    out: torch.Tensor
    grad: torch.Tensor


@dataclass
class Result:
    input_pass_ns: int
    # None for a variant with a single pass.
    weight_pass_ns: int | None
    input_grad: torch.Tensor
    weight_grads: list[torch.Tensor]

    @property
    def total_ns(self) -> int:
        return self.input_pass_ns + (self.weight_pass_ns or 0)


@dataclass(frozen=True)
class Variant:
    name: str
    # (model, stage run) -> result; with `mark` wrapping each pass (record_function for memory).
    run: Callable[[nn.Module, StageRun, Callable], Result]


def _no_mark(name: str):
    return _Unmarked()


class _Unmarked:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


def run_full(model: nn.Module, stage: StageRun, mark: Callable) -> Result:
    with mark("full"):
        elapsed, _ = timed_call(torch.autograd.backward, stage.out, stage.grad)
    return Result(elapsed, None, stage.x.grad, [p.grad for p in model.parameters()])


def split_runner(stage_backward_input: Callable, stage_backward_weight: Callable) -> Callable:
    def run(model: nn.Module, stage: StageRun, mark: Callable) -> Result:
        with mark("dI"):
            input_ns, (_, param_groups) = timed_call(
                stage_backward_input, [stage.out], [stage.grad], [stage.x], model.parameters()
            )
        with mark("dW"):
            weight_ns, _ = timed_call(stage_backward_weight, model.parameters(), param_groups)
        return Result(input_ns, weight_ns, stage.x.grad, [p.grad for p in model.parameters()])

    return run


VARIANTS = (
    Variant("stock_full", run_full),
    Variant(
        "pipelining", split_runner(pipelining_backward.stage_backward_input, pipelining_backward.stage_backward_weight)
    ),
    Variant(
        "torch_ext", split_runner(torch_ext.pipelining.stage_backward_input, torch_ext.pipelining.stage_backward_weight)
    ),
)


def make_stage(config: StageConfig) -> tuple[nn.Module, Callable[[], StageRun]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(config.width, config.checkpointed) for _ in range(config.depth)))
    x_data = torch.randn(config.tokens, config.width)
    grad = torch.randn(config.tokens, config.width)

    def forward() -> StageRun:
        for p in model.parameters():
            p.grad = None
        x = x_data.clone().requires_grad_()
        return StageRun(x, model(x), grad)

    return model, forward


class GradientMismatch(AssertionError):
    pass


def check_same_gradients(model: nn.Module, forward: Callable[[], StageRun]) -> None:
    results = {variant.name: variant.run(model, forward(), _no_mark) for variant in VARIANTS}
    reference = results["stock_full"]
    for name, result in results.items():
        pairs = [("input gradient", result.input_grad, reference.input_grad)]
        pairs += [
            (f"weight {i}", ours, theirs)
            for i, (ours, theirs) in enumerate(zip(result.weight_grads, reference.weight_grads))
        ]
        for what, ours, theirs in pairs:
            if ours is None or not torch.equal(ours, theirs):
                raise GradientMismatch(f"{name}: {what} differs from stock's full backward")


def time_alternating(
    model: nn.Module, forward: Callable[[], StageRun], reps: int, warmup: int
) -> dict[str, list[Result]]:
    samples: dict[str, list[Result]] = {variant.name: [] for variant in VARIANTS}
    for rep in range(warmup + reps):
        for variant in VARIANTS:
            stage = forward()
            result = variant.run(model, stage, _no_mark)
            # Freed here, outside the timed calls.
            del stage
            if rep >= warmup:
                samples[variant.name].append(dataclasses.replace(result, input_grad=None, weight_grads=[]))
    return samples


@dataclass(frozen=True)
class MemoryProfile:
    # Peak live bytes above the live bytes when backward started, per marked pass.
    peak_above_start: dict[str, int]
    # Live bytes after dI minus live bytes before it (split variants).
    held_after_input_pass: int | None


def profile_memory(variant: Variant, model: nn.Module, forward: Callable[[], StageRun]) -> MemoryProfile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        stage = forward()
        variant.run(model, stage, torch.profiler.record_function)
        del stage
    events = profile.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in ("full", "dI", "dW")}

    def live_before(t: int) -> int:
        return sum(size for when, size in allocations if when < t)

    start = min(begin for begin, _ in ranges.values())
    at_start = live_before(start)
    peaks = {}
    for name, (begin, end) in ranges.items():
        live = live_before(begin)
        peak = live
        for when, size in allocations:
            if begin <= when <= end:
                live += size
                peak = max(peak, live)
        peaks[name] = peak - at_start
    held = None
    if "dI" in ranges:
        held = live_before(ranges["dI"][1] + 1) - live_before(ranges["dI"][0])
    return MemoryProfile(peaks, held)


def run_case(config: StageConfig, warmup: int, sha: str) -> list[dict[str, object]]:
    model, forward = make_stage(config)
    check_same_gradients(model, forward)
    samples = time_alternating(model, forward, config.reps, warmup)
    progress(f"{config.name}: memory profile of each variant")
    memory = {variant.name: profile_memory(variant, model, forward) for variant in VARIANTS}

    rows = []
    ms = {}
    for name, results in samples.items():
        ms[name] = {"dI+dW": summarize([r.total_ns / 1e6 for r in results])}
        if results[0].weight_pass_ns is not None:
            ms[name]["dI"] = summarize([r.input_pass_ns / 1e6 for r in results])
            ms[name]["dW"] = summarize([r.weight_pass_ns / 1e6 for r in results])
        for metric, summary in ms[name].items():
            rows.append(csv_row(name, config.name, config.size, f"{metric}_ms", summary, sha))
        for metric, peak in memory[name].peak_above_start.items():
            mb = peak / 2**20
            rows.append(csv_row(name, config.name, config.size, f"peak_{metric}_mb", Summary(mb, mb, mb), sha))
        held = memory[name].held_after_input_pass
        if held is not None:
            mb = held / 2**20
            rows.append(csv_row(name, config.name, config.size, "held_after_dI_mb", Summary(mb, mb, mb), sha))

    def paired(numerator: str, denominator: str, metric: Callable[[Result], int]) -> Summary:
        pairs = zip(samples[numerator], samples[denominator], strict=True)
        return summarize([metric(a) / metric(b) for a, b in pairs])

    ratios = {
        "torch_ext dI / stock full": paired(
            "torch_ext", "stock_full", lambda r: r.input_pass_ns if r.weight_pass_ns is not None else r.total_ns
        ),
        "torch_ext dI+dW / stock full": paired("torch_ext", "stock_full", lambda r: r.total_ns),
        "pipelining dI+dW / stock full": paired("pipelining", "stock_full", lambda r: r.total_ns),
        "torch_ext dI / pipelining dI": paired("torch_ext", "pipelining", lambda r: r.input_pass_ns),
        "torch_ext dW / pipelining dW": paired("torch_ext", "pipelining", lambda r: r.weight_pass_ns),
    }
    for label, summary in ratios.items():
        rows.append(csv_row(label, config.name, config.size, "ratio", summary, sha))

    header = ("variant", "dI ms", "dW ms", "dI+dW ms", "peak dI MB", "peak dW MB", "peak MB", "held after dI MB")

    def megabytes(value: int | None) -> str:
        return "-" if value is None else f"{value / 2**20:.1f}"

    lines = [header]
    for name in samples:
        peaks = memory[name].peak_above_start
        lines.append(
            (
                name,
                str(ms[name].get("dI", "-")),
                str(ms[name].get("dW", "-")),
                str(ms[name]["dI+dW"]),
                megabytes(peaks.get("dI")),
                megabytes(peaks.get("dW")),
                megabytes(max(peaks.values())),
                megabytes(memory[name].held_after_input_pass),
            )
        )
    print_columns(lines)
    print(
        "ms: median [p20-p80]; peak: above the live bytes when backward started (peak MB: of the whole "
        "backward); held after dI: live bytes after dI minus before it"
    )
    for label, summary in ratios.items():
        print(f"{label}: {summary.median:.3f} (paired p20-p80 {summary.p20:.3f}-{summary.p80:.3f})")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    parser.add_argument("--reps", type=int, help="timed repetitions of each variant")
    parser.add_argument("--out", default="results/split_backward.csv", help="long-format CSV to write")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    torch.set_num_threads(args.threads)
    warmup = 1 if args.quick else WARMUP_REPS
    sha = git_sha()
    print(f"torch {torch.__version__}, git {sha}, {torch.get_num_threads()} intra-op threads")
    started = time.perf_counter()
    rows = []
    for config in CASES:
        reps = args.reps if args.reps is not None else (config.quick_reps if args.quick else config.reps)
        config = dataclasses.replace(config, reps=reps)
        progress(f"{config.name} {config.size}: {reps} repetitions of each variant")
        print(f"\n{config.name} {config.size}")
        rows += run_case(config, warmup, sha)

    write_csv(args.out, rows)
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


SPLIT_VARIANTS = ("pipelining", "torch_ext")


def _split_ratio(rows: dict, case: str, label: str, fallback: float) -> float:
    """The median of split_backward.py's paired ratio ``label`` (per repetition, as it reports it); without
    that row, ``fallback`` (a ratio of medians)."""
    row = rows.get((label, case, "ratio"))
    return fallback if row is None else row["median"]


def summary_rows(rows: dict) -> list[SummaryRow]:
    """dI/full and (dI+dW)/full are split_backward.py's paired ratios where it writes them ("torch_ext dI /
    stock full", "<variant> dI+dW / stock full"), else ratios of the medians; dW/full is a ratio of medians."""
    summary = []
    for case in csv_cases(rows, "dI+dW_ms"):
        full = rows[("stock_full", case, "dI+dW_ms")]["median"]
        stock_peak = rows[("stock_full", case, "peak_full_mb")]["median"]
        for variant in SPLIT_VARIANTS:
            d_input = rows[(variant, case, "dI_ms")]["median"]
            d_weight = rows[(variant, case, "dW_ms")]["median"]
            peak = max(rows[(variant, case, f"peak_{p}_mb")]["median"] for p in ("dI", "dW"))
            values = {
                "dI/full": _split_ratio(rows, case, f"{variant} dI / stock full", d_input / full),
                "dW/full": d_weight / full,
                "(dI+dW)/full": _split_ratio(
                    rows, case, f"{variant} dI+dW / stock full", rows[(variant, case, "dI+dW_ms")]["median"] / full
                ),
                "peak_mb": peak,
                "stock_full_peak_mb": stock_peak,
                "held_after_dI_mb": rows[(variant, case, "held_after_dI_mb")]["median"],
            }
            notes = f"peak {peak:.1f} MB (stock {stock_peak:.1f}), held after dI {values['held_after_dI_mb']:.1f} MB"
            if variant == "torch_ext":
                for pass_name in ("dI", "dW"):
                    values[f"{pass_name}/pipelining"] = rows[
                        (f"torch_ext {pass_name} / pipelining {pass_name}", case, "ratio")
                    ]["median"]
                notes += f"; vs pipelining: dI {values['dI/pipelining']:.2f}, dW {values['dW/pipelining']:.2f}"
            summary.append(
                SummaryRow(
                    "split_backward",
                    case,
                    variant,
                    f"stock full {full:.3g} ms",
                    f"dI {d_input:.3g} + dW {d_weight:.3g} ms",
                    f"dI {values['dI/full']:.2f}, dW {values['dW/full']:.2f}, dI+dW {values['(dI+dW)/full']:.2f}",
                    notes,
                    values,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(1, len(cases), squeeze=False)[0]
    metrics = ("dI/full", "dW/full", "(dI+dW)/full")
    for ax, case in zip(axes, cases):
        by_variant = {r.variant: r for r in rows if r.case == case}
        bar_chart(
            ax,
            list(metrics),
            {v: [by_variant[v].values[m] for m in metrics] for v in by_variant},
            "/ stock full backward",
            1.0,
        )
        ax.set_title(case, fontsize=9)
    figure.suptitle("Split backward: passes' time / stock's full backward")


if __name__ == "__main__":
    sys.exit(main())
