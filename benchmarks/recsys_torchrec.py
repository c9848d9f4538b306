"""TorchRec's own embedding all_to_all in backward: stock PyTorch against torch_ext, on 2 ranks as 2 hosts.

The model is TorchRec's DLRM (``torchrec.models.dlrm.DLRM``): an EmbeddingBagCollection of TABLES
tables sharded table-wise over the 2 ranks by ``DistributedModelParallel``, with the fused CPU kernel
(the tables' SGD update runs inside their backward), a dense arch of calibrated depth and an over arch.
TorchRec writes its collectives by hand as Req/Wait pairs of autograd Functions
(``torchrec/distributed/comm_ops.py``): in backward, ``All2All_Pooled_WaitBackward`` launches the pooled
embeddings' gradient all_to_all and ``All2All_Pooled_ReqBackward`` waits for it. Stock runs them back to
back after the dense arch, so the communication is exposed. torch_ext knows these classes
(``torch_ext.collectives``): it drives to the launch first and runs the wait as late as the nodes reading
its result allow, so the dense arch's backward runs while the bytes move. Nothing TorchRec-specific is
written by the user: ``torch_ext.enable()`` (here ``torch_ext.enabled()`` around the variant's steps).

Variants, alternating within every repetition, the slowest rank's time counting:

  stock      the training step on PyTorch's engine
  torch_ext  the same step under ``torch_ext.enabled()``
  comm       the backward all_to_all alone: ``dist.all_to_all_single`` of the same pooled gradient
             bytes (T_comm)

Each step is timed as a whole (forward, backward, the dense SGD update; the tables' update is fused into
their backward) and its backward alone. Overlap efficiency = 1 - T_exposed / T_comm, where T_exposed is
the time the wait node (``All2All_Pooled_ReqBackward``) blocks, measured by hooks on that node (before
and after it runs): 0 when the whole transfer is waited for there, 1 when it had already arrived.

Sizes: each rank looks up BATCH samples; the pooled gradient each rank sends the other is
BATCH * (TABLES / 2) * DIM floats (2 MiB with the defaults, about 17 ms at 1 Gbit/s); the dense arch
gets as many Linear(HIDDEN, HIDDEN) layers as make its backward about as long as that transfer
(calibrated on both ranks, the larger depth agreed).

The ranks run as two hosts (``_hosts.run_on_two_hosts``: two network namespaces joined by a veth shaped
to 1 Gbit/s, each rank started by torchrun in its own), falling back as overlap.py says. Before timing,
one step of each engine must give torch.equal dense gradients, losses and local tables after the fused
update, or the script fails. With ``--timeline PNG`` rank 0 draws one traced torch_ext backward.

    python benchmarks/recsys_torchrec.py [--quick] [--reps N] [--network ...] [--timeline PNG] [--out CSV]
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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _common import Summary, SummaryRow, bar_chart, csv_row, git_sha, median_backward_s, progress, summarize, write_csv
from _hosts import (
    MODES,
    RANK_RESULTS_OPTION,
    agreed_max,
    leave_rank,
    run_on_two_hosts,
    timed_all_to_all,
    write_rank_result,
)

import torch_ext

WORLD_SIZE = 2
TABLES = 8
ROWS = 20_000
DIM = 256
BATCH = 512
DENSE_FEATURES = 256
HIDDEN = 256
MAX_DENSE_LAYERS = 40
LEARNING_RATE = 0.01
# TorchRec's Req/Wait pair for pooled embeddings: which node launches the backward all_to_all, which waits.
LAUNCH, WAIT = "All2All_Pooled_WaitBackward", "All2All_Pooled_ReqBackward"

VARIANTS = ("stock", "torch_ext", "comm")
ENGINE_VARIANTS = ("stock", "torch_ext")


@dataclass(frozen=True)
class Config:
    reps: int
    warmup: int
    calibration_reps: int
    timeline_png: str | None = None


def has_torchrec() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))


def _dlrm(dense_layers: int):
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    tables = [
        torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    model = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=DENSE_FEATURES,
        dense_arch_layer_sizes=[HIDDEN] * dense_layers + [DIM],
        over_arch_layer_sizes=[HIDDEN, 1],
        dense_device=torch.device("cpu"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
    )
    constraints = {
        table.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for table in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD_SIZE, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def _batch(rank: int, step: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(1000 * step + rank)
    dense = torch.randn(BATCH, DENSE_FEATURES, generator=generator)
    lengths = torch.randint(1, 4, (TABLES * BATCH,), generator=generator)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths)
    labels = torch.randint(0, 2, (BATCH,), generator=generator).float()
    return dense, sparse, labels


class WaitTimer:
    """Hooks on the graph's wait node: how long it ran (the time the step blocked on the transfer)."""

    def __init__(self) -> None:
        self.start = self.seconds = None

    def attach(self, loss: torch.Tensor) -> None:
        self.start = self.seconds = None
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node.name() == WAIT:
                node.register_prehook(self._before)
                node.register_hook(self._after)
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _before(self, grads):
        self.start = time.perf_counter()

    def _after(self, grads_in, grads_out):
        self.seconds = time.perf_counter() - self.start


