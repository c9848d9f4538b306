"""compile_overlap's lines of bench's table and its plot, from its CSV."""

from __future__ import annotations

from collections.abc import Sequence

from ..harness.report import (
    SummaryRow,
    headline_over_stock,
    headline_point,
    load_note,
    plot_efficiency_curves,
    sweep_cases,
    sweep_summary_row,
)
from . import ENGINE_VARIANTS


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per variant: the overlap efficiency at the headline point beside its ideal, backward and step time
    against stock's eager there."""
    points = sweep_cases(rows, "stock", "efficiency")
    link = rows[("stock", points[0][1], "backward_ms")]["size"].rpartition(", ")[2]
    t_comm = rows.get(("comm", "compile_overlap", "t_comm_ms"))
    stock_note = "" if t_comm is None else f"; T_comm {t_comm['median']:.3g} ms" + load_note(rows, "compile_overlap")
    summary = []
    for variant in (v for v in ENGINE_VARIANTS if (v, points[0][1], "efficiency") in rows):
        step = headline_over_stock(rows, variant, points, "step_ms")
        compute_step = rows[(variant, headline_point(points)[1], "compute_step_ms")]["median"]
        summary.append(
            sweep_summary_row(
                "compile_overlap",
                f"compiled MoE block, {link}",
                variant,
                rows,
                points,
                {"step_ratio": step, "ratio": headline_over_stock(rows, variant, points, "backward_ms")},
                lead=f"step / stock {step:.2f}, its compute-only step {compute_step:.0f} ms; ",
                exposed=False,
                stock_note=stock_note,
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots(1, 1)
    plot_efficiency_curves(ax, list(rows), rows[0].case if rows else "compile_overlap")
    figure.suptitle("A compiled MoE block: torch.compile's overlap and torch_ext's")
