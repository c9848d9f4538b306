"""``python -m torch_ext <command>`` (installed as the ``torch-ext`` console script).

bench   every benchmark against stock PyTorch: one summary table, CSVs and plots in a results folder
verify  a training step on stock PyTorch and on torch_ext from one snapshot, compared bit for bit
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_ext", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    from torch_ext import bench

    bench_parser = commands.add_parser(
        "bench",
        help="run every benchmark against stock PyTorch",
        description=bench.__doc__.split("\n\n")[0],
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=lambda args: bench.run(args, bench_parser))

    from torch_ext.verify import add_arguments as add_verify_arguments
    from torch_ext.verify import run_command as run_verify

    verify_parser = commands.add_parser(
        "verify",
        help="run a training step on stock PyTorch and on torch_ext and compare every gradient and parameter",
        description="Runs module:function's training step on stock PyTorch and on torch_ext from one snapshot and "
        "compares every gradient and parameter bit for bit (torch_ext.verify). Under torchrun each rank verifies "
        "its own step and rank 0 prints the reports: its own, every different rank's, the others' verdicts. Exit "
        "status: 0 when every rank is identical, 1 when not.",
    )
    add_verify_arguments(verify_parser)
    verify_parser.set_defaults(run=run_verify)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