def _engine(variant: str):
    return torch_ext.enabled() if variant == "torch_ext" else contextlib.nullcontext()


def _step(model, dense_params, batch, variant: str, wait_timer: WaitTimer) -> tuple[float, float, float | None]:
    """One training step: (whole step s, backward s, wait node s)."""
    dense, sparse, labels = batch
    dist.barrier()
    start = time.perf_counter()
    logits = model(dense, sparse).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    wait_timer.attach(loss)
    backward_start = time.perf_counter()
    with _engine(variant):
        loss.backward()
    backward_end = time.perf_counter()
    with torch.no_grad():
        for p in dense_params:
            p.add_(p.grad, alpha=-LEARNING_RATE)
            p.grad = None
    end = time.perf_counter()
    return end - start, backward_end - backward_start, wait_timer.seconds


def _comm_only() -> float:
    """The pooled gradient's all_to_all alone: each rank sends the other BATCH * TABLES/2 * DIM floats."""
    return timed_all_to_all(torch.randn(WORLD_SIZE * BATCH * (TABLES // 2) * DIM))


def _local_tables(model) -> list[torch.Tensor]:
    return [
        shard.tensor.clone()
        for value in model.state_dict().values()
        if hasattr(value, "local_shards")
        for shard in value.local_shards()
    ]


def _check_same_bits(dense_layers: int, rank: int) -> None:
    """One step of each engine from the same start: torch.equal losses, dense gradients and tables after."""
    results = {}
    for variant in ENGINE_VARIANTS:
        model = _dlrm(dense_layers)
        dense_params = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
        dense, sparse, labels = _batch(rank, 0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(-1), labels)
        with _engine(variant):
            loss.backward()
        results[variant] = [loss.detach()] + [p.grad for p in dense_params] + _local_tables(model)
    for i, (stock, ours) in enumerate(zip(results["stock"], results["torch_ext"], strict=True)):
        if not torch.equal(stock, ours):
            raise AssertionError(f"rank {rank}: torch_ext's result {i} differs from stock's")


def _traced_backward(model, dense_params, batch) -> list[dict]:
    dense, sparse, labels = batch
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(-1), labels)
    dist.barrier()
    with torch_ext.enabled(), torch_ext.trace() as trace:
        loss.backward()
    for p in dense_params:
        p.grad = None
    return [dict(event) for event in trace.events]


def _run_rank(config: Config) -> list[dict]:
    torch.set_num_threads(1)  # two ranks may share two cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        t_comm = agreed_max(statistics.median(_comm_only() for _ in range(config.calibration_reps)))
        layer, x = torch.nn.Linear(HIDDEN, HIDDEN), torch.randn(BATCH, HIDDEN, requires_grad=True)
        t_layer = agreed_max(median_backward_s(lambda: torch.relu(layer(x)).sum(), config.calibration_reps))
        dense_layers = int(min(MAX_DENSE_LAYERS, max(1, round(t_comm / t_layer))))
        _check_same_bits(dense_layers, rank)
        model = _dlrm(dense_layers)
        dense_params = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
        wait_timer = WaitTimer()
        samples: dict[str, dict[str, list[float]]] = {
            variant: {"step_s": [], "backward_s": [], "wait_s": []} for variant in VARIANTS
        }
        for rep in range(config.warmup + config.reps):
            batch = _batch(rank, rep + 1)
            order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
            for variant in order:
                if variant == "comm":
                    measured = {"backward_s": _comm_only()}
                else:
                    step_s, backward_s, wait_s = _step(model, dense_params, batch, variant, wait_timer)
                    measured = {"step_s": step_s, "backward_s": backward_s, "wait_s": wait_s}
                if rep >= config.warmup:
                    for key, value in measured.items():
                        samples[variant][key].append(value)
        timeline = _traced_backward(model, dense_params, _batch(rank, 0)) if config.timeline_png else None
        dist.barrier()
        if rank == 0 and timeline is not None:
            from torch_ext.tracing import plot_timelines

            plot_timelines(
                [("torch_ext", timeline)],
                config.timeline_png,
                title=f"TorchRec DLRM backward on rank 0 under torch_ext ({dense_layers} dense layers)",
            )
            print(f"wrote {config.timeline_png}")
        result = {
            "samples": samples,
            "dense_layers": dense_layers,
            "t_comm_s": t_comm,
            "t_layer_s": t_layer,
        }
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def slowest_rank(results: list[dict]) -> dict:
    """Each repetition's times as its slowest rank's (the step waits for it); the wait as rank 0's."""
    first = results[0]
    merged = {}
    for variant, metrics in first["samples"].items():
        merged[variant] = {}
        for metric, values in metrics.items():
            if metric == "wait_s":
                merged[variant][metric] = values
            else:
                merged[variant][metric] = [
                    max(result["samples"][variant][metric][i] for result in results) for i in range(len(values))
                ]
    return {**first, "samples": merged}


def report(result: dict, link: str, out: str) -> list:
    samples = result["samples"]
    t_comm = statistics.median(samples["comm"]["backward_s"])
    sha = git_sha()
    size = f"DLRM {TABLES} tables x {DIM}d table-wise, {result['dense_layers']} dense layers, {link}"
    rows, table = [], []
    stock_step = statistics.median(samples["stock"]["step_s"])
    stock_backward = statistics.median(samples["stock"]["backward_s"])
    for variant in ENGINE_VARIANTS:
        step = summarize([t * 1e3 for t in samples[variant]["step_s"]])
        backward = summarize([t * 1e3 for t in samples[variant]["backward_s"]])
        exposed = statistics.median(samples[variant]["wait_s"])
        efficiency = max(0.0, 1.0 - exposed / t_comm)
        rows.append(csv_row(variant, "recsys", size, "step_ms", step, sha))
        rows.append(csv_row(variant, "recsys", size, "backward_ms", backward, sha))
        rows.append(
            csv_row(variant, "recsys", size, "wait_ms", summarize([t * 1e3 for t in samples[variant]["wait_s"]]), sha)
        )
        rows.append(csv_row(variant, "recsys", size, "efficiency", Summary(efficiency, efficiency, efficiency), sha))
        table.append(
            (
                variant,
                step,
                step.median / 1e3 / stock_step,
                backward,
                backward.median / 1e3 / stock_backward,
                exposed,
                efficiency,
            )
        )
    rows.append(
        csv_row("comm", "recsys", size, "backward_ms", summarize([t * 1e3 for t in samples["comm"]["backward_s"]]), sha)
    )
    write_csv(out, rows)

    print(
        f"\nrecsys_torchrec: {size}; T_comm {t_comm * 1e3:.1f} ms, one dense layer {result['t_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'variant':<10} {'step ms: median [p20-p80]':<28} {'/stock':>7} {'backward ms':<24} {'/stock':>7} {'wait ms':>8} {'efficiency':>11}"
    )
    for variant, step, step_ratio, backward, backward_ratio, exposed, efficiency in table:
        print(
            f"{variant:<10} {step!s:<28} {step_ratio:7.2f} {backward!s:<24} {backward_ratio:7.2f} "
            f"{exposed * 1e3:8.1f} {efficiency:11.2f}"
        )
    print(f"wrote {out}")
    return table


def _config(args: argparse.Namespace) -> Config:
    timeline_png = None
    if args.timeline is not None:
        if importlib.util.find_spec("matplotlib") is None:
            progress(
                "recsys_torchrec: --timeline skipped: matplotlib is not installed (pip install 'torch_ext[bench]')"
            )
        else:
            timeline_png = os.path.abspath(args.timeline)
    return Config(
        reps=args.reps or (5 if args.quick else 20),
        warmup=1 if args.quick else 2,
        # One dense layer's backward, timed while the other rank times its own on the second core: with 3-5
        # repetitions the slower rank's median ranged 1.0-2.6 ms between runs (14-35 layers, efficiency
        # 0.40-0.99); with 9-15 it stayed at 0.96-1.01 ms (31-38 layers, 0.86-0.99).
        calibration_reps=9 if args.quick else 15,
        timeline_png=timeline_png,
    )


def _rank_main(args: argparse.Namespace) -> None:
    results = _run_rank(_config(args))
    if args.rank_results is not None:
        write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
    elif os.environ["RANK"] == "0":
        report(slowest_rank(results), f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
    leave_rank()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant")
    parser.add_argument("--network", choices=MODES, default=MODES[0], help="where the 2 ranks run (default two-hosts)")
    parser.add_argument("--out", default="results/recsys_torchrec.csv", help="long-format CSV to write")
    parser.add_argument("--timeline", metavar="PNG", help="draw one traced torch_ext backward of rank 0")
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    if not has_torchrec():
        # bench lists a benchmark that exits 0 with this line as skipped.
        print("recsys_torchrec: skipped: TorchRec is not installed (README, 'TorchRec')")
        return 0
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        _rank_main(args)
    config = _config(args)
    progress(f"recsys_torchrec: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, {config.reps} repetitions")
    forwarded = sys.argv[1:] if argv is None else list(argv)
    run = run_on_two_hosts(__file__, forwarded, mode=args.network)
    report(slowest_rank(run.results), run.network.label, args.out)
    return 0


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    summary = []
    stock_step = rows[("stock", "recsys", "step_ms")]
    stock_backward = rows[("stock", "recsys", "backward_ms")]
    scenario, _, case = stock_step["size"].rpartition(", ")
    for variant in ENGINE_VARIANTS:
        step = rows[(variant, "recsys", "step_ms")]["median"]
        backward = rows[(variant, "recsys", "backward_ms")]["median"]
        efficiency = rows[(variant, "recsys", "efficiency")]["median"]
        values = {
            "step_ms": step,
            "backward_ms": backward,
            "efficiency": efficiency,
            "ratio": step / stock_step["median"],
            "backward_ratio": backward / stock_backward["median"],
        }
        notes = f"overlap efficiency {efficiency:.2f}; backward {values['backward_ratio']:.2f} of stock"
        if variant == "stock":
            notes += f"; {scenario}"
        summary.append(
            SummaryRow(
                "recsys_torchrec",
                case,
                variant,
                f"stock {stock_step['median']:.3g} ms/step",
                f"{step:.3g} ms/step",
                f"{values['ratio']:.2f}",
                notes,
                values,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    left, right = figure.subplots(1, 2)
    labels = [r.variant for r in rows]
    bar_chart(left, labels, {"efficiency": [r.values["efficiency"] for r in rows]}, "overlap efficiency", 1.0)
    left.set_title("overlap efficiency (1: all hidden)")
    bar_chart(
        right,
        labels,
        {"step": [r.values["ratio"] for r in rows], "backward": [r.values["backward_ratio"] for r in rows]},
        "time / stock",
        1.0,
    )
    right.set_title("training step and backward time / stock")
    figure.suptitle(f"TorchRec DLRM, embedding all_to_all on 2 gloo ranks, {rows[0].case}")


if __name__ == "__main__":
    sys.exit(main())
