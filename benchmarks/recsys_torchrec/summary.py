"""recsys_torchrec's lines of bench's table and its plot, from its CSV."""

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
from . import ENGINE_VARIANTS


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per engine. The headline is the overlap efficiency at the headline point
    (``harness.report.headline_point``), beside its ideal, and step and backward time against stock there."""
    points = sweep_cases(rows, "stock", "efficiency")
    # "DLRM ..., <n> dense layers, <link>": the link (whether anything can overlap) names the case.
    scenario, link = scenario_and_link(rows[("stock", points[0][1], "step_ms")]["size"])
    t_comm = rows[("comm", "recsys", "t_comm_ms")]["median"]
    summary = []
    for variant in ENGINE_VARIANTS:
        step, backward = (headline_over_stock(rows, variant, points, metric) for metric in ("step_ms", "backward_ms"))
        summary.append(
            sweep_summary_row(
                "recsys_torchrec",
                link,
                variant,
                rows,
                points,
                {"ratio": step, "backward_ratio": backward},
                lead=f"step / stock {step:.2f}, backward {backward:.2f}; ",
                stock_note=f"; T_comm {t_comm:.3g} ms, {scenario}" + load_note(rows, "recsys"),
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    plot_efficiency_curves(figure.subplots(), rows, rows[0].case)
    figure.suptitle("TorchRec DLRM: its embedding all_to_all's backward beside the dense arch, 2 gloo ranks")
