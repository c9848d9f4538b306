"""A synchronous MoE all_to_all (Megatron-core's ``_AllToAll``): what backward priority alone gives.

Megatron-core and DeepSpeed write their expert all_to_all as an autograd Function whose backward runs
the gradient's all_to_all synchronously, inside its node. torch_ext recognises both as collectives and
drives to them first, but the node returns only once the bytes have arrived, so nothing runs while they
move: priority changes the order, not the critical path. This measures that, on 2 ranks as 2 hosts on
the shaped link (``_hosts.run_on_two_hosts``), an expert-parallel layer (tokens dispatched to one expert
per rank at a fixed capacity, combined back) beside a dense path of calibrated depth:

  stock      the backward on PyTorch's engine: dense path first, then the all_to_all
  torch_ext  under ``torch_ext.enabled()``: the all_to_all first, then the dense path
  comm       the all_to_all alone (T_comm)

Reported: backward time (median of the slower rank), its ratio to stock, and the all_to_all node's own
time (hooks before and after it). Before timing, one backward of each engine must give torch.equal
gradients.

    python benchmarks/moe_sync.py [--quick] [--reps N] [--network ...] [--out CSV]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from _common import SummaryRow, bar_chart, csv_row, git_sha, median_backward_s, progress, summarize, write_csv
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    agreed_max,
    leave_rank,
    run_on_two_hosts,
    timed_all_to_all,
    write_rank_result,
)
from torch import nn

import torch_ext

WORLD_SIZE = 2
# Tokens each rank sends each expert, and their width: 2048 x 256 floats = 2 MiB to the other rank, about
# 17 ms at 1 Gbit/s.
CAPACITY = 2048
DIM = 256
MAX_DENSE_LAYERS = 16
VARIANTS = ("stock", "torch_ext", "comm")
ENGINE_VARIANTS = ("stock", "torch_ext")


def has_megatron() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


class Layer(nn.Module):
    def __init__(self, dense_layers: int) -> None:
        super().__init__()
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(dense_layers)])
        self.head = nn.Linear(DIM, 1)
        self.all_to_all_node = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import all_to_all

        group = dist.group.WORLD
        returned = all_to_all(group, self.expert(all_to_all(group, tokens)))
        self.all_to_all_node = returned.grad_fn
        return self.head(returned * torch.sigmoid(self.gate(tokens)) + self.dense(tokens)).sum()


def _engine(variant: str):
    return torch_ext.enabled() if variant == "torch_ext" else contextlib.nullcontext()


def _backward(model: Layer, tokens: torch.Tensor, variant: str) -> tuple[float, float]:
    """(backward s, the all_to_all node's own s)."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens)
    times = {}
    node = model.all_to_all_node
    node.register_prehook(lambda grads: times.__setitem__("start", time.perf_counter()))
    node.register_hook(lambda grads_in, grads_out: times.__setitem__("end", time.perf_counter()))
    dist.barrier()
    start = time.perf_counter()
    with _engine(variant):
        loss.backward()
    return time.perf_counter() - start, times["end"] - times["start"]


def _comm_only() -> float:
    return timed_all_to_all(torch.randn(WORLD_SIZE * CAPACITY, DIM))


def _run_rank(reps: int, warmup: int, calibration_reps: int) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        t_comm = agreed_max(statistics.median(_comm_only() for _ in range(calibration_reps)))
        layer = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        x = torch.randn(WORLD_SIZE * CAPACITY, DIM, requires_grad=True)
        t_layer = agreed_max(median_backward_s(lambda: layer(x).sum(), calibration_reps))
        dense_layers = int(min(MAX_DENSE_LAYERS, max(1, round(t_comm / t_layer))))
        torch.manual_seed(rank)
        model = Layer(dense_layers)
        tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
        grads = {}
        for variant in ENGINE_VARIANTS:
            _backward(model, tokens, variant)
            grads[variant] = [p.grad.clone() for p in model.parameters()]
        if not all(torch.equal(a, b) for a, b in zip(grads["stock"], grads["torch_ext"], strict=True)):
            raise AssertionError(f"rank {rank}: torch_ext's gradients differ from stock's")
        samples = {variant: {"backward_s": [], "node_s": []} for variant in VARIANTS}
        for rep in range(warmup + reps):
            order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
            for variant in order:
                if variant == "comm":
                    measured = {"backward_s": _comm_only()}
                else:
                    backward_s, node_s = _backward(model, tokens, variant)
                    measured = {"backward_s": backward_s, "node_s": node_s}
                if rep >= warmup:
                    for key, value in measured.items():
                        samples[variant][key].append(value)
        result = {"samples": samples, "dense_layers": dense_layers}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def report(results: list[dict], link: str, out: str) -> None:
    first = results[0]
    reps = len(first["samples"]["stock"]["backward_s"])

    def slowest(variant: str) -> list[float]:
        return [max(r["samples"][variant]["backward_s"][i] for r in results) for i in range(reps)]

    sha = git_sha()
    size = f"{CAPACITY} tokens x {DIM}d per expert, {first['dense_layers']} dense layers, {link}"
    stock = statistics.median(slowest("stock"))
    rows = [csv_row("comm", "moe_sync", size, "backward_ms", summarize([t * 1e3 for t in slowest("comm")]), sha)]
    print(f"\nmoe_sync: {size}; T_comm {statistics.median(slowest('comm')) * 1e3:.1f} ms")
    print(f"{'variant':<10} {'backward ms: median [p20-p80]':<32} {'/stock':>7} {'all_to_all node ms':>19}")
    for variant in ENGINE_VARIANTS:
        backward = summarize([t * 1e3 for t in slowest(variant)])
        node = summarize([t * 1e3 for t in first["samples"][variant]["node_s"]])
        rows.append(csv_row(variant, "moe_sync", size, "backward_ms", backward, sha))
        rows.append(csv_row(variant, "moe_sync", size, "all_to_all_node_ms", node, sha))
        print(f"{variant:<10} {backward!s:<32} {backward.median / 1e3 / stock:7.2f} {node.median:19.1f}")
    write_csv(out, rows)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant")
    parser.add_argument("--network", choices=MODES, default=MODES[0], help="where the 2 ranks run (default two-hosts)")
    parser.add_argument("--out", default="results/moe_sync.csv", help="long-format CSV to write")
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    if not has_megatron():
        print("moe_sync: skipped: Megatron-core is not installed (pip install torch==2.13.0 megatron-core==0.16.1)")
        return 0
    reps = args.reps or (5 if args.quick else 20)
    warmup, calibration_reps = (1, 3) if args.quick else (2, 5)
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        results = _run_rank(reps, warmup, calibration_reps)
        if args.rank_results is not None:
            write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
        elif os.environ["RANK"] == "0":
            report(results, f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
        leave_rank()
    progress(f"moe_sync: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {reps} repetitions")
    forwarded = sys.argv[1:] if argv is None else list(argv)
    run = run_on_two_hosts(__file__, forwarded, mode=args.network)
    report(run.results, run.network.label, args.out)
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    stock = rows[("stock", "moe_sync", "backward_ms")]
    scenario, _, case = stock["size"].rpartition(", ")
    comm = rows[("comm", "moe_sync", "backward_ms")]["median"]
    summary = []
    for variant in ENGINE_VARIANTS:
        backward = rows[(variant, "moe_sync", "backward_ms")]["median"]
        node = rows[(variant, "moe_sync", "all_to_all_node_ms")]["median"]
        values = {"backward_ms": backward, "ratio": backward / stock["median"], "all_to_all_node_ms": node}
        notes = f"all_to_all node {node:.3g} ms (T_comm {comm:.3g} ms): synchronous, nothing overlaps it"
        if variant == "stock":
            notes += f"; {scenario}"
        summary.append(
            SummaryRow(
                "moe_sync",
                case,
                variant,
                f"stock {stock['median']:.3g} ms",
                f"{backward:.3g} ms",
                f"{values['ratio']:.2f}",
                notes,
                values,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    bar_chart(
        ax, [r.variant for r in rows], {"backward / stock": [r.values["ratio"] for r in rows]}, "time / stock", 1.0
    )
    ax.set_title(f"Megatron-core's synchronous MoE all_to_all: priority alone, {rows[0].case}")


if __name__ == "__main__":
    sys.exit(main())
