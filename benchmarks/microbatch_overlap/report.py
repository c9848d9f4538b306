"""microbatch_overlap's table and CSV from every rank's result, the traces' split and the summary against the aims
(on the launcher, without torch)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..harness.exposure import measured_ratio, merge_ranks
from ..harness.report import SummaryRow, measured_ratio_row, print_load, sweep_case
from ..harness.results import csv_row, git_sha, rows_by_key, write_csv
from ..harness.timing import Summary, summarize
from ..moe_libraries import LIBRARY_NAMES
from . import (
    AIM_EXPOSED_FRACTION,
    AIM_STEP_RATIO,
    CAPACITY,
    DIM,
    ENGINE_VARIANTS,
    N_MICROBATCHES,
    NAME,
    PHASED_VARIANTS,
    ROWS,
    RULES,
    TIMED_VARIANTS,
    TRACED_STEPS,
    VARIANT_WIDTH,
)
from .limit import exposure_limit, gaps_closed
from .shapes import split_case_prefix
from .summary import summary_rows


def _exposed(samples: dict, variant: str, metric: str) -> list[float]:
    """``variant``'s ``metric`` minus the same repetition's ``compute``'s, in seconds."""
    return [v - c for v, c in zip(samples[variant][metric], samples["compute"][metric], strict=True)]


def _ms(seconds: Sequence[float]) -> Summary:
    return summarize([s * 1e3 for s in seconds])


