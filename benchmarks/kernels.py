"""torch_ext's multi-tensor gradient ops on CUDA: Triton kernels against torch's foreach/cat and per-tensor loops.

Ops and what each is measured against (the torch_ext op with ``set_triton_enabled(False)`` runs the plain-torch
reference of triton_kernels/multi_tensor_ref.py, i.e. torch's foreach ops and copies):

  accumulate  ``dst[i] += src[i]`` over a list: torch_ext (Triton: one launch per dtype pair, two if
              alignment differs) | reference (``torch._foreach_add_``, which falls back to a launch per
              tensor when dtypes are mixed) | per_tensor (a loop of ``add_``, as stock AccumulateGrad does).
  pack        list -> one flat buffer, scaled and cast: torch_ext | reference (foreach copy into views of
              the buffer) | cat (``torch.cat``, then scale and cast).
  unpack      flat -> the list's tensors, scaled: torch_ext | reference | per_tensor (a loop of ``copy_``).
  sum_n       4-way sum of one tensor: torch_ext (one pass, fp32 accumulation) | chain (``a + b + c + d``,
              as stock's input buffer adds gradients).

Lists: ``small`` is 500 tensors of 768-4096 elements (biases and norms: launch-bound); ``gpt2`` the
gradients of a GPT-2-small transformer stack (12 layers, d=768, no embeddings: 148 tensors, 85M
elements: bandwidth-bound). sum_n runs on 64k and 16M elements.

Method: every variant's result is checked against torch_ext's before timing (torch.equal; sum_n's chain
in bf16 rounds every partial sum, so it is checked against an fp32 chain instead). Then the variants
alternate for --rounds rounds; in each, ``triton.testing.do_bench`` gives the median device time of
one call (CUDA events around each call, L2 flushed between calls), and a host loop the wall time of one
call over back-to-back calls ended by a synchronize, which includes the Python planning of torch_ext's
address tables and per-call launch costs that device time can hide. Reported: median [p20-p80] over
rounds of both, the kernels and copies one call launches (torch.profiler), and the bandwidth: bytes the
op must read and write over the device time, against the device's copy bandwidth (do_bench of a 256 MB
``copy_``, counting bytes read plus written).

    python -m benchmarks.kernels [--quick] [--rounds N] [--block-size N] [--out results/kernels.csv]

Without a CUDA device or without triton there is nothing to measure: it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .harness.report import SummaryRow, bar_chart
from .harness.results import csv_cases, csv_row, git_sha, print_columns, progress, write_csv
from .harness.timing import Summary, summarize

FP32, BF16 = torch.float32, torch.bfloat16
WALL_CALLS = 50  # back-to-back calls per wall-time sample
ROUNDS = 5
# The fewest rounds that give percentiles: --quick checks that every variant runs and agrees.
QUICK_ROUNDS = 2
COPY_BYTES = 256 * 2**20
DEVICE = "cuda"


def gpt2_small_gradient_shapes(layers: int = 12, d: int = 768) -> list[tuple[int, ...]]:
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return per_layer * layers + [(d,), (d,)]


LISTS = {
    "small": [((768, 1024, 2304, 4096)[i % 4],) for i in range(500)],
    "gpt2": gpt2_small_gradient_shapes(),
}


@dataclass(frozen=True)
class Case:
    """One op on one list: ``variants`` maps a name to a function making (call, result-to-check)."""

    op: str
    list_name: str
    dtypes: str
    bytes_moved: int
    variants: dict[str, Callable[[], tuple[Callable[[], object], Callable[[], torch.Tensor | list]]]]


def _randn(shapes, dtype):
    return [torch.randn(shape, device=DEVICE, dtype=dtype) for shape in shapes]


def _numel(shapes) -> int:
    return sum(torch.Size(shape).numel() for shape in shapes)


def _with_triton(enabled: bool, fn: Callable[[], object]) -> Callable[[], object]:
    from torch_ext import kernels

    def call():
        with kernels.set_triton_enabled(enabled):
            return fn()

    return call


def accumulate_case(list_name: str, dst_dtype: torch.dtype, src_dtype: torch.dtype) -> Case:
    from torch_ext import kernels

    shapes = LISTS[list_name]

    def make(variant: str):
        torch.manual_seed(0)
        dsts, srcs = _randn(shapes, dst_dtype), _randn(shapes, src_dtype)
        if variant == "per_tensor":

            def call():
                for d, s in zip(dsts, srcs):
                    d.add_(s)
        else:
            call = _with_triton(variant == "torch_ext", lambda: kernels.multi_tensor_accumulate_(dsts, srcs))
        return call, lambda: dsts

    size = dst_dtype.itemsize * 2 + src_dtype.itemsize
    return Case(
        "accumulate",
        list_name,
        f"{_short(dst_dtype)}+={_short(src_dtype)}",
        _numel(shapes) * size,
        {name: functools.partial(make, name) for name in ("torch_ext", "reference", "per_tensor")},
    )


def pack_case(list_name: str, flat_dtype: torch.dtype, scale: float) -> Case:
    from torch_ext import kernels

    shapes = LISTS[list_name]

    def make(variant: str):
        torch.manual_seed(0)
        tensors = _randn(shapes, FP32)
        result = []
        if variant == "cat":

            def call():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                if scale != 1.0:
                    flat.mul_(scale)
                result[:] = [flat.to(flat_dtype)]
        else:

            def pack():
                result[:] = [kernels.pack(tensors, scale, flat_dtype)]

            call = _with_triton(variant == "torch_ext", pack)
        return call, lambda: result[0]

    return Case(
        "pack",
        list_name,
        f"fp32->{_short(flat_dtype)} x{scale:g}",
        _numel(shapes) * (4 + flat_dtype.itemsize),
        {name: functools.partial(make, name) for name in ("torch_ext", "reference", "cat")},
    )


def unpack_case(list_name: str, flat_dtype: torch.dtype, scale: float) -> Case:
    from torch_ext import kernels

    shapes = LISTS[list_name]

    def make(variant: str):
        torch.manual_seed(0)
        flat = torch.randn(_numel(shapes), device=DEVICE, dtype=flat_dtype)
        outs = [torch.empty(shape, device=DEVICE) for shape in shapes]
        if variant == "per_tensor":
            pieces = flat.split([o.numel() for o in outs])

            def call():
                for out, piece in zip(outs, pieces):
                    out.copy_(piece.view(out.shape))
                    if scale != 1.0:
                        out.mul_(scale)
        else:
            call = _with_triton(variant == "torch_ext", lambda: kernels.unpack_(flat, outs, scale))
        return call, lambda: outs

    return Case(
        "unpack",
        list_name,
        f"{_short(flat_dtype)}->fp32 x{scale:g}",
        _numel(shapes) * (flat_dtype.itemsize + 4),
        {name: functools.partial(make, name) for name in ("torch_ext", "reference", "per_tensor")},
    )


def sum_n_case(numel: int, dtype: torch.dtype, n: int = 4) -> Case:
    from torch_ext import kernels

    def make(variant: str):
        torch.manual_seed(0)
        tensors = _randn([(numel,)] * n, dtype)
        result = []
        if variant == "chain":

            def call():
                result[:] = [functools.reduce(torch.add, tensors)]

            if dtype == FP32:
                return call, lambda: result[0]
            # In 16 bits the chain rounds every partial sum where sum_n rounds once: check the same chain in fp32.
            return call, lambda: functools.reduce(torch.add, [t.float() for t in tensors]).to(dtype)

        def sum_n():
            result[:] = [kernels.sum_n(tensors)]

        return _with_triton(variant == "torch_ext", sum_n), lambda: result[0]

    return Case(
        "sum_n",
        f"{n}x{numel}",
        _short(dtype),
        numel * (n + 1) * dtype.itemsize,
        {name: functools.partial(make, name) for name in ("torch_ext", "reference", "chain")},
    )


def _short(dtype: torch.dtype) -> str:
    return {FP32: "fp32", BF16: "bf16", torch.float16: "fp16"}[dtype]


def cases() -> list[Case]:
    return [
        *(accumulate_case(name, d, s) for name in LISTS for d, s in ((FP32, FP32), (BF16, BF16), (FP32, BF16))),
        *(pack_case(name, dtype, scale) for name in LISTS for dtype, scale in ((FP32, 1.0), (BF16, 0.125))),
        *(unpack_case(name, dtype, scale) for name in LISTS for dtype, scale in ((FP32, 1.0), (BF16, 8.0))),
        *(sum_n_case(numel, dtype) for numel in (2**16, 2**24) for dtype in (FP32, BF16)),
    ]


def _same(actual, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        return torch.equal(actual, expected)
    return len(actual) == len(expected) and all(torch.equal(a, e) for a, e in zip(actual, expected))


def check_variants_agree(case: Case) -> None:
    """Runs every variant once on the same inputs and fails unless all match torch_ext's result."""
    results = {}
    for name, make in case.variants.items():
        call, result = make()
        call()
        torch.cuda.synchronize()
        results[name] = result()
    for name, result in results.items():
        if not _same(result, results["torch_ext"]):
            raise AssertionError(f"{case.op} {case.list_name} {case.dtypes}: {name} differs from torch_ext")


