"""microbatch_overlap's lines of bench's table and its plot, from its CSV."""

from __future__ import annotations

from collections.abc import Sequence

from ..harness.report import SummaryRow, headline_point, load_note, sweep_cases
from ..harness.results import csv_cases
from ..moe_libraries import LIBRARY_NAMES
from . import AIM_EXPOSED_FRACTION, AIM_STEP_RATIO, ENGINE_VARIANTS, N_MICROBATCHES, NAME, RULES
from .limit import exposure_limit, gap_closed
from .shapes import PRE_PATH, split_case_prefix


def _per_point(rows: dict, variant: str, points, metric: str, over: str | None = "stock") -> list[float]:
    """``variant``'s ``metric`` at each point, over ``over``'s at the same point where given."""
    return [
        rows[(variant, case, metric)]["median"] / (1.0 if over is None else rows[(over, case, metric)]["median"])
        for _, case in points
    ]


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library, shape and engine variant: the headline is the exposed communication at the headline
    point (``harness.report.headline_point``) as a fraction of stock's there; the ratio column the step time over
    stock's there. The notes: per point, the exposed fraction and the step over stock's; the peak activations over
    stock's; the aims. Where compute_overlapped was timed at every point (a full run): stock's notes add the limit
    (``exposure_limit``), each rule's the fraction of the gap to it closed (``gap_closed``)."""
    summary = []
    for prefix in dict.fromkeys(case.rpartition(" x")[0] for case in csv_cases(rows, "exposed_ms")):
        library, shape = split_case_prefix(prefix)
        points = [
            (r, case) for r, case in sweep_cases(rows, "stock", "exposed_ms") if case.rpartition(" x")[0] == prefix
        ]
        link = rows[("stock", points[0][1], "step_ms")]["size"].rpartition(", ")[2]
        t_comm = rows.get(("comm", prefix, "t_comm_ms"))
        headline_ratio, headline = headline_point(points)
        at_headline = points.index((headline_ratio, headline))
        lane_fractions = _per_point(rows, "lane", points, "exposed_ms")
        overlap_fractions = _per_point(rows, "overlap", points, "exposed_ms")
        stock_exposed_ms = _per_point(rows, "stock", points, "exposed_ms", over=None)
        limits = [exposure_limit(rows, case) for _, case in points]
        has_limit = all(limit is not None for limit in limits)
        # What "one more microbatch's activations" allows: stock's peak and one microbatch's, over stock's peak.
        one_more = (
            1
            + rows[("stock", headline, "one_microbatch_mib")]["median"]
            / rows[("stock", headline, "saved_peak_mib")]["median"]
        )
        shape_title = "" if shape is PRE_PATH else f", {shape.title}"
        for variant in ENGINE_VARIANTS:
            if (variant, points[0][1], "exposed_ms") not in rows:
                continue  # a CSV from before the variant was measured, or a quick run's
            fractions = _per_point(rows, variant, points, "exposed_ms")
            steps = _per_point(rows, variant, points, "step_ms")
            memory = _per_point(rows, variant, points, "saved_peak_mib")
            exposed_ms = _per_point(rows, variant, points, "exposed_ms", over=None)
            # CPU time above the communication-free step's, over stock's exposed communication (CSVs from before
            # it was measured lack it).
            cpu_added = rows.get((variant, headline, "cpu_added_ms"))
            values = {
                "cpu_added_fraction": float("nan")
                if cpu_added is None
                else cpu_added["median"] / rows[("stock", headline, "exposed_ms")]["median"],
                "exposed_fraction": fractions[at_headline],
                "ratio": steps[at_headline],
                "exposed_ms": exposed_ms[at_headline],
                "saved_peak_ratio": memory[at_headline],
                "headline_ratio": headline_ratio,
            }
            values.update({f"exposed_fraction x{ratio:g}": f for (ratio, _), f in zip(points, fractions, strict=True)})
            values.update({f"step_ratio x{ratio:g}": s for (ratio, _), s in zip(points, steps, strict=True)})
            per_point = ", ".join(
                f"x{ratio:g}: {f:.2f}/{s:.2f}" for (ratio, _), f, s in zip(points, fractions, steps, strict=True)
            )
            measured = f"exposed {values['exposed_fraction']:.2f} of stock's"
            notes = (
                f"headline at x{headline_ratio:g}; exposed/stock's and step/stock by dense/comm ratio {per_point}; "
                f"exposed {values['exposed_ms']:.1f} ms, of which CPU time above the compute step's "
                f"{values['cpu_added_fraction']:.2f} of "
                f"stock's exposed; saved activations' peak / stock's "
                f"{values['saved_peak_ratio']:.2f}"
            )
            if variant == "overlap":
                below_lane = sum(f < lane for f, lane in zip(fractions, lane_fractions, strict=True))
                values["one_more_ratio"] = one_more
                notes += (
                    f" (stock's + one microbatch's: {one_more:.2f}); below the lane's exposed at "
                    f"{below_lane}/{len(points)} points; aims: exposed <= {AIM_EXPOSED_FRACTION:.2f} of stock's "
                    f"({'met' if values['exposed_fraction'] <= AIM_EXPOSED_FRACTION else 'not met'}), step <= "
                    f"{AIM_STEP_RATIO:.2f} x stock's ({'met' if values['ratio'] <= AIM_STEP_RATIO else 'not met'})"
                )
            if variant in ("turns", "twins"):
                below_overlap = sum(f < o for f, o in zip(fractions, overlap_fractions, strict=True))
                notes += f"; below the overlap's exposed at {below_overlap}/{len(points)} points"
            if has_limit and variant == "stock":
                limit = limits[at_headline]
                limit_fractions = [lim.exposed_ms / s for lim, s in zip(limits, stock_exposed_ms, strict=True)]
                values["limit_exposed_ms"] = limit.exposed_ms
                values["limit_fraction"] = limit_fractions[at_headline]
                values.update(
                    {f"limit_fraction x{ratio:g}": f for (ratio, _), f in zip(points, limit_fractions, strict=True)}
                )
                notes += (
                    f"; limit of an overlapped order {limit.exposed_ms:.1f} ms, {values['limit_fraction']:.2f} of "
                    f"stock's exposed = {limit.parts()}, by ratio "
                    + ", ".join(f"x{ratio:g}: {f:.2f}" for (ratio, _), f in zip(points, limit_fractions, strict=True))
                )
            if has_limit and variant in RULES:
                gaps = [
                    gap_closed(s, e, lim.exposed_ms)
                    for s, e, lim in zip(stock_exposed_ms, exposed_ms, limits, strict=True)
                ]
                values["gap_closed"] = gaps[at_headline]
                values.update({f"gap_closed x{ratio:g}": g for (ratio, _), g in zip(points, gaps, strict=True)})
                measured += f", {values['gap_closed']:.2f} of the gap to the limit closed"
                notes += "; gap to the limit closed by ratio " + ", ".join(
                    f"x{ratio:g}: {g:.2f}" for (ratio, _), g in zip(points, gaps, strict=True)
                )
            if variant == "stock" and t_comm is not None:
                notes += f"; T_comm {t_comm['median']:.3g} ms a microbatch" + load_note(rows, NAME)
            summary.append(
                SummaryRow(
                    NAME,
                    f"{LIBRARY_NAMES.get(library, library)}{shape_title}, {N_MICROBATCHES} microbatches, {link}",
                    variant,
                    "stock",
                    measured,
                    f"{values['ratio']:.2f}",
                    notes,
                    values,
                )
            )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    """Per case: exposed communication over stock's (and the limit's, where measured), and step time over stock's,
    against dense / comm."""
    cases = list(dict.fromkeys(r.case for r in rows))
    axes = figure.subplots(len(cases), 2, squeeze=False)
    for (exposed_ax, step_ax), case in zip(axes, cases, strict=True):
        of_case = [r for r in rows if r.case == case]
        # The limit of an overlapped order, where a full run measured it (stock's values carry it).
        limit = sorted(
            (float(name.removeprefix("limit_fraction x")), value)
            for row in of_case
            if row.variant == "stock"
            for name, value in row.values.items()
            if name.startswith("limit_fraction x")
        )
        if limit:
            exposed_ax.plot(
                [r for r, _ in limit], [v for _, v in limit], color="black", linestyle=":", marker="x", label="limit"
            )
        for ax, key, ylabel in (
            (exposed_ax, "exposed_fraction x", "exposed communication / stock's"),
            (step_ax, "step_ratio x", "step time / stock's"),
        ):
            for row in of_case:
                curve = sorted(
                    (float(name.removeprefix(key)), value) for name, value in row.values.items() if name.startswith(key)
                )
                ax.plot([r for r, _ in curve], [v for _, v in curve], marker="o", label=row.variant)
            ax.axhline(1.0, color="grey", linewidth=0.6)
            ax.set_xlabel("dense backward / T_comm (a microbatch)")
            ax.set_ylabel(ylabel)
            # A line each for the library and the shape, the rest on the last.
            ax.set_title(case.replace(", ", "\n", max(1, case.count(", ") - 1)), fontsize=8)
            ax.legend(fontsize=8)
        exposed_ax.axhline(AIM_EXPOSED_FRACTION, color="black", linewidth=0.8, linestyle="--")
        step_ax.axhline(AIM_STEP_RATIO, color="black", linewidth=0.8, linestyle="--")
    figure.suptitle("Overlap across microbatches: the stock loop, the lane alone, the lane with the overlap (- - aims)")