def _single(value: float) -> Summary:
    return Summary(value, value, value)


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    for prefix in results[0]:
        library, shape = split_case_prefix(prefix)
        first = results[0][prefix]
        comm = _ms(first["comm_s"])
        print(
            f"\n{NAME}, {LIBRARY_NAMES[library]}, {shape.title}: {N_MICROBATCHES} microbatches of {ROWS} tokens x "
            f"{DIM}d, {CAPACITY} per expert, {link}; T_comm {comm} ms a microbatch (stock's wait for its "
            f"{4 * shape.moe_layers} all_to_alls with no dense layer, {len(first['comm_s'])} steps), "
            f"{N_MICROBATCHES * comm.median:.1f} ms a step; one dense layer's backward {first['t_layer'] * 1e3:.2f} "
            "ms. gap: the fraction of stock's exposure above the limit (where compute_overlapped was timed) that a "
            "rule hides"
        )
        print(
            f"{'ratio':>5} {'layers':>6} {'variant':<{VARIANT_WIDTH}} {'step ms':>8} {'/stock':>6} {'exposed ms':>10} "
            f"{'/stock':>6} {'cpu +ms':>7} {'fwd exp':>7} {'bwd exp':>7} {'saved MiB':>9} {'/stock':>6} {'gap':>6}"
        )
        rows.append(csv_row("comm", prefix, f"{ROWS} tokens x {DIM}d a microbatch, {link}", "t_comm_ms", comm, sha))
        merged = merge_ranks([r[prefix]["points"] for r in results])
        for index, point in enumerate(merged):
            samples = point["samples"]
            # Each rank's activations are its own; the larger of the two ranks' (they hold the same shapes).
            memory = {
                variant: {
                    key: max(r[prefix]["points"][index]["memory"][variant][key] for r in results)
                    for key in ("saved_peak_bytes", "one_microbatch_bytes")
                }
                for variant in ENGINE_VARIANTS
            }
            case = sweep_case(prefix, point["ratio"])
            size = f"{ROWS} tokens x {DIM}d a microbatch, {point['dense_layers']} dense layers, {link}"
            stock_step = statistics.median(samples["stock"]["step_s"])
            stock_exposed = statistics.median(_exposed(samples, "stock", "step_s"))
            stock_saved = memory["stock"]["saved_peak_bytes"]
            one_microbatch = memory["stock"]["one_microbatch_bytes"]
            rows.append(csv_row("stock", case, size, "one_microbatch_mib", _single(one_microbatch / 2**20), sha))
            # Each variant's cells: printed once the point's limit is known.
            lines = []
            for variant in (v for v in TIMED_VARIANTS if v in samples):
                step = _ms(samples[variant]["step_s"])
                rows.append(csv_row(variant, case, size, "step_ms", step, sha))
                cells = [f"{step.median:8.1f}", f"{step.median / 1e3 / stock_step:6.2f}"]
                if variant in PHASED_VARIANTS:
                    for phase in ("forward", "backward"):
                        rows.append(
                            csv_row(variant, case, size, f"{phase}_ms", _ms(samples[variant][f"{phase}_s"]), sha)
                        )
                if variant == "compute":
                    cpu = _ms(samples[variant]["cpu_s"])
                    rows.append(csv_row(variant, case, size, "cpu_ms", cpu, sha))
                    lines.append((variant, [*cells, f"{'(cpu ms)':>17}", f"{cpu.median:7.1f}"]))
                    continue
                if variant == "compute_overlapped":
                    added = _ms(_exposed(samples, variant, "step_s"))
                    rows.append(csv_row(variant, case, size, "added_ms", added, sha))
                    lines.append((variant, [*cells, f"{'(+ms, 2 threads)':>17}", f"{added.median:7.1f}"]))
                    continue
                exposed_s = _exposed(samples, variant, "step_s")
                exposed = _ms(exposed_s)
                rows.append(csv_row(variant, case, size, "exposed_ms", exposed, sha))
                cpu_added = _ms(_exposed(samples, variant, "cpu_s"))
                rows.append(csv_row(variant, case, size, "cpu_added_ms", cpu_added, sha))
                cells += [
                    f"{exposed.median:10.1f}",
                    f"{exposed.median / 1e3 / stock_exposed:6.2f}",
                    f"{cpu_added.median:7.1f}",
                ]
                if variant in PHASED_VARIANTS:
                    for phase in ("forward", "backward"):
                        phase_exposed = _ms(_exposed(samples, variant, f"{phase}_s"))
                        rows.append(csv_row(variant, case, size, f"{phase}_exposed_ms", phase_exposed, sha))
                        cells.append(f"{phase_exposed.median:7.1f}")
                else:
                    cells.append(f"{'(phases overlap)':>15}")
                saved = memory[variant]["saved_peak_bytes"]
                rows.append(csv_row(variant, case, size, "saved_peak_mib", _single(saved / 2**20), sha))
                cells += [f"{saved / 2**20:9.1f}", f"{saved / stock_saved:6.2f}"]
                lines.append((variant, cells))
            # The ratio the point had: the communication-free step's backward over the step's T_comm.
            ratio = measured_ratio(samples["compute"]["backward_s"], N_MICROBATCHES * comm.median / 1e3)
            rows.append(measured_ratio_row(case, size, ratio, sha))
            point_rows = rows_by_key(rows)
            limit = exposure_limit(point_rows, case)
            gaps = {} if limit is None else gaps_closed(point_rows, case, limit)
            if limit is not None:
                for metric, value in (
                    ("edges_ms", limit.edges_ms),
                    ("comm_cpu_ms", limit.comm_cpu_ms),
                    ("link_ms", limit.link_ms),
                    ("limit_exposed_ms", limit.exposed_ms),
                ):
                    rows.append(csv_row("limit", case, size, metric, _single(value), sha))
                for rule, gap in gaps.items():
                    rows.append(csv_row(rule, case, size, "gap_closed", _single(gap), sha))
            for variant, cells in lines:
                gap = [f"{gaps[variant]:6.2f}"] if variant in gaps else []
                print(
                    f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<{VARIANT_WIDTH}} "
                    f"{' '.join([*cells, *gap])}"
                )
            print(f"{'':12} measured ratio (compute-only backward / T_comm) {ratio:.2f}")
            print_trace_split([r[prefix]["points"][index].get("trace") for r in results], stock_exposed * 1e3)
            print(
                f"{'':12} one microbatch's activations {one_microbatch / 2**20:.1f} MiB: stock + one microbatch = "
                f"{(stock_saved + one_microbatch) / stock_saved:.2f} x stock's peak"
            )
            if limit is not None:
                print(
                    f"{'':12} limit: exposed {limit.exposed_ms:.1f} ms, {limit.exposed_ms / 1e3 / stock_exposed:.2f} "
                    f"of stock's = {limit.parts()}"
                )
    if load is not None:
        rows.append(csv_row("machine", NAME, link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")
    print_summary(summary_rows(rows_by_key(rows)))


def print_trace_split(traces: Sequence[dict | None], stock_exposed_ms: float) -> None:
    """--timeline's split of each rank's traced steps (``step_split``), medians over the steps, in ms. A step's
    exposure (the traced step - the rank's own compute step) is the time some compute thread was busy above the
    compute step (``busy +``) and the time both compute threads waited: at the leading edge, in the middle, at the
    trailing edge. ``busy +`` in turn: the compute threads' time on a core above the compute step's CPU time (``on
    core +``), the other threads' (``others``: gloo's, the lanes'; the process's CPU time less the compute
    threads'), and the rest by difference (``rest``: a compute thread outside its recorded waits yet not on a
    core, blocked where the trace records no wait, or ready while a thread of the other rank ran). Beside them the
    compute threads' time ready with no core free (``ready``, the two threads' summed: while one runs the other
    is often ready, so it is not time lost) and the trace's own cost (``trace +``: the traced step - the rank's
    untraced median)."""
    if any(trace is None for trace in traces):
        return
    print(
        f"{'':12} traced ({TRACED_STEPS} steps a rule, medians, ms): exposed = the traced step - the rank's compute "
        "step = busy + + idle (leading, middle, trailing); busy + = on core + + others + rest"
    )
    print(
        f"{'':12} {'rank':>4} {'rule':<8} {'step':>7} {'trace +':>7} {'exposed':>7} {'/stock':>6} {'busy +':>6} "
        f"{'leading':>7} {'middle':>6} {'trailing':>8} {'on core +':>9} {'others':>6} {'rest':>6} {'ready':>6}"
    )
    for rank, trace in enumerate(traces):
        for rule, parts in trace["splits"].items():
            median = {name: statistics.median(values) for name, values in parts.items()}
            exposed = median["step_ms"] - trace["compute_ms"]
            busy_added = median["busy_ms"] - trace["compute_ms"]
            on_core_added = median["compute_threads_on_core_ms"] - trace["compute_cpu_ms"]
            print(
                f"{'':12} {rank:4d} {rule:<8} {median['step_ms']:7.1f} "
                f"{median['step_ms'] - trace['untraced_ms'][rule]:7.1f} {exposed:7.1f} "
                f"{exposed / stock_exposed_ms:6.2f} "
                f"{busy_added:6.1f} {median['idle_leading_ms']:7.1f} {median['idle_middle_ms']:6.1f} "
                f"{median['idle_trailing_ms']:8.1f} {on_core_added:9.1f} {median['other_threads_on_core_ms']:6.1f} "
                f"{busy_added - on_core_added - median['other_threads_on_core_ms']:6.1f} "
                f"{median['compute_threads_ready_ms']:6.1f}"
            )


def print_summary(rows: Sequence[SummaryRow]) -> None:
    """The headline point's figures against stock, per case, and the overlap against the aims."""
    for case in dict.fromkeys(row.case for row in rows):
        of_case = {row.variant: row.values for row in rows if row.case == case}
        points = [
            key.removeprefix("exposed_fraction ") for key in of_case["stock"] if key.startswith("exposed_fraction x")
        ]
        headline = of_case["stock"]["headline_ratio"]
        print(f"\nsummary, {case}: at the headline point x{headline:g} (the sweep's points: {', '.join(points)})")
        print(
            f"{'variant':<8} {'exposed / stock':>15} {'step / stock':>12} {'saved peak / stock':>18} "
            f"{'cpu added / stock exposed':>25}"
        )
        for variant, values in of_case.items():
            print(
                f"{variant:<8} {values['exposed_fraction']:15.2f} {values['ratio']:12.2f} "
                f"{values['saved_peak_ratio']:18.2f} {values['cpu_added_fraction']:25.2f}"
            )
        overlap, lane = of_case["overlap"], of_case["lane"]
        below = [p for p in points if overlap[f"exposed_fraction {p}"] < lane[f"exposed_fraction {p}"]]
        print(
            f"overlap: exposed {overlap['exposed_fraction']:.2f} of stock's, {overlap['cpu_added_fraction']:.2f} of it "
            f"CPU time above the compute step's (aim <= {AIM_EXPOSED_FRACTION:.2f}: "
            f"{'met' if overlap['exposed_fraction'] <= AIM_EXPOSED_FRACTION else 'not met'}), step "
            f"{overlap['ratio']:.2f} x stock's (aim <= {AIM_STEP_RATIO:.2f}: "
            f"{'met' if overlap['ratio'] <= AIM_STEP_RATIO else 'not met'}), below the lane's exposed at "
            f"{len(below)}/{len(points)} points; saved activations' peak {overlap['saved_peak_ratio']:.2f} x stock's "
            f"(stock's + one microbatch's: {overlap['one_more_ratio']:.2f})"
        )
        for rule in ("turns", "twins"):
            values = of_case.get(rule)
            if values is None:
                continue
            by_point = ", ".join(
                f"{p} {values[f'exposed_fraction {p}']:.2f}/{overlap[f'exposed_fraction {p}']:.2f}" for p in points
            )
            print(
                f"{rule}: exposed {values['exposed_fraction']:.2f} of stock's, step {values['ratio']:.2f} x stock's; "
                f"exposed against the overlap's by point: {by_point}"
            )
        stock = of_case["stock"]
        if "limit_exposed_ms" in stock:
            gaps = ", ".join(f"{rule} {of_case[rule]['gap_closed']:.2f}" for rule in RULES if rule in of_case)
            print(
                f"limit: exposed {stock['limit_exposed_ms']:.1f} ms, {stock['limit_fraction']:.2f} of stock's; the gap "
                f"between stock's exposure and the limit closed: {gaps}"
            )