def count_launches(call: Callable[[], object]) -> tuple[int, int]:
    """(kernels, memory copies) one call puts on the device."""
    call()  # compiled and cached outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    events = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum("memcpy" in e.name.lower() or "memset" in e.name.lower() for e in events)
    return len(events) - copies, copies


def wall_us(call: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(WALL_CALLS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / WALL_CALLS / 1e3


def copy_bandwidth_gbs(do_bench) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help=f"alternating rounds of every variant (default {ROUNDS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds (CI smoke run)")
    parser.add_argument("--block-size", type=int, help="elements per Triton program (a power of 2)")
    parser.add_argument("--out", default="results/kernels.csv", help="long-format CSV to write")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else ROUNDS
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (percentiles need two samples)")

    if not torch.cuda.is_available():
        print("no CUDA device: the multi-tensor Triton kernels run only on CUDA (nothing measured)")
        return 0
    try:
        from triton.testing import do_bench

        from torch_ext._triton_kernels import multi_tensor
    except ImportError as e:
        print(f"triton is not installed ({e}): pip install -e '.[triton]' (nothing measured)")
        return 0
    if args.block_size is not None:
        multi_tensor.BLOCK_SIZE = args.block_size

    sha = git_sha()
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs(do_bench)
    print(
        f"torch {torch.__version__}, git {sha}, {device}, block {multi_tensor.BLOCK_SIZE}; "
        f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)"
    )
    started = time.perf_counter()
    rows = [csv_row("device", device, str(COPY_BYTES), "copy_GBps", Summary(copy_gbs, copy_gbs, copy_gbs), sha)]
    table = []
    for case in cases():
        progress(f"{case.op} {case.list_name} {case.dtypes}")
        check_variants_agree(case)
        calls = {name: make()[0] for name, make in case.variants.items()}
        launches = {name: count_launches(call) for name, call in calls.items()}
        device_us: dict[str, list[float]] = {name: [] for name in calls}
        host_us: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                device_us[name].append(do_bench(call) * 1e3)
                host_us[name].append(wall_us(call))
        what = f"{case.op} {case.dtypes}"
        for name in calls:
            kernels, copies = launches[name]
            device_summary, wall_summary = summarize(device_us[name]), summarize(host_us[name])
            gbs = case.bytes_moved / (device_summary.median * 1e-6) / 1e9
            for metric, summary in (
                ("kernels", Summary(kernels, kernels, kernels)),
                ("copies", Summary(copies, copies, copies)),
                ("device_us", device_summary),
                ("wall_us", wall_summary),
                ("GBps", Summary(gbs, gbs, gbs)),
            ):
                rows.append(csv_row(name, what, case.list_name, metric, summary, sha))
            table.append(
                (
                    case.op,
                    case.list_name,
                    case.dtypes,
                    name,
                    f"{kernels}+{copies}",
                    str(device_summary),
                    str(wall_summary),
                    f"{gbs:.0f}",
                    f"{100 * gbs / copy_gbs:.0f}%",
                    f"{wall_summary.median / summarize(host_us['torch_ext']).median:.2f}",
                )
            )
        del calls
        torch.cuda.empty_cache()

    header = (
        "op",
        "list",
        "dtypes",
        "variant",
        "kernels+copies",
        "device us",
        "wall us",
        "GB/s",
        "of copy",
        "wall/torch_ext",
    )
    lines = [header, *table]
    print_columns(lines)
    print(
        "device/wall us: median [p20-p80] over rounds; GB/s: bytes read and written over the median device "
        "time; of copy: against the device's copy bandwidth"
    )
    write_csv(args.out, rows)
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


