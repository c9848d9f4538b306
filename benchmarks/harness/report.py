"""What bench's summary table and plots are made of (torch_ext/bench.py, from each benchmark's CSV): ``SummaryRow``
and ``bar_chart``; and for the sweeps (overlap, recsys_torchrec, moe_sync, compile_overlap, microbatch_overlap), how
a sweep point is named in the CSV, which point the headline reads, a variant's summary row and the efficiency
curves. Imports no torch (a sweep's launcher uses it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .results import csv_row
from .sweep import HEADLINE_RATIO
from .timing import Summary


@dataclass
class SummaryRow:
    """One line of the summary table; ``values`` are its numbers for summary.csv and the plots."""

    benchmark: str
    case: str
    variant: str
    baseline: str
    measured: str
    ratio: str
    notes: str = ""
    values: dict[str, float] = field(default_factory=dict)


def bar_chart(ax, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, line: float | None) -> None:
    width = 0.8 / len(series)
    for i, (name, heights) in enumerate(series.items()):
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(positions, heights, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if line is not None:
        ax.axhline(line, color="black", linewidth=0.8, linestyle="--")
    if len(series) > 1:
        ax.legend(fontsize=8)


# --- a sweep's points in its CSV ------------------------------------------------------------------------------


def sweep_case(name: str, ratio: float) -> str:
    """The CSV case of one sweep point: ``"<name> x<ratio>"``."""
    return f"{name} x{ratio:g}"


def sweep_cases(rows: dict, what: str, metric: str) -> list[tuple[float, str]]:
    """[(ratio, case)] of the sweep points ``sweep_case`` named, in the CSV's order, from ``what``'s ``metric``."""
    return [
        (float(case.rpartition(" x")[2]), case)
        for row_what, case, row_metric in rows
        if row_what == what and row_metric == metric
    ]


def scenario_and_link(size: str) -> tuple[str, str]:
    """A sweep point's CSV size, ``"<scenario>, <n> dense layers, <link>"``, as (scenario, link)."""
    scenario, _, link = size.rpartition(", ")
    return scenario.rpartition(", ")[0], link


