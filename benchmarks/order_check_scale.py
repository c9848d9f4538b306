"""What the collective order check costs per backward as the world grows: engine-thread time and bytes.

The check's ``begin`` runs on the thread that runs backward, once per backward, when the plan is made: it
names each planned collective, computes for each group the collectives use the digest its members compare,
and starts one asynchronous exchange per group over the group's gloo mirror. This benchmark times that call
for synthetic worlds of 8 to 8,192 ranks, in one process, on the fingerprints of a real model's graph:

  ep     a 64-layer MoE with EP = 8: each layer's dispatch and combine all_to_all (two autograd Functions
         declared to a lane, tokens 4096 x hidden 1024), 128 planned collectives on the rank's EP group.
  ep+dp  the same, plus one gradient all_reduce a layer on the rank's data-parallel group, which has
         world / 8 ranks (1,024 at 8,192): 192 planned collectives on two groups, one of them growing with
         the world.

The synthetic groups are registered with the check's group registry (``GroupMirrors.add_made_up``), their
mirror a real one-rank gloo group: ``begin`` runs exactly as in a backward, down to starting the all_reduce,
and only the exchange's partners are missing. The nodes are the graph's own ``grad_fn`` objects, given as the
engine gives them (node, sequence_nr, the gradients' shapes and dtypes). Worlds alternate within every
repetition, after unrecorded warmup repetitions.

Reported per world: ``begin``'s median microseconds [p20-p80], and the bytes it put into exchanges (a 16-byte
digest pair per group used). Aims (issue 35): the cost at 8,192 within 2x of the cost at 8, and the bytes
independent of the world. What is not here: the exchange's wall time on a real network (an all_reduce of 16
bytes over the group's mirror, waited for by the lane that starts the group's first collective), and
``wait`` (one ``work.wait()`` per group, on that lane).

    python -m benchmarks.order_check_scale [--quick] [--reps N] [--out results/order_check_scale.csv]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import torch_ext
from torch_ext.collectives import order_check

from .harness.report import SummaryRow
from .harness.results import csv_row, git_sha, print_columns, write_csv
from .harness.timing import Summary, summarize, timed_call

WORLDS = (8, 64, 512, 1024, 4096, 8192)
EXPERT_PARALLEL = 8
LAYERS = 64
TOKENS, HIDDEN = 4096, 1024
VARIANTS = ("ep", "ep+dp")
REPS, QUICK_REPS = 200, 40
WARMUP_REPS = 5
# The aim: begin at 8,192 ranks within this factor of begin at 8.
AIM = 2.0


class _Group:
    """Stands for a process group of a synthetic world (the check knows it by the ranks registered for it)."""

    def __init__(self, name: str) -> None:
        self.name = name


class AllToAll(torch.autograd.Function):
    """The graph's all_to_all node, as Megatron-core's ``_AllToAll`` saves its group (``ctx.group``)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


class AllReduce(AllToAll):
    """The graph's gradient all_reduce node on the data-parallel group."""


