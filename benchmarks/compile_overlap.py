"""A compiled MoE block: torch.compile's own overlap against torch_ext's, on the shaped link.

On 2 ranks as 2 hosts on the shaped link (``_hosts.run_on_two_hosts``), an expert-parallel block whose token
exchange is PyTorch's functional ``all_to_all_single_autograd`` (a router, the dispatch, an expert, the combine),
beside a dense path, run compiled and eager:

  stock               eager, PyTorch's engine
  torch_ext           eager, torch_ext's engine, the all_to_all declared to a lane
                      (``run_in_lane(torch.ops._c10d_functional.all_to_all_single)``)
  compiled            ``torch.compile(model)``, Inductor's defaults, PyTorch's engine: the backward is one node
  reordered           the same, its backward under compiled autograd (one graph, so that Inductor can move the
                      all_to_alls in it), forward and backward with the reorder passes Inductor's config
                      recommends (``reorder_for_compute_comm_overlap`` and ``REORDER_PASSES``)
  torch_ext_compiled  ``torch.compile(model, backend=torch_ext.compile_backend(), fullgraph=True)`` on torch_ext's
                      engine with the lane: the graph split at each all_to_all, the compute compiled by Inductor
  hand_compiled       torch_ext's engine with the lane, the dense path and the expert each compiled by hand
                      (``torch.compile(module)``), the all_to_alls eager: what a user could do without the backend
                      (a full run only)

and, for the efficiency by step time, each setup's compute-only backward (the all_to_all replaced by the identity):
``compute`` (eager) and ``compiled_compute`` (Inductor; the split backend hands a graph with no collective to
Inductor whole, so it is the compiled variants' compute-only step too).

T_comm, the sweep over dense/comm ratios and the efficiency (1 - exposed / T_comm, the exposed time read from the
ranks' blocked time) are moe_sync's (``_common``). Before timing, torch_ext's gradients must be ``torch.equal`` to
stock's: eager against eager, and torch_ext_compiled against PyTorch's engine on the same compiled model. A quick
run times every variant at the headline point only (x1).

    python benchmarks/compile_overlap.py [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...] [--out CSV]
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _common import (
    CALIBRATION_S,
    Summary,
    SummaryRow,
    SweepConfig,
    calibrate_t_comm,
    csv_row,
    dense_layer_backward_s,
    exposure,
    git_sha,
    headline_over_stock,
    headline_point,
    load_note,
    measured_ratio,
    measured_ratio_row,
    merge_ranks,
    parse_sweep_args,
    plot_efficiency_curves,
    print_load,
    run_sweep,
    step_efficiency,
    summarize,
    sweep_case,
    sweep_cases,
    sweep_config,
    sweep_depth,
    sweep_parser,
    sweep_summary_row,
    timed_blocking,
    timed_repetitions,
    timed_variants,
    write_csv,
)
from _hosts import agreed_max
from torch import nn

import torch_ext
from torch_ext.compiler import MATMULS_PER_REGION

WORLD_SIZE = 2
# moe_sync's sizes: 2048 tokens x 256 floats each way (2 MiB), the dense path on 1024 rows (~3 ms a layer here).
CAPACITY = 2048
DIM = 256
DENSE_ROWS = 1024
MAX_DENSE_LAYERS = 64
FUNCOL_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single
ENGINE_VARIANTS = ("stock", "torch_ext", "compiled", "reordered", "torch_ext_compiled", "hand_compiled")
COMPUTE_VARIANTS = ("compute", "compiled_compute")
TIMED_VARIANTS = (*COMPUTE_VARIANTS, *ENGINE_VARIANTS)
# Each variant's compute-only step, for its efficiency by step time.
COMPUTE_OF = {
    "stock": "compute",
    "torch_ext": "compute",
    "compiled": "compiled_compute",
    "reordered": "compiled_compute",
    "torch_ext_compiled": "compiled_compute",
    "hand_compiled": "compiled_compute",
}
TORCH_EXT_VARIANTS = ("torch_ext", "torch_ext_compiled", "hand_compiled")
# The passes torch/_inductor/config.py recommends for reorder_for_compute_comm_overlap (torch 2.13).
REORDER_PASSES = [
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
]
REORDER_OPTIONS = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": REORDER_PASSES}
# A quick run times every variant of the comparison at one point (QUICK_RATIOS), since each point compiles its
# setups anew; hand_compiled explains a figure (docs/benchmarks.md) rather than being one to beat, and costs two
# more compiles.
QUICK_LEFT_OUT = ("hand_compiled",)


def _identity(tokens: torch.Tensor, group) -> torch.Tensor:
    return tokens


def _all_to_all(tokens: torch.Tensor, group) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(tokens, None, None, group)


class Block(nn.Module):
    """The expert-parallel block beside ``dense_layers`` Linear + ReLU layers (the layer _common's calibration times);
    with none, the all_to_all has nothing to hide behind (T_comm's calibration)."""

    def __init__(self, dense_layers: int) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, 1)
        self.dense = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(dense_layers)])

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        exchange = _all_to_all if communicate else _identity
        group = dist.group.WORLD
        returned = exchange(self.expert(exchange(self.router(tokens), group)), group)
        moe = self.head(returned).sum()
        if not self.dense:
            return moe
        return moe + self.dense(tokens[:DENSE_ROWS]).sum()


