"""``python -m benchmarks.trainer_overlap``: the options, and the libraries' loops on two hosts."""

from __future__ import annotations

import sys

from ..harness.results import torch_version
from ..harness.sweep import module_installed, parse_sweep_args, run_sweep, sweep_config, sweep_parser
from ..moe_libraries import INSTALL_HINT
from ..moe_libraries import installed_libraries as all_to_all_libraries
from . import LIBRARIES, N_MICROBATCHES, NAME, WORLD_SIZE
from . import __doc__ as DOC
from .report import report

# What each library's loop needs importable; torchtitan's Trainer also needs torchdata, tensorboard and datasets
# (the [test] extra installs them).
_NEEDS = {
    "megatron": ("megatron.core",),
    "deepspeed": ("deepspeed.moe",),
    "torchtitan": ("torchtitan", "torchdata", "tensorboard", "datasets"),
}


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(DOC, NAME, quick_help="skip this benchmark (a full run's)")
    args = parse_sweep_args(parser, argv)
    if args.quick:
        print(f"{NAME}: skipped: a full run's benchmark (python -m torch_ext bench, without --quick)")
        return 0
    have = all_to_all_libraries()
    if not have:
        print(f"{NAME}: skipped: neither Megatron-core nor DeepSpeed is installed ({INSTALL_HINT})")
        return 0
    libraries = [library for library in LIBRARIES if all(module_installed(m) for m in _NEEDS[library])]
    # torchtitan's model runs the first installed library's _AllToAll (the package's docstring says why).
    all_to_all_of = {library: library if library in have else have[0] for library in libraries}
    config = sweep_config(args, NAME, quick_reps=8, reps=15)
    announce = (
        f"{NAME}: torch {torch_version()}, {WORLD_SIZE} gloo ranks, {', '.join(libraries)}, "
        f"{N_MICROBATCHES} microbatches, {config.reps} repetitions"
    )
    return run_sweep(__spec__.parent, args, argv, (libraries, all_to_all_of, config), report, announce)


if __name__ == "__main__":
    sys.exit(main())
