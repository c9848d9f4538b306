"""The limit of an overlapped order (``exposure_limit``) at a sweep point of microbatch_overlap, and how much of the
gap to it each rule closes (``gap_closed``), from the point's CSV rows."""

from __future__ import annotations

from dataclasses import dataclass

from . import N_MICROBATCHES, RULES


@dataclass(frozen=True)
class ExposureLimit:
    """A sweep point's limit (``exposure_limit``) and its parts, medians in ms."""

    # One microbatch's forward exposure and one's backward (the first's and the last's): what waits with nothing
    # to compute beside it.
    edges_ms: float
    # compute_overlapped's step - the same repetition's compute step: what two threads cost the compute.
    two_threads_ms: float
    # The CPU time the communication takes beyond the edges': stock's CPU time above its compute step's, less the
    # edges' share (1 / N_MICROBATCHES of it, in edges_ms already). 0 in a CSV from before CPU time was measured.
    comm_cpu_ms: float
    # N_MICROBATCHES x T_comm: the link's time for all the step's bytes.
    link_ms: float
    # The compute step, serial: what a step's exposure is measured from.
    compute_ms: float

    @property
    def exposed_ms(self) -> float:
        return max(self.edges_ms + self.two_threads_ms + self.comm_cpu_ms, self.link_ms - self.compute_ms)

    def parts(self) -> str:
        """How ``exposed_ms`` is made, for the table and the summary's notes."""
        return (
            f"max(edges {self.edges_ms:.1f} + two threads {self.two_threads_ms:.1f} + the communication's CPU "
            f"{self.comm_cpu_ms:.1f}, link {self.link_ms:.1f} - compute {self.compute_ms:.1f})"
        )


def exposure_limit(rows: dict, case: str) -> ExposureLimit | None:
    """The least exposed communication an order that runs two microbatches at once could reach at sweep point
    ``case``, from what its CSV ``rows`` (keyed as ``harness.results.read_csv`` keys them) measured; None where
    compute_overlapped was not timed (a quick run, a CSV from before it).

    Exposure is a step's time minus the same repetition's serial compute-only step, C (``compute``'s step). Only
    an order that runs two microbatches at once can hide a synchronous forward all_to_all (the forward's thread
    waits in it), and whatever else such an order does, two bounds hold:

    - Compute and edges. Its compute takes C2, the compute-only step on two threads (``compute_overlapped``: the
      overlap's threads, no collective). Beyond that, the edges wait with nothing to compute: microbatch 0's
      forward all_to_alls (no backward is in flight yet) and the last microbatch's backward ones (no forward comes
      after it). E = one microbatch's forward exposure + one microbatch's backward exposure, each phase's exposure
      over the step / N_MICROBATCHES, the lesser of stock's and the lane's (the lane hides a backward's
      all_to_alls behind its own dense path, which the last backward can do too). And the communication takes CPU
      time of its own (gloo's threads, the library's Python around each all_to_all, the lanes), which on a rank's
      one core no order can hide behind compute that already fills it: P, stock's CPU time above its compute
      step's (``cpu_added_ms``), less the edges' share, P / N_MICROBATCHES, which E holds already. Step >= C2 + E +
      P (N_MICROBATCHES - 1) / N_MICROBATCHES, so exposure >= E + (C2 - C) + P (N_MICROBATCHES - 1) /
      N_MICROBATCHES. (--timeline's traces of the rules at x1 found no other part: where both compute threads
      waited, between the edges, was under 0.01 of stock's exposure for twins.)
    - The link. Every byte of the step crosses it: L = N_MICROBATCHES x T_comm, T_comm the shape's wait for one
      microbatch's all_to_alls with no dense layer. Step >= L, so exposure >= L - C.

    The limit is the larger. What it leaves out would raise it: the compute before the first all_to_all and after
    the last (a projection's), and, in the link's bound, the communication's CPU time. What would lower it: P, if
    part of stock's CPU time above compute were not the communication's own (the all_to_alls are the only
    difference between the two steps), and in L, T_comm: timed one all_to_all at a time, it holds each one's
    latency, which two in flight at once could share.
    """
    if ("compute_overlapped", case, "added_ms") not in rows:
        return None

    def median(what: str, metric: str, of_case: str = case) -> float:
        return rows[(what, of_case, metric)]["median"]

    edges = sum(
        min(median(variant, f"{phase}_exposed_ms") for variant in ("stock", "lane"))
        for phase in ("forward", "backward")
    )
    comm_cpu = rows.get(("stock", case, "cpu_added_ms"))
    return ExposureLimit(
        edges_ms=edges / N_MICROBATCHES,
        two_threads_ms=median("compute_overlapped", "added_ms"),
        comm_cpu_ms=0.0 if comm_cpu is None else comm_cpu["median"] * (N_MICROBATCHES - 1) / N_MICROBATCHES,
        link_ms=N_MICROBATCHES * median("comm", "t_comm_ms", case.rpartition(" x")[0]),
        compute_ms=median("compute", "step_ms"),
    )


def gap_closed(stock_exposed_ms: float, exposed_ms: float, limit_exposed_ms: float) -> float:
    """The fraction of the gap between stock's exposure and the limit that ``exposed_ms`` closes: 0 at stock's, 1 at
    the limit; NaN where stock's is not above the limit (no gap to close)."""
    gap = stock_exposed_ms - limit_exposed_ms
    return (stock_exposed_ms - exposed_ms) / gap if gap > 0 else float("nan")


def gaps_closed(rows: dict, case: str, limit: ExposureLimit) -> dict[str, float]:
    """Each timed rule's ``gap_closed`` at sweep point ``case``, from its CSV ``rows``."""
    stock = rows[("stock", case, "exposed_ms")]["median"]
    return {
        rule: gap_closed(stock, rows[(rule, case, "exposed_ms")]["median"], limit.exposed_ms)
        for rule in RULES
        if (rule, case, "exposed_ms") in rows
    }