class Setups:
    """One block per compiled setup, each a copy of the eager one (so their optimizers' steps stay apart)."""

    def __init__(self, dense_layers: int, variants: Sequence[str], backend_options: dict) -> None:
        self.eager = Block(dense_layers)
        self.modules = {"stock": self.eager, "torch_ext": self.eager, "compute": self.eager}
        self.callables = dict(self.modules)
        for variant, compile_kwargs in (
            ("compiled", {}),
            ("reordered", {"options": REORDER_OPTIONS}),
            ("torch_ext_compiled", {"backend": torch_ext.compile_backend(**backend_options), "fullgraph": True}),
        ):
            module = copy.deepcopy(self.eager)
            self.modules[variant] = module
            self.callables[variant] = torch.compile(module, **compile_kwargs)
        if "hand_compiled" in variants:
            module = copy.deepcopy(self.eager)
            module.dense, module.expert = torch.compile(module.dense), torch.compile(module.expert)
            self.modules["hand_compiled"] = self.callables["hand_compiled"] = module
        self.modules["compiled_compute"] = self.modules["compiled"]
        self.callables["compiled_compute"] = self.callables["compiled"]
        self.optimizers = {
            variant: torch.optim.SGD(module.parameters(), lr=1e-4) for variant, module in self.modules.items()
        }


@functools.cache
def _reordering_backward_compiler():
    # One for the process: compiled autograd caches its graphs per compiler.
    return torch.compile(backend="inductor", options=REORDER_OPTIONS)


def _engine(variant: str):
    if variant == "reordered":
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(_reordering_backward_compiler())
    return torch_ext.enable() if variant in TORCH_EXT_VARIANTS else contextlib.nullcontext()


def _step(setups: Setups, tokens: torch.Tensor, variant: str) -> dict[str, float]:
    """Seconds of a forward, backward and SGD step (``step_s``), of its backward (``backward_s``) and blocked in
    the backward (``blocked_s``), the ranks started together."""
    model, optimizer = setups.callables[variant], setups.optimizers[variant]
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, communicate=variant not in COMPUTE_VARIANTS)
    with _engine(variant):
        backward_s, blocked_s = timed_blocking(loss.backward)
    optimizer.step()
    return {"step_s": time.perf_counter() - start, "backward_s": backward_s, "blocked_s": blocked_s}


def _gradients(setups: Setups, tokens: torch.Tensor, variant: str, engine: str) -> list[torch.Tensor]:
    """``variant``'s model's gradients, its backward run as ``engine``'s (a variant's name) is."""
    module = setups.modules[variant]
    module.zero_grad(set_to_none=True)
    loss = setups.callables[variant](tokens)
    with _engine(engine):
        loss.backward()
    return [p.grad.clone() for p in module.parameters()]


