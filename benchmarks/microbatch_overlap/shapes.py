"""The shapes of model microbatch_overlap times (the package's docstring describes them), how the CSV names their
cases, and --shapes. Imports no torch: the models are .models'."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from . import DISPATCH_FIRST_BLOCKS


@dataclass(frozen=True)
class ModelShape:
    """A shape of model the sweep times."""

    # In the CSV's cases, after the library's name: ``<library>[ <case_name>] x<ratio>``; "" for pre-path, which
    # CSVs from before dispatch-first name by the library alone.
    case_name: str
    # In the table's and the summary's headings.
    title: str
    # MoE layers a microbatch, four all_to_alls each.
    moe_layers: int
    # The function of .models that builds it: (all_to_all, dense layers) -> the model.
    builder: str

    def build(self, all_to_all: Callable, dense_layers: int):
        """The model, ``dense_layers`` dense layers a microbatch, its all_to_alls through ``all_to_all``."""
        from . import models

        return getattr(models, self.builder)(all_to_all, dense_layers)

    @property
    def option_name(self) -> str:
        """Its name in ``--shapes``."""
        return self.case_name or "pre-path"

    def case_prefix(self, library: str) -> str:
        """The CSV's case of this shape's T_comm, and of its sweep points before `` x<ratio>``."""
        return f"{library} {self.case_name}" if self.case_name else library


PRE_PATH = ModelShape("", "pre-path", 1, "pre_path_model")
DISPATCH_FIRST = ModelShape(
    "dispatch-first", f"dispatch-first, {DISPATCH_FIRST_BLOCKS} MoE layers", DISPATCH_FIRST_BLOCKS, "DispatchFirstModel"
)
SHAPES = (PRE_PATH, DISPATCH_FIRST)
# A quick run leaves dispatch-first out, bits and all: its T_comm's calibration, bits check and steps would about
# double this benchmark's part of bench --quick (twice the all_to_alls a microbatch, so twice the dense layers at a
# ratio), which (166-172 s) has 8-14 s left of its 3 minutes. The two shapes' figures are a full run's.
QUICK_SHAPES = (PRE_PATH,)


def split_case_prefix(prefix: str) -> tuple[str, ModelShape]:
    """(library, shape) of a case's name before `` x<ratio>`` (``ModelShape.case_prefix``)."""
    library, _, case_name = prefix.partition(" ")
    return library, next(shape for shape in SHAPES if shape.case_name == case_name)


def parse_shapes(text: str) -> tuple[ModelShape, ...]:
    """``--shapes``: shapes' ``option_name``s separated by commas (an argparse ``type``)."""
    by_name = {shape.option_name: shape for shape in SHAPES}
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in by_name]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown shape {', '.join(map(repr, unknown)) or repr(text)}; the shapes: {', '.join(by_name)}"
        )
    return tuple(dict.fromkeys(by_name[name] for name in names))
