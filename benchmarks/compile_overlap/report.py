"""compile_overlap's table and CSV, from every rank's result (on the launcher, without torch)."""

from __future__ import annotations

import statistics

from ..harness.exposure import measured_ratio, merge_ranks, variant_exposure
from ..harness.report import measured_ratio_row, print_load, sweep_case
from ..harness.results import csv_row, git_sha, write_csv
from ..harness.timing import Summary, summarize
from . import CAPACITY, COMPUTE_OF, DIM, ENGINE_VARIANTS, TIMED_VARIANTS


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV; ``load``: the runnable tasks while the ranks ran, where known."""
    sha = git_sha()
    rows = []
    first = results[0]
    comm = summarize([t * 1e3 for t in first["comm_s"]])
    t_comm = comm.median / 1e3
    scenario = f"{CAPACITY} tokens x {DIM}d per expert"
    print(
        f"\ncompile_overlap: {scenario}, {link}; T_comm {comm} ms (stock's wait with no dense path, "
        f"{len(first['comm_s'])} steps), one dense layer {first['t_layer'] * 1e3:.2f} ms; compile_backend's regions "
        f"hold at most {first['matmuls_per_region']} matrix products"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<18} {'backward ms':>12} {'/stock':>7} {'step ms':>9} {'/stock':>7} "
        f"{'compute step ms':>15} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>6}"
    )
    rows.append(csv_row("comm", "compile_overlap", f"{scenario}, {link}", "t_comm_ms", comm, sha))
    for index, point in enumerate(merge_ranks([r["points"] for r in results])):
        samples = point["samples"]
        case = sweep_case("compile_overlap", point["ratio"])
        size = f"{scenario}, {point['dense_layers']} dense layers, {link}"
        stock_backward = statistics.median(samples["stock"]["backward_s"])
        stock_step = statistics.median(samples["stock"]["step_s"])
        ratio = measured_ratio(samples["compute"]["backward_s"], t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in (v for v in TIMED_VARIANTS if v in samples):
            backward = samples[variant]["backward_s"]
            backward_summary = summarize([t * 1e3 for t in backward])
            step_summary = summarize([t * 1e3 for t in samples[variant]["step_s"]])
            rows.append(csv_row(variant, case, size, "backward_ms", backward_summary, sha))
            rows.append(csv_row(variant, case, size, "step_ms", step_summary, sha))
            compute_text = exposed_text = efficiency_text = by_step_text = ""
            if variant in ENGINE_VARIANTS:
                compute_variant = COMPUTE_OF[variant]
                compute = samples[compute_variant]["backward_s"]
                compute_step = summarize([t * 1e3 for t in samples[compute_variant]["step_s"]])
                exposed = variant_exposure(variant, case, size, samples, t_comm, sha, compute)
                rows += [*exposed.rows, csv_row(variant, case, size, "compute_step_ms", compute_step, sha)]
                compute_text = f"{compute_step.median:.1f}"
                exposed_text, efficiency_text = f"{exposed.exposed_ms.median:.1f}", f"{exposed.efficiency.median:.2f}"
                by_step_text = f"{exposed.by_step.median:.2f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<18} {backward_summary.median:12.1f} "
                f"{backward_summary.median / 1e3 / stock_backward:7.2f} {step_summary.median:9.1f} "
                f"{step_summary.median / 1e3 / stock_step:7.2f} {compute_text:>15} {exposed_text:>10} "
                f"{efficiency_text:>10} {by_step_text:>7} {ideal:6.2f}"
            )
        print(
            f"{point['ratio']:5g} measured ratio (compute-only backward / T_comm) {ratio:.2f}; compiling every setup "
            f"took {max(r['points'][index]['compile_s'] for r in results):.0f} s on the slower rank"
        )
    if load is not None:
        rows.append(csv_row("machine", "compile_overlap", link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")
