"""The sweep of the dense backward against the communication, T_comm, that the two-host benchmarks share (overlap,
recsys_torchrec, moe_sync, compile_overlap, microbatch_overlap): its settings (RATIOS, QUICK_RATIOS,
``SweepConfig``), its options (``sweep_parser``), its main (``run_sweep``: two hosts, or a rank under torchrun),
each point's depth (``sweep_depth``) and its repetitions (``timed_repetitions``).

A sweep benchmark is a package: its ``__main__`` parses the options and calls ``run_sweep`` with the arguments of
its rank's part (``rank.run_rank``, imported on the ranks alone) and its report. This module, ``hosts``, ``results``, ``report``, ``exposure``
and ``timing`` import no torch, so the launcher starts the hosts without paying for torch's import (~1.4 s here);
the ranks' side (``calibration`` and the benchmark's model) does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .hosts import MODES, RANK_RESULTS_OPTION, leave_rank, run_on_two_hosts, write_rank_result
from .results import progress
from .timing import runnable_tasks

# The dense backward as multiples of T_comm. The summary's headline reads one point, HEADLINE_RATIO: a dense
# backward as long as the communication, where a perfect overlap hides all of it with nothing to spare. A full run
# sweeps the curve around it, a quick run that point alone, so the two headlines measure the same thing and differ
# only by their repetitions. The sweep's mean, the headline before, could not agree: a full run's five points and
# a quick run's three had different means. Three points took the whole quick run ~6 minutes here; one, 166-172 s
# (docs/benchmarks.md, "How stability was checked").
HEADLINE_RATIO = 1.0
RATIOS = (0.25, 0.5, HEADLINE_RATIO, 1.5, 2.0)
QUICK_RATIOS = (HEADLINE_RATIO,)


@dataclass(frozen=True)
class SweepConfig:
    ratios: tuple[float, ...]
    # Timed repetitions of every variant at every point, after ``warmup`` untimed ones.
    reps: int
    warmup: int
    # Calls of the calibration's stack of layers at least (calibration.dense_layer_s).
    calibration_reps: int
    # A quick run (--quick): a benchmark may also time fewer variants (``timed_variants``).
    quick: bool
    # Where rank 0 draws a traced backward (None: not traced).
    timeline_png: str | None


def parse_ratios(text: str) -> tuple[float, ...]:
    """``--ratios`` of a sweep: positive numbers separated by commas (an argparse ``type``)."""
    try:
        ratios = tuple(float(part) for part in text.split(","))
    except ValueError:
        ratios = ()
    if not ratios or any(r <= 0 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be positive numbers separated by commas, got {text!r}")
    return ratios


def sweep_parser(doc: str, name: str, quick_help: str, timeline_help: str | None = None) -> argparse.ArgumentParser:
    """A sweep's argument parser (its package docstring ``doc``): the options every sweep takes, and
    ``--timeline PNG`` where it draws one (``timeline_help``). The benchmark adds its own before parsing them with
    ``parse_sweep_args``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--reps", type=int, help="timed repetitions of every variant at every sweep point")
    parser.add_argument("--ratios", type=parse_ratios, help="dense backward / T_comm to sweep, e.g. 0.5,1,2")
    parser.add_argument(
        "--network",
        choices=MODES,
        default=MODES[0],
        help="where the 2 ranks run (default two-hosts; what cannot be made falls back to the next)",
    )
    parser.add_argument("--out", default=f"results/{name}.csv", help="long-format CSV to write")
    if timeline_help is not None:
        parser.add_argument("--timeline", metavar="PNG", help=timeline_help)
    parser.add_argument(RANK_RESULTS_OPTION, help=argparse.SUPPRESS)  # set by the launcher on each rank
    return parser


def parse_sweep_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        parser.error("--reps must be at least 2 (percentiles need two samples)")
    return args


def sweep_config(args: argparse.Namespace, name: str, quick_reps: int, reps: int) -> SweepConfig:
    """The settings of ``sweep_parser``'s options: ``quick_reps`` or ``reps`` repetitions unless ``--reps``."""
    timeline_png = None
    if getattr(args, "timeline", None) is not None:
        if importlib.util.find_spec("matplotlib") is None:
            progress(f"{name}: --timeline skipped: matplotlib is not installed (pip install 'torch_ext[bench]')")
        else:
            timeline_png = os.path.abspath(args.timeline)
    return SweepConfig(
        ratios=args.ratios or (QUICK_RATIOS if args.quick else RATIOS),
        reps=args.reps or (quick_reps if args.quick else reps),
        # Two untimed repetitions in a quick run too: with one, three quick runs' first (and only) point read the
        # microbatch overlap's exposure 0.42-0.46 of stock's against a full run's 0.40 there, and moe_sync's lane
        # 0.94-0.99 against 0.999, each quick run on the same side of the full one (a fresh process's first steps).
        warmup=2,
        calibration_reps=25 if args.quick else 31,
        quick=args.quick,
        timeline_png=timeline_png,
    )


