"""moe_sync's lines of bench's table and its plot, from its CSV."""

from __future__ import annotations

from collections.abc import Sequence

from ..harness.report import (
    SummaryRow,
    headline_over_stock,
    load_note,
    plot_efficiency_curves,
    sweep_cases,
    sweep_summary_row,
)
from ..moe_libraries import LIBRARY_NAMES
from . import ENGINE_VARIANTS


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library and engine variant. The headline is the overlap efficiency at the headline point
    (``harness.report.headline_point``), beside its ideal, and backward and step time against stock there."""
    libraries = dict.fromkeys(case.rpartition(" x")[0] for _, case in sweep_cases(rows, "stock", "efficiency"))
    summary = []
    for library in libraries:
        points = [(r, case) for r, case in sweep_cases(rows, "stock", "efficiency") if case.startswith(library + " x")]
        link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")[2]
        t_comm = rows.get(("comm", library, "t_comm_ms"))
        stock_note = "" if t_comm is None else f"; T_comm {t_comm['median']:.3g} ms" + load_note(rows, "moe_sync")
        for variant in (v for v in ENGINE_VARIANTS if (v, points[0][1], "efficiency") in rows):
            step = headline_over_stock(rows, variant, points, "step_ms")
            summary.append(
                sweep_summary_row(
                    "moe_sync",
                    f"{LIBRARY_NAMES.get(library, library)}, {link}",
                    variant,
                    rows,
                    points,
                    {"step_ratio": step, "ratio": headline_over_stock(rows, variant, points, "backward_ms")},
                    lead=f"step / stock {step:.2f}; ",
                    exposed=False,
                    stock_note=stock_note,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases, strict=True):
        plot_efficiency_curves(ax, [r for r in rows if r.case == case], case)
    figure.suptitle("Synchronous MoE all_to_all: stock, priority alone, the collective lane")
