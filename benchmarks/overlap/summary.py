"""overlap's lines of bench's table and its plot, from its CSV."""

from __future__ import annotations

from collections.abc import Sequence

from ..harness.report import (
    SummaryRow,
    headline_over_stock,
    load_note,
    plot_efficiency_curves,
    scenario_and_link,
    sweep_cases,
    sweep_summary_row,
)
from . import COLLECTIVE_VARIANTS


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant with a collective. The headline is the overlap efficiency at the headline point
    (``harness.report.headline_point``), beside its ideal, and backward time against stock there."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "<dim>d x <rows> rows, <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, link = scenario_and_link(rows[("stock", points[0][1], "backward_ms")]["size"])
    t_comm = rows[("comm", "overlap", "t_comm_ms")]["median"]
    stock_note = f"; T_comm {t_comm:.3g} ms, {scenario}" + load_note(rows, "overlap")
    return [
        sweep_summary_row(
            "overlap",
            link,
            variant,
            rows,
            points,
            {"ratio": headline_over_stock(rows, variant, points, "backward_ms")},
            stock_note=stock_note,
        )
        for variant in COLLECTIVE_VARIANTS
        if (variant, points[0][1], "efficiency") in rows
    ]


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("Overlap of a backward all_to_all with a dense MLP on 2 gloo ranks")
