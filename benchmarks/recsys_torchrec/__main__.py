"""``python -m benchmarks.recsys_torchrec``: the options, and the sweep on two hosts."""

from __future__ import annotations

import importlib.util
import sys

from ..harness.results import torch_version
from ..harness.sweep import parse_sweep_args, run_sweep, sweep_config, sweep_parser
from . import WORLD_SIZE
from . import __doc__ as DOC
from .report import report


def has_torchrec() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(
        DOC,
        "recsys_torchrec",
        quick_help="fewer repetitions and sweep points",
        timeline_help="draw one traced torch_ext backward of rank 0",
    )
    args = parse_sweep_args(parser, argv)
    if not has_torchrec():
        # bench lists a benchmark that exits 0 with this line as skipped.
        print("recsys_torchrec: skipped: TorchRec is not installed (README, 'TorchRec')")
        return 0
    config = sweep_config(args, "recsys_torchrec", quick_reps=11, reps=20)
    announce = (
        f"recsys_torchrec: torch {torch_version()}, {WORLD_SIZE} gloo ranks, "
        f"ratios {','.join(f'{r:g}' for r in config.ratios)}, {config.reps} repetitions"
    )
    return run_sweep(__spec__.parent, args, argv, (config,), report, announce)


if __name__ == "__main__":
    sys.exit(main())