def _check_bits(setups: Setups, tokens: torch.Tensor, rank: int) -> None:
    """torch_ext's gradients against PyTorch's engine on the same model: eager, and the split compiled one. Compiles
    every setup on the way (the first call of each), before anything is timed."""
    pairs = [("torch_ext", "stock"), ("torch_ext_compiled", "torch_ext_compiled")]
    if "hand_compiled" in setups.modules:
        pairs.append(("hand_compiled", "hand_compiled"))
    for variant, reference in pairs:
        expected = _gradients(setups, tokens, reference, engine="stock")
        got = _gradients(setups, tokens, variant, engine=variant)
        if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
            raise AssertionError(f"rank {rank}: {variant}'s gradients differ from PyTorch's engine on the same model")
    for variant in ("compiled", "reordered"):
        _gradients(setups, tokens, variant, engine=variant)
    for variant in COMPUTE_VARIANTS:
        setups.callables[variant](tokens, communicate=False).backward()


def _run_rank(config: SweepConfig, backend_options: dict) -> dict:
    """One rank's part, in the process group: T_comm, then each sweep point's times per variant."""
    rank = dist.get_rank()
    torch_ext.run_in_lane(FUNCOL_ALL_TO_ALL)
    t_layer = agreed_max(dense_layer_backward_s(DIM, DENSE_ROWS, config.calibration_reps, CALIBRATION_S))
    torch.manual_seed(rank)
    tokens = torch.randn(WORLD_SIZE * CAPACITY, DIM)
    probe = Block(0)
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=1e-4)

    def stock_step() -> dict[str, float]:
        dist.barrier()
        probe_optimizer.zero_grad(set_to_none=True)
        loss = probe(tokens)
        backward_s, blocked_s = timed_blocking(loss.backward)
        probe_optimizer.step()
        return {"backward_s": backward_s, "blocked_s": blocked_s}

    comm_s = calibrate_t_comm(stock_step)
    t_comm = statistics.median(comm_s)
    points = []
    for ratio in config.ratios:
        dense_layers = sweep_depth(ratio, t_comm, t_layer, MAX_DENSE_LAYERS)
        torch.manual_seed(rank)
        torch._dynamo.reset()
        variants = timed_variants(config, TIMED_VARIANTS, QUICK_LEFT_OUT)
        setups = Setups(dense_layers, variants, backend_options)
        compile_start = time.perf_counter()
        _check_bits(setups, tokens, rank)
        compile_s = time.perf_counter() - compile_start

        def measure(variant: str, _rep: int, setups=setups) -> dict[str, float]:
            return _step(setups, tokens, variant)

        samples = timed_repetitions(variants, measure, config.reps, config.warmup)
        points.append({"ratio": ratio, "dense_layers": dense_layers, "samples": samples, "compile_s": compile_s})
    torch_ext.unregister_collective_backward(FUNCOL_ALL_TO_ALL)
    matmuls_per_region = backend_options.get("matmuls_per_region", MATMULS_PER_REGION)
    return {"comm_s": comm_s, "t_layer": t_layer, "points": points, "matmuls_per_region": matmuls_per_region}


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    first = results[0]
    comm = summarize([t * 1e3 for t in first["comm_s"]])
    t_comm = comm.median / 1e3
    scenario = f"{CAPACITY} tokens x {DIM}d per expert"
    print(
        f"\ncompile_overlap: {scenario}, {link}; T_comm {comm} ms (stock's wait with no dense path, "
        f"{len(first['comm_s'])} steps), one dense layer {first['t_layer'] * 1e3:.2f} ms; compile_backend's regions "
        f"hold at most {first['matmuls_per_region']} matrix products"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<18} {'backward ms':>12} {'/stock':>7} {'step ms':>9} {'/stock':>7} "
        f"{'compute step ms':>15} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>6}"
    )
    rows.append(csv_row("comm", "compile_overlap", f"{scenario}, {link}", "t_comm_ms", comm, sha))
    for index, point in enumerate(merge_ranks([r["points"] for r in results])):
        samples = point["samples"]
        case = sweep_case("compile_overlap", point["ratio"])
        size = f"{scenario}, {point['dense_layers']} dense layers, {link}"
        stock_backward = statistics.median(samples["stock"]["backward_s"])
        stock_step = statistics.median(samples["stock"]["step_s"])
        ratio = measured_ratio(samples["compute"]["backward_s"], t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in (v for v in TIMED_VARIANTS if v in samples):
            backward = samples[variant]["backward_s"]
            backward_summary = summarize([t * 1e3 for t in backward])
            step_summary = summarize([t * 1e3 for t in samples[variant]["step_s"]])
            rows.append(csv_row(variant, case, size, "backward_ms", backward_summary, sha))
            rows.append(csv_row(variant, case, size, "step_ms", step_summary, sha))
            compute_text = exposed_text = efficiency_text = by_step_text = ""
            if variant in ENGINE_VARIANTS:
                compute_variant = COMPUTE_OF[variant]
                compute = samples[compute_variant]["backward_s"]
                compute_step = summarize([t * 1e3 for t in samples[compute_variant]["step_s"]])
                exposed_ms, efficiency = exposure(samples[variant]["exposed_s"], t_comm)
                by_step = step_efficiency(backward, compute, t_comm)
                rows.append(csv_row(variant, case, size, "exposed_ms", exposed_ms, sha))
                rows.append(csv_row(variant, case, size, "efficiency", efficiency, sha))
                rows.append(csv_row(variant, case, size, "step_efficiency", by_step, sha))
                rows.append(csv_row(variant, case, size, "compute_step_ms", compute_step, sha))
                compute_text = f"{compute_step.median:.1f}"
                exposed_text, efficiency_text = f"{exposed_ms.median:.1f}", f"{efficiency.median:.2f}"
                by_step_text = f"{by_step.median:.2f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<18} {backward_summary.median:12.1f} "
                f"{backward_summary.median / 1e3 / stock_backward:7.2f} {step_summary.median:9.1f} "
                f"{step_summary.median / 1e3 / stock_step:7.2f} {compute_text:>15} {exposed_text:>10} "
                f"{efficiency_text:>10} {by_step_text:>7} {ideal:6.2f}"
            )
        print(
            f"{point['ratio']:5g} measured ratio (compute-only backward / T_comm) {ratio:.2f}; compiling every setup "
            f"took {max(r['points'][index]['compile_s'] for r in results):.0f} s on the slower rank"
        )
    if load is not None:
        rows.append(csv_row("machine", "compile_overlap", link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, "compile_overlap", quick_help="the headline point only, fewer repetitions")
    parser.add_argument(
        "--matmuls-per-region",
        type=int,
        default=None,
        help="torch_ext_compiled's compile_backend(matmuls_per_region=N) (default: the backend's default)",
    )
    args = parse_sweep_args(parser, argv)
    config = sweep_config(args, "compile_overlap", quick_reps=8, reps=15)
    announce = (
        f"compile_overlap: torch {torch.__version__}, {WORLD_SIZE} gloo ranks, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    backend_options = {} if args.matmuls_per_region is None else {"matmuls_per_region": args.matmuls_per_region}
    return run_sweep(__file__, args, argv, lambda: _run_rank(config, backend_options), report, announce)


# --- bench's summary rows and plot (torch_ext/bench.py) ------------------------------------------------


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant: the overlap efficiency at the headline point beside its ideal, backward and step time
    against stock's eager there."""
    points = sweep_cases(rows, "stock", "efficiency")
    link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")[2]
    t_comm = rows.get(("comm", "compile_overlap", "t_comm_ms"))
    stock_note = "" if t_comm is None else f"; T_comm {t_comm['median']:.3g} ms" + load_note(rows, "compile_overlap")
    summary = []
    for variant in (v for v in ENGINE_VARIANTS if (v, points[0][1], "efficiency") in rows):
        step = headline_over_stock(rows, variant, points, "step_ms")
        compute_step = rows[(variant, headline_point(points)[1], "compute_step_ms")]["median"]
        summary.append(
            sweep_summary_row(
                "compile_overlap",
                f"compiled MoE block, {link}",
                variant,
                rows,
                points,
                {"step_ratio": step, "ratio": headline_over_stock(rows, variant, points, "backward_ms")},
                lead=f"step / stock {step:.2f}, its compute-only step {compute_step:.0f} ms; ",
                exposed=False,
                stock_note=stock_note,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots(1, 1)
    plot_efficiency_curves(ax, list(rows), rows[0].case if rows else "compile_overlap")
    figure.suptitle("A compiled MoE block: torch.compile's overlap and torch_ext's")


if __name__ == "__main__":
    sys.exit(main())
