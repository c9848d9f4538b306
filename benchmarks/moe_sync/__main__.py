"""``python -m benchmarks.moe_sync``: the options, and the sweep on two hosts."""

from __future__ import annotations

import sys

from ..harness.results import torch_version
from ..harness.sweep import parse_sweep_args, run_sweep, sweep_config, sweep_parser
from ..moe_libraries import INSTALL_HINT, installed_libraries
from . import WORLD_SIZE
from . import __doc__ as DOC
from .report import report


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(DOC, "moe_sync", quick_help="fewer repetitions and sweep points")
    args = parse_sweep_args(parser, argv)
    libraries = installed_libraries()
    if not libraries:
        print(f"moe_sync: skipped: neither Megatron-core nor DeepSpeed is installed ({INSTALL_HINT})")
        return 0
    config = sweep_config(args, "moe_sync", quick_reps=8, reps=15)
    if config.quick:
        # One library in a quick run: both run their _AllToAll on the same lane, and their lanes read within 0.05 of
        # each other in every run of docs/benchmarks.md; a full run times both.
        libraries = libraries[:1]
    announce = (
        f"moe_sync: torch {torch_version()}, {WORLD_SIZE} gloo ranks, {', '.join(libraries)}, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    return run_sweep(__spec__.parent, args, argv, (libraries, config), report, announce)


if __name__ == "__main__":
    sys.exit(main())
