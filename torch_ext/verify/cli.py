"""``python -m torch_ext verify``: its options, the step named by ``module:function`` (or built by a factory),
and under torchrun the process group and one printout for all ranks.

torch_ext/__main__.py adds these to its parser (``add_arguments``, ``run_command``, both also
``torch_ext.verify.<name>``). Apart from the rest of verify because none of it is needed to call
:func:`torch_ext.verify.verify` from Python: it is the command's handling of a user's arguments and exit status.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, NoReturn

import torch

from torch_ext.verify._run import verify


def add_arguments(parser) -> None:
    """The options of ``python -m torch_ext verify``."""
    parser.add_argument(
        "target",
        metavar="module:function",
        help="the training step: a function of an importable module (or of a .py file given by path) that takes "
        "no arguments; with --factory, a function that builds the step",
    )
    parser.add_argument(
        "--factory",
        action="store_true",
        help="call the function once to build the step: it returns the step, (step, models), "
        "(step, models, optimizers) or a dict of verify()'s keywords",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps to run on each engine (default: the factory's, else 1)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="every difference and each backward call's whole node order"
    )


def run_command(args) -> int:
    """``python -m torch_ext verify``: 0 when every rank's step is identical on both engines, 1 when not."""
    import torch.distributed as dist

    # Under torchrun: the process group, before the module's import (which may build a sharded model).
    started_group = False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if torch.accelerator.is_available():
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group()
        started_group = True
    try:
        kwargs = _target(args.target, args.factory)
        if args.steps is not None:
            kwargs["steps"] = args.steps
        report = verify(**kwargs)
        summary = report.summary(verbose=args.verbose)
        if dist.is_initialized():
            # Rank 0 prints its report and every different rank's; of another identical rank, its verdict.
            if report.identical and dist.get_rank() != 0:
                summary = summary.splitlines()[0]
            summaries: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(summaries, summary)
            if dist.get_rank() == 0:
                print("\n".join(f"rank {rank}: {text}" for rank, text in enumerate(summaries)))
        else:
            print(summary)
        return 0 if report.all_ranks_identical else 1
    finally:
        if started_group:
            dist.destroy_process_group()


def _usage_error(message: str) -> NoReturn:
    """Ends ``python -m torch_ext verify`` as argparse ends on a bad argument: one line on stderr, exit status 2
    (1 means "different")."""
    print(f"python -m torch_ext verify: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _target(target: str, factory: bool) -> dict[str, Any]:
    """verify()'s keywords from ``module:function``."""
    module_name, separator, function_name = target.rpartition(":")
    if not separator or not module_name or not function_name:
        _usage_error(f"expected module:function, got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            _usage_error(f"no such file: {module_name!r}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0], module_name)
        if spec is None or spec.loader is None:
            _usage_error(f"cannot load {module_name!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # The module itself, or a package above it, is missing. A module missing inside it keeps its traceback.
            if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
                raise
            _usage_error(
                f"no module named {error.name!r} (importable from {os.getcwd()!r} or sys.path; "
                "or give the path of a .py file, path/to/file.py:function)"
            )
    function = getattr(module, function_name, None)
    if not callable(function):
        _usage_error(f"{module_name} has no function {function_name!r}")
    if not factory:
        return {"step": function}
    built = function()
    if isinstance(built, dict):
        return dict(built)
    if callable(built):
        return {"step": built}
    if isinstance(built, tuple) and 1 <= len(built) <= 3 and callable(built[0]):
        return dict(zip(("step", "models", "optimizers"), built, strict=False))
    _usage_error(
        f"{target} returned {type(built).__name__}; a factory returns the step, "
        "(step, models), (step, models, optimizers) or a dict of verify()'s keywords"
    )
