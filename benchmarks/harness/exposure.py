"""How the sweeps read exposed communication, all alike: each rank's backward thread's blocked time
(``timing.timed_blocking``), read as what the slowest rank's backward waited beyond the longest time any rank spent
unblocked (``exposed_past_the_slowest_rank``, which says why not the slower rank's blocked time); the ranks' times
merged per repetition (``merge_ranks``); the efficiency against T_comm, by blocked time and by step time; the ratio
a sweep point measured. Imports no torch (a sweep's launcher reports with it)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .results import csv_row
from .timing import Summary, summarize


def exposed_past_the_slowest_rank(walls: Sequence[float], blocked: Sequence[float]) -> float:
    """One step's exposed communication from each rank's backward: (wall seconds, blocked seconds) per rank, as
    ``timed_blocking`` measured them. The step ends with its slowest rank's backward; what it waited beyond the
    longest time any rank spent unblocked (computing, or waiting for a CPU) is communication nothing hid.

    Not the slower rank's blocked time: a rank that reaches the collective first also waits for the other to
    arrive. On the shaped link one rank's dense backward ending 5-14 ms after the other's at every deep point of a
    quick run read as stock waiting 40-50 ms for an all_to_all that took 36 ms with no dense path (36 in the
    runs before and after). Not the rank that waited least either: gloo's all_to_all keeps one rank ~20 ms and
    the other ~36 ms in the same call, and the step pays the 36.
    """
    unblocked = max(wall - waited for wall, waited in zip(walls, blocked, strict=True))
    return max(0.0, max(walls) - unblocked)


def exposed_of_each_step(
    walls_per_rank: Sequence[Sequence[float]], blocked_per_rank: Sequence[Sequence[float]]
) -> list[float]:
    """exposed_past_the_slowest_rank of each step, from every rank's seconds per step."""
    return [
        exposed_past_the_slowest_rank(walls, blocked)
        for walls, blocked in zip(zip(*walls_per_rank, strict=True), zip(*blocked_per_rank, strict=True), strict=True)
    ]


def merge_ranks(points_of_each_rank: Sequence[Sequence[dict]]) -> list[dict]:
    """A sweep's points as the step sees them, from every rank's (``{"ratio", "dense_layers", "samples"}``, the
    samples as ``sweep.timed_repetitions`` gives them): each metric per repetition the slowest rank's (the step
    waits for it), and where a variant has ``blocked_s``, its ``exposed_s`` per repetition,
    exposed_past_the_slowest_rank of every rank's ``backward_s`` and ``blocked_s``."""
    merged = []
    for index, point in enumerate(points_of_each_rank[0]):
        per_rank = [points[index]["samples"] for points in points_of_each_rank]
        samples = {}
        for variant, metrics in point["samples"].items():
            samples[variant] = {
                metric: [max(values) for values in zip(*(s[variant][metric] for s in per_rank), strict=True)]
                for metric in metrics
            }
            if "blocked_s" in metrics:
                samples[variant]["exposed_s"] = exposed_of_each_step(
                    [s[variant]["backward_s"] for s in per_rank], [s[variant]["blocked_s"] for s in per_rank]
                )
        merged.append({**point, "samples": samples})
    return merged


def exposure(exposed_s: Sequence[float], t_comm_s: float) -> tuple[Summary, Summary]:
    """Exposed communication in ms and overlap efficiency (1 - exposed / T_comm) of a point's repetitions."""
    return summarize([e * 1e3 for e in exposed_s]), summarize([1 - e / t_comm_s for e in exposed_s])


@dataclass(frozen=True)
class VariantExposure:
    """A variant's exposed communication at a sweep point (``variant_exposure``): its summaries for the table, and
    ``rows``, their CSV rows."""

    exposed_ms: Summary
    efficiency: Summary
    # By step time (``step_efficiency``); None without a communication-free backward to read it against.
    by_step: Summary | None
    rows: list[dict[str, object]]


def variant_exposure(
    variant: str,
    case: str,
    size: str,
    samples: dict,
    t_comm_s: float,
    sha: str,
    compute_s: Sequence[float] | None = None,
) -> VariantExposure:
    """``variant``'s exposed ms and efficiency at sweep point ``case`` (``exposure``, of its merged ``samples``'
    ``exposed_s``) and, against ``compute_s`` (the same repetitions' communication-free backward), its efficiency by
    step time: the CSV rows ``exposed_ms``, ``efficiency`` and ``step_efficiency``, in that order."""
    exposed_ms, efficiency = exposure(samples[variant]["exposed_s"], t_comm_s)
    rows = [
        csv_row(variant, case, size, "exposed_ms", exposed_ms, sha),
        csv_row(variant, case, size, "efficiency", efficiency, sha),
    ]
    by_step = None
    if compute_s is not None:
        by_step = step_efficiency(samples[variant]["backward_s"], compute_s, t_comm_s)
        rows.append(csv_row(variant, case, size, "step_efficiency", by_step, sha))
    return VariantExposure(exposed_ms, efficiency, by_step, rows)


def step_efficiency(backward_s: Sequence[float], compute_s: Sequence[float], t_comm_s: float) -> Summary:
    """Overlap efficiency by step time, of a point's repetitions: 1 - (backward - the same repetition's
    communication-free backward) / T_comm. Beside ``exposure``'s, which counts only the time a rank was blocked:
    this one also counts what the communication costs the compute (gloo's threads on the same cores), and it reads
    below the blocked-time one where that cost is real."""
    return summarize([1 - (b - c) / t_comm_s for b, c in zip(backward_s, compute_s, strict=True)])


def measured_ratio(compute_s: Sequence[float], t_comm_s: float) -> float:
    """The compute/communication ratio a sweep point really had: its communication-free backward's median over
    T_comm. The sweep asks for a ratio of dense layers, from one layer's calibrated time; the whole backward's
    compute is what could hide the transfer, so the point's ideal efficiency is min(1, this)."""
    return statistics.median(compute_s) / t_comm_s
