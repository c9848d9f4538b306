"""``python -m torch_ext <command>`` (installed as the ``torch-ext`` console script).

bench   every benchmark against stock PyTorch: one summary table, CSVs and plots in a results folder
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

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
