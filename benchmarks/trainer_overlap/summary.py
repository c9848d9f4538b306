"""trainer_overlap's lines of bench's table and its plot, from its CSV."""

from __future__ import annotations

from collections.abc import Sequence

from ..harness.report import SummaryRow, bar_chart
from ..harness.results import csv_cases
from . import LIBRARY_NAMES, NAME


def summary_rows(rows: dict) -> list[SummaryRow]:
    """One row per library: the switch's exposed communication over the library's own loop's."""
    summary = []
    for library in csv_cases(rows, "exposed_ms"):
        own = rows[("own", library, "exposed_ms")]["median"]
        switch = rows[("switch", library, "exposed_ms")]["median"]
        step_own = rows[("own", library, "step_ms")]["median"]
        step_switch = rows[("switch", library, "step_ms")]["median"]
        t_comm = rows[("comm", library, "t_comm_ms")]["median"]
        summary.append(
            SummaryRow(
                NAME,
                f"{LIBRARY_NAMES.get(library, library)}, {rows[('own', library, 'step_ms')]['size']}",
                "switch",
                "own loop",
                f"exposed {switch:.1f} ms vs {own:.1f} ms",
                f"{switch / own:.2f}" if own > 0 else "n/a",
                f"step / own {step_switch / step_own:.2f}; T_comm {t_comm:.3g} ms",
                {"exposed_ratio": switch / own if own > 0 else float("nan"), "step_ratio": step_switch / step_own},
            )
        )
    return summary


def plot(rows: Sequence[SummaryRow], figure) -> None:
    ax = figure.subplots()
    bar_chart(
        ax,
        [r.case.partition(",")[0] for r in rows],
        {"exposed / own loop": [r.values["exposed_ratio"] for r in rows]},
        "switch / the library's own loop",
        1.0,
    )
    figure.suptitle("One switch in the libraries' own loops: exposed communication at compute/comm ~1")
