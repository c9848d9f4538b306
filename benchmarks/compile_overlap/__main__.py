"""``python -m benchmarks.compile_overlap``: the options, and the sweep on two hosts."""

from __future__ import annotations

import sys

from ..harness.results import torch_version
from ..harness.sweep import parse_sweep_args, run_sweep, sweep_config, sweep_parser
from . import WORLD_SIZE
from . import __doc__ as DOC
from .report import report


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(DOC, "compile_overlap", quick_help="the headline point only, fewer repetitions")
    parser.add_argument(
        "--matmuls-per-region",
        type=int,
        default=None,
        help="torch_ext_compiled's compile_backend(matmuls_per_region=N) (default: the backend's default)",
    )
    args = parse_sweep_args(parser, argv)
    config = sweep_config(args, "compile_overlap", quick_reps=8, reps=15)
    announce = (
        f"compile_overlap: torch {torch_version()}, {WORLD_SIZE} gloo ranks, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    backend_options = {} if args.matmuls_per_region is None else {"matmuls_per_region": args.matmuls_per_region}
    return run_sweep(__spec__.parent, args, argv, (config, backend_options), report, announce)


if __name__ == "__main__":
    sys.exit(main())
