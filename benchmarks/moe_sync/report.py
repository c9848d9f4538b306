"""moe_sync's table and CSV, from every rank's result (on the launcher, without torch)."""

from __future__ import annotations

import statistics

from ..harness.exposure import measured_ratio, merge_ranks, variant_exposure
from ..harness.report import measured_ratio_row, print_load, sweep_case
from ..harness.results import csv_row, git_sha, write_csv
from ..harness.timing import Summary, summarize
from ..moe_libraries import LIBRARY_NAMES
from . import CAPACITY, DIM, TIMED_VARIANTS


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    for library in results[0]:
        first = results[0][library]
        # comm_s is already each step's, from both ranks' times (_calibrate_comm): the same on every rank.
        comm = summarize([t * 1e3 for t in first["comm_s"]])
        t_comm = comm.median / 1e3
        name = LIBRARY_NAMES[library]
        print(
            f"\nmoe_sync, {name}: {CAPACITY} tokens x {DIM}d per expert, {link}; T_comm {comm} ms (stock's wait with "
            f"no dense path, {len(first['comm_s'])} steps), one dense layer {first['t_layer'] * 1e3:.2f} ms"
        )
        print(
            f"{'ratio':>5} {'layers':>6} {'variant':<9} {'backward ms':>12} {'/stock':>7} {'step ms':>9} "
            f"{'/stock':>7} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>6} {'- compute ms':>12}"
        )
        rows.append(csv_row("comm", library, f"{CAPACITY} tokens x {DIM}d per expert, {link}", "t_comm_ms", comm, sha))
        for point in merge_ranks([r[library]["points"] for r in results]):
            samples = point["samples"]
            compute = samples["compute"]["backward_s"]
            case = sweep_case(library, point["ratio"])
            size = f"{CAPACITY} tokens x {DIM}d per expert, {point['dense_layers']} dense layers, {link}"
            stock_backward = statistics.median(samples["stock"]["backward_s"])
            stock_step = statistics.median(samples["stock"]["step_s"])
            # The ratio the point had: the communication-free backward over T_comm. Its ideal is min(1, that).
            ratio = measured_ratio(compute, t_comm)
            ideal = min(1.0, ratio)
            rows.append(measured_ratio_row(case, size, ratio, sha))
            for variant in (v for v in TIMED_VARIANTS if v in samples):
                backward = samples[variant]["backward_s"]
                backward_summary = summarize([t * 1e3 for t in backward])
                step_summary = summarize([t * 1e3 for t in samples[variant]["step_s"]])
                rows.append(csv_row(variant, case, size, "backward_ms", backward_summary, sha))
                rows.append(csv_row(variant, case, size, "step_ms", step_summary, sha))
                exposed_text = efficiency_text = by_step_text = over_text = ""
                if variant != "compute":
                    exposed = variant_exposure(variant, case, size, samples, t_comm, sha, compute)
                    # The same repetition's communication-free backward: what the step costs beyond it.
                    over = summarize([(b - c) * 1e3 for b, c in zip(backward, compute, strict=True)])
                    rows += [*exposed.rows, csv_row(variant, case, size, "over_compute_ms", over, sha)]
                    exposed_text = f"{exposed.exposed_ms.median:.1f}"
                    efficiency_text, by_step_text = f"{exposed.efficiency.median:.2f}", f"{exposed.by_step.median:.2f}"
                    over_text = f"{over.median:.1f}"
                print(
                    f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<9} {backward_summary.median:12.1f} "
                    f"{backward_summary.median / 1e3 / stock_backward:7.2f} {step_summary.median:9.1f} "
                    f"{step_summary.median / 1e3 / stock_step:7.2f} {exposed_text:>10} {efficiency_text:>10} "
                    f"{by_step_text:>7} {ideal:6.2f} {over_text:>12}"
                )
            print(f"{point['ratio']:5g} measured ratio (compute-only backward / T_comm) {ratio:.2f}")
    if load is not None:
        rows.append(csv_row("machine", "moe_sync", link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")