def _on_every_rank(run_rank: Callable[[], object]) -> list:
    """In a rank started by torchrun: ``run_rank()`` in the gloo process group of torchrun's environment, with one
    intra-op thread (two ranks may share two cores); every rank's result, in rank order."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Deep Linear + ReLU stacks reach denormal floats in backward, which x86 computes many times slower: a 138-layer
    # stack's backward took 16.5 s alone, 1.1 s with denormals flushed, so a point meant as x2 of T_comm measured
    # ~x30. Flushed on every rank, for stock and torch_ext alike (torch_ext's threads take the setting from theirs).
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        result = run_rank()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        dist.destroy_process_group()


def run_sweep(
    module: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    rank_arguments: Sequence[object],
    report: Callable,
    announce: str,
) -> int:
    """A sweep's main; ``module`` is the benchmark's package, which ``python -m`` runs. Started by torchrun (by
    ``hosts.run_on_two_hosts``, ``--rank-results``, or by a user on two machines, where rank 0 reports): the rank's
    part, ``<module>.rank.run_rank(*rank_arguments)``, on every rank in the process group (its result
    JSON-serializable), and leaves. The rank module, which imports torch and the benchmark's model, is imported
    there alone. Otherwise runs the benchmark on 2 ranks as 2 hosts, sampling the runnable tasks meanwhile, and
    reports: ``report(results, link, out, load)``, every rank's result in rank order, prints the table and writes
    the CSV. Returns the exit status."""
    # Started by torchrun (it sets TORCHELASTIC_RUN_ID): one of the ranks.
    if args.rank_results is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        results = _on_every_rank(lambda: importlib.import_module(f"{module}.rank").run_rank(*rank_arguments))
        if args.rank_results is not None:
            write_rank_result(args.rank_results, results[int(os.environ["RANK"])])
        elif os.environ["RANK"] == "0":
            report(results, f"torchrun with {os.environ['WORLD_SIZE']} ranks", args.out)
        # An exception above still exits with its traceback and status 1.
        leave_rank()
    progress(announce)
    forwarded = sys.argv[1:] if argv is None else list(argv)
    with runnable_tasks() as load:
        run = run_on_two_hosts(module, forwarded, mode=args.network)
    report(run.results, run.network.label, args.out, load())
    return 0


def module_installed(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing the packages above it: what a sweep's
    launcher asks of the libraries its ranks need, before it starts its hosts. find_spec of a dotted name imports
    its parents, and deepspeed's __init__ imports torch and much more (3.3 s here)."""
    top, *parts = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in parts:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def timed_variants(config: SweepConfig, variants: Sequence[str], left_out_when_quick: Sequence[str]) -> tuple[str, ...]:
    """The variants a sweep times: all of ``variants``, less ``left_out_when_quick`` in a quick run. A quick run leaves
    out the variants whose figures only confirm another's (each benchmark says which and why), to keep the README's
    first command short; a full run times them all. The summary rows show what was timed."""
    return tuple(v for v in variants if not (config.quick and v in left_out_when_quick))


def sweep_depth(ratio: float, t_comm: float, t_layer: float, max_layers: int) -> int:
    """Dense layers whose backward takes about ``ratio`` x ``t_comm``, one layer's taking ``t_layer``."""
    return int(min(max_layers, max(1, round(ratio * t_comm / t_layer))))


def timed_repetitions(
    variants: Sequence[str], measure: Callable[[str, int], dict[str, float]], reps: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """At one sweep point, on every rank: ``measure(variant, repetition)`` (seconds by metric) of every variant in
    ``warmup + reps`` repetitions, the warm-up left out: ``{variant: {metric: [seconds per repetition]}}``. The
    variants alternate within each repetition, the first rotating, so drift in the machine's load spreads evenly
    over them."""
    samples: dict[str, dict[str, list[float]]] = {variant: {} for variant in variants}
    for rep in range(warmup + reps):
        shift = rep % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            measured = measure(variant, rep)
            if rep >= warmup:
                for metric, seconds in measured.items():
                    samples[variant].setdefault(metric, []).append(seconds)
    return samples
