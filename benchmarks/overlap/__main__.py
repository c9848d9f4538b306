"""``python -m benchmarks.overlap``: the options, and the sweep on two hosts."""

from __future__ import annotations

import dataclasses
import sys

from ..harness.results import torch_version
from ..harness.sweep import parse_sweep_args, run_sweep, sweep_config, sweep_parser
from . import VARIANTS, WORLD_SIZE, Config
from . import __doc__ as DOC
from .report import report


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        DOC,
        "overlap",
        quick_help="smaller payload, fewer repetitions and sweep points",
        timeline_help="draw one traced backward of stock and of torch_ext",
    )
    parser.add_argument("--payload-mib", type=float, help="MiB each rank sends the other (default 4; quick 2)")
    args = parse_sweep_args(parser, argv)
    config = Config(
        **dataclasses.asdict(sweep_config(args, "overlap", quick_reps=12, reps=20)),
        payload_mib=args.payload_mib or (2.0 if args.quick else 4.0),
    )
    announce = (
        f"overlap: torch {torch_version()}, {WORLD_SIZE} gloo ranks, {config.payload_mib:g} MiB each way, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions of {len(VARIANTS)} variants"
    )
    return run_sweep(__spec__.parent, args, argv, (config,), report, announce)


if __name__ == "__main__":
    sys.exit(main())