def headline_point(points: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The sweep point (ratio, case) a summary's headline reads: HEADLINE_RATIO's, or where a sweep left it out
    (``--ratios``), the point nearest it."""
    return min(points, key=lambda point: abs(math.log(point[0] / HEADLINE_RATIO)))


def headline_over_stock(rows: dict, variant: str, points: Sequence[tuple[float, str]], metric: str) -> float:
    """``variant``'s ``metric`` / stock's at the sweep's headline point (``headline_point``)."""
    _, case = headline_point(points)
    return rows[(variant, case, metric)]["median"] / rows[("stock", case, metric)]["median"]


def load_note(rows: dict, case: str) -> str:
    """The summary notes' runnable tasks while the ranks ran (the CSV's ``machine`` row), where known."""
    load = rows.get(("machine", case, "runnable_tasks"))
    return "" if load is None else f"; runnable tasks {load['median']:g} (the ranks: 2)"


def _measured_ratio_key(case: str) -> tuple[str, str, str]:
    """The CSV key (what, case, metric) of sweep point ``case``'s measured ratio."""
    return ("compute", case, "measured_ratio")


def measured_ratio_row(case: str, size: str, ratio: float, sha: str) -> dict[str, object]:
    """The CSV row of the ratio sweep point ``case`` measured (``exposure.measured_ratio``), which ``point_ratio``
    reads."""
    what, _, metric = _measured_ratio_key(case)
    return csv_row(what, case, size, metric, Summary(ratio, ratio, ratio), sha)


def point_ratio(rows: dict, ratio: float, case: str) -> float:
    """The ratio sweep point ``case`` measured (its ``measured_ratio_row``), or the one it asked for, ``ratio``, in a
    CSV without it."""
    row = rows.get(_measured_ratio_key(case))
    return ratio if row is None else row["median"]


# --- a sweep's summary rows and plot ---------------------------------------------------------------------------


def sweep_summary_row(
    benchmark: str,
    case: str,
    variant: str,
    rows: dict,
    points: Sequence[tuple[float, str]],
    over_stock: dict[str, float],
    *,
    lead: str = "",
    exposed: bool = True,
    stock_note: str = "",
) -> SummaryRow:
    """A variant's line of the summary table from a sweep's CSV ``rows`` at ``points`` (``sweep_cases``): the headline
    is the overlap efficiency at the headline point (``headline_point``) beside its ideal, min(1, the ratio the
    point measured: ``point_ratio``), and the efficiency by step time there where the CSV has it; the ratio column
    is ``over_stock["ratio"]`` (the callers' ``headline_over_stock``). The notes: ``lead``, the efficiency at each
    point, the exposed ms at the headline point (``exposed``), and on stock's line ``stock_note``. The values: the
    headline's efficiency and ideal, its exposed ms, ``over_stock``, and the curve for the plot
    (``"efficiency x<ratio>"``)."""
    efficiencies = [rows[(variant, point, "efficiency")]["median"] for _, point in points]
    measured = [point_ratio(rows, ratio, point) for ratio, point in points]
    has_measured = all(_measured_ratio_key(point) in rows for _, point in points)
    headline_ratio, headline = headline_point(points)
    efficiency = rows[(variant, headline, "efficiency")]["median"]
    ideal = min(1.0, point_ratio(rows, headline_ratio, headline))
    values = {"efficiency": efficiency, "ideal_efficiency": ideal}
    by_step = rows.get((variant, headline, "step_efficiency"))
    if by_step is not None:
        values["step_efficiency"] = by_step["median"]
    if exposed:
        values["exposed_ms"] = rows[(variant, headline, "exposed_ms")]["median"]
    values.update(over_stock)
    values.update({f"efficiency x{ratio:g}": eff for (ratio, _), eff in zip(points, efficiencies, strict=True)})
    if has_measured:
        values.update({f"ideal x{ratio:g}": min(1.0, real) for (ratio, _), real in zip(points, measured, strict=True)})
    per_point = ", ".join(
        f"x{ratio:g}{f' (measured x{real:.2g})' if has_measured else ''}: {eff:.2f}"
        for (ratio, _), real, eff in zip(points, measured, efficiencies, strict=True)
    )
    notes = f"headline at x{headline_ratio:g}; {lead}efficiency by dense/comm ratio {per_point}"
    if exposed:
        notes += f"; exposed {values['exposed_ms']:.1f} ms at x{headline_ratio:g}"
    if variant == "stock":
        notes += stock_note
    return SummaryRow(
        benchmark,
        case,
        variant,
        "stock",
        f"efficiency {efficiency:.2f} (ideal {ideal:.2f})"
        + (f", by step time {values['step_efficiency']:.2f}" if "step_efficiency" in values else ""),
        f"{values['ratio']:.2f}",
        notes,
        values,
    )


def plot_efficiency_curves(ax, rows: Sequence[SummaryRow], title: str) -> None:
    """Each row's overlap efficiency against dense backward / T_comm (its ``"efficiency x<ratio>"`` values),
    and the ideal, dashed: min(1, the ratio each point measured) (``"ideal x<ratio>"``), or min(1, ratio)."""
    ratios: list[float] = []
    for row in rows:
        curve = sorted(
            (float(key.removeprefix("efficiency x")), value)
            for key, value in row.values.items()
            if key.startswith("efficiency x")
        )
        ratios = sorted({*ratios, *(ratio for ratio, _ in curve)})
        ax.plot([ratio for ratio, _ in curve], [eff for _, eff in curve], marker="o", label=row.variant)
    measured_ideal = sorted(
        (float(key.removeprefix("ideal x")), value)
        for key, value in (rows[0].values.items() if rows else ())
        if key.startswith("ideal x")
    )
    if measured_ideal:
        ax.plot(*zip(*measured_ideal, strict=True), linestyle="--", color="black", label="ideal (measured ratio)")
    else:
        if ratios and ratios[0] < 1.0 < ratios[-1]:
            ratios = sorted({*ratios, 1.0})  # the ideal's corner
        ax.plot(ratios, [min(1.0, r) for r in ratios], linestyle="--", color="black", label="ideal")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xlabel("dense backward / T_comm")
    ax.set_ylabel("overlap efficiency (1: all hidden)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


# --- a sweep's printed table ---------------------------------------------------------------------------------


def print_t_comm(comm: Summary, steps: int) -> None:
    print(f"T_comm {comm} ms (stock's wait with no dense layer, {steps} steps; efficiency = 1 - exposed / its median)")


def print_load(load: Summary | None) -> None:
    if load is not None:
        print(f"runnable tasks while the ranks ran: {load} (the ranks make 2; more: other processes on the 2 cores)")
