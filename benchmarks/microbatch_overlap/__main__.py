"""``python -m benchmarks.microbatch_overlap``: the options, and the sweep on two hosts."""

from __future__ import annotations

import sys

from ..harness.results import torch_version
from ..harness.sweep import parse_sweep_args, run_sweep, sweep_config, sweep_parser
from ..moe_libraries import INSTALL_HINT, installed_libraries
from . import N_MICROBATCHES, NAME, WORLD_SIZE
from . import __doc__ as DOC
from .report import report
from .shapes import QUICK_SHAPES, SHAPES, parse_shapes


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        DOC,
        NAME,
        quick_help="fewer repetitions and sweep points",
        timeline_help="after timing the point nearest x1, trace steps of each overlapped rule, print where their "
        "exposure goes and draw rank 0's first of each (dispatch-first's beside it, named _dispatch-first)",
    )
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        help="the shapes to time, separated by commas: "
        f"{', '.join(shape.option_name for shape in SHAPES)} (default: {QUICK_SHAPES[0].option_name} in a quick "
        "run, both in a full one)",
    )
    parser.add_argument(
        "--dense-layers",
        type=int,
        metavar="N",
        help="with one ratio: N dense layers a microbatch, whatever T_comm's calibration reads, so that runs "
        "compare the same work (the link here reads one all_to_all at ~8 or ~16 ms from run to run)",
    )
    args = parse_sweep_args(parser, argv)
    if args.dense_layers is not None and (args.dense_layers < 1 or args.ratios is None or len(args.ratios) != 1):
        parser.error("--dense-layers takes a positive number of layers and one --ratios point, the one it names")
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    # One library is enough here: Megatron-core if installed, else DeepSpeed.
    library = next(iter(installed_libraries()), None)
    if library is None:
        print(f"{NAME}: skipped: neither Megatron-core nor DeepSpeed is installed ({INSTALL_HINT})")
        return 0
    # 10 quick repetitions, not 6. On an Intel Xeon three quick runs of 6 (three points) read the overlap's
    # exposure 0.41-0.58 of stock's, three of 10 read 0.45-0.55. At the one point a quick run now sweeps, three
    # runs of 10 read 0.47-0.49, in ~50 s each.
    config = sweep_config(args, NAME, quick_reps=10, reps=15)
    announce = (
        f"{NAME}: torch {torch_version()}, {WORLD_SIZE} gloo ranks, {library}, {N_MICROBATCHES} microbatches, "
        f"{', '.join(shape.option_name for shape in shapes)}, ratios {','.join(f'{r:g}' for r in config.ratios)}, "
        f"{config.reps} repetitions"
    )
    return run_sweep(__spec__.parent, args, argv, (library, config, shapes, args.dense_layers), report, announce)


if __name__ == "__main__":
    sys.exit(main())