def _planned_collectives(world: int, variant: str, mirror) -> list[tuple]:
    """The collectives a backward of the model plans, in the order the engine gives them to ``begin``: the real
    ``grad_fn`` nodes of a graph whose groups are this synthetic world's (rank 0's EP and DP groups)."""
    ep, dp = _Group(f"ep of {world}"), _Group(f"dp of {world}")
    order_check._MIRRORS.add_made_up(ep, tuple(range(EXPERT_PARALLEL)), mirror)
    order_check._MIRRORS.add_made_up(dp, tuple(range(0, world, EXPERT_PARALLEL)), mirror)
    # Shapes are what the fingerprints hold; a meta tensor keeps a 4096 x 1024 activation free.
    x = torch.empty(TOKENS, HIDDEN, device="meta", requires_grad=True)
    nodes = []
    for _ in range(LAYERS):
        dispatched = AllToAll.apply(ep, x)
        combined = AllToAll.apply(ep, dispatched * 2)
        nodes += [dispatched.grad_fn, combined.grad_fn]
        x = combined
        if variant == "ep+dp":
            reduced = AllReduce.apply(dp, x)
            nodes.append(reduced.grad_fn)
            x = reduced
    # Backward starts them last layer first.
    return [(node, node._sequence_nr(), [((TOKENS, HIDDEN), torch.float32)]) for node in reversed(nodes)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    parser.add_argument("--reps", type=int, help="timed repetitions per world and variant")
    parser.add_argument("--out", default="results/order_check_scale.csv", help="long-format CSV to write")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else REPS)
    if reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    torch.set_num_threads(1)
    sha = git_sha()
    started = time.perf_counter()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch_ext.check_collective_order()
        checker = order_check._checker
        mirror = dist.ProcessGroupGloo(dist.PrefixStore("synthetic/", store), 0, 1, datetime.timedelta(seconds=60))
        plans = {(world, v): _planned_collectives(world, v, mirror) for world in WORLDS for v in VARIANTS}
        samples: dict[tuple[int, str], list[float]] = {key: [] for key in plans}
        sent: dict[tuple[int, str], int] = {}
        print(f"torch {torch.__version__}, git {sha}: {reps} repetitions", file=sys.stderr, flush=True)
        for rep in range(WARMUP_REPS + reps):
            for key, collectives in plans.items():
                before = checker.bytes_sent
                # None: a backward that no microbatch overlap handed over.
                elapsed_ns, exchange = timed_call(checker.begin, collectives, None)
                sent[key] = checker.bytes_sent - before
                checker.wait(exchange)
                if rep >= WARMUP_REPS:
                    samples[key].append(elapsed_ns / 1e3)
        torch_ext.check_collective_order(False)
    finally:
        dist.destroy_process_group()

    rows, lines = [], [("variant", "collectives", "world", "DP group", "begin us", "vs 8 ranks", "bytes sent")]
    for variant in VARIANTS:
        at_smallest = summarize(samples[(WORLDS[0], variant)]).median
        for world in WORLDS:
            cost = summarize(samples[(world, variant)])
            nbytes = sent[(world, variant)]
            rows.append(csv_row("begin", _case(variant, world), str(world), "us", cost, sha))
            rows.append(
                csv_row("exchange", _case(variant, world), str(world), "bytes", Summary(nbytes, nbytes, nbytes), sha)
            )
            dp = str(world // EXPERT_PARALLEL) if variant == "ep+dp" else "-"
            count = str(len(plans[(world, variant)]))
            lines.append((variant, count, str(world), dp, str(cost), f"{cost.median / at_smallest:.2f}", str(nbytes)))
    print_columns(lines)
    print(f"begin: median [p20-p80] us on the engine thread per backward; aim: 8,192 ranks within {AIM:g}x of 8")
    write_csv(args.out, rows)
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


# --- python -m torch_ext bench: the summary table's rows, from the CSV ----------------------------------------


def _case(variant: str, world: int) -> str:
    return f"{variant}, {world} ranks"


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant: begin's cost at the largest world over its cost at the smallest (aim: within 2x),
    and the bytes at each; ``values`` hold every world's, for the plot."""
    summary = []
    for variant in VARIANTS:
        worlds = sorted(
            int(row["size"])
            for (what, case, _), row in rows.items()
            if what == "begin" and case.startswith(f"{variant},")
        )
        cost = {world: rows[("begin", _case(variant, world), "us")]["median"] for world in worlds}
        sent = {world: int(rows[("exchange", _case(variant, world), "bytes")]["median"]) for world in worlds}
        smallest, largest = worlds[0], worlds[-1]
        summary.append(
            SummaryRow(
                "order_check_scale",
                variant,
                f"begin at {largest:,} ranks",
                f"{smallest} ranks {cost[smallest]:.0f} us",
                f"{cost[largest]:.0f} us",
                f"{cost[largest] / cost[smallest]:.2f}",
                f"aim <= {AIM:g}; bytes per backward {sent[smallest]} at {smallest} ranks, {sent[largest]} at "
                f"{largest:,}",
                {**{f"begin_us_{world}": cost[world] for world in worlds}, **{f"bytes_{w}": sent[w] for w in worlds}},
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    for row in rows:
        worlds = sorted(int(key.removeprefix("begin_us_")) for key in row.values if key.startswith("begin_us_"))
        ax.plot(worlds, [row.values[f"begin_us_{world}"] for world in worlds], marker="o", label=row.case)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("ranks in the world")
    ax.set_ylabel("begin, us per backward")
    ax.set_title("The collective order check on the engine thread, by world size")
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