# kernels.py's variants that do what stock PyTorch code does (the others: torch_ext and its foreach reference).
KERNEL_BASELINES = ("per_tensor", "cat", "chain")


def summary_rows(rows: dict) -> list[SummaryRow]:
    summary = []
    for case in csv_cases(rows, "device_us"):
        ext = rows[("torch_ext", case, "device_us")]["median"]
        for baseline in KERNEL_BASELINES:
            stock = rows.get((baseline, case, "device_us"))
            if stock is None:
                continue
            list_name = rows[("torch_ext", case, "device_us")]["size"]
            summary.append(
                SummaryRow(
                    "kernels",
                    f"{case} {list_name}",
                    "torch_ext",
                    f"{baseline} {stock['median']:.3g} us",
                    f"{ext:.3g} us",
                    f"{ext / stock['median']:.2f}",
                    "device time",
                    {"torch_ext_device_us": ext, "baseline_device_us": stock["median"], "ratio": ext / stock["median"]},
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    labels = [f"{r.case} vs {r.baseline.split()[0]}" for r in rows]
    bar_chart(ax, labels, {"torch_ext/baseline": [r.values["ratio"] for r in rows]}, "device time / baseline", 1.0)
    ax.set_title("Multi-tensor kernels: device time, torch_ext / stock's way")


if __name__ == "__main__":
    sys.exit(main())
