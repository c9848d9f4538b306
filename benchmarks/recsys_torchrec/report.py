"""recsys_torchrec's table and CSV, from every rank's result (on the launcher, without torch)."""

from __future__ import annotations

import statistics

from ..harness.exposure import measured_ratio, merge_ranks, variant_exposure
from ..harness.report import measured_ratio_row, print_load, print_t_comm, sweep_case
from ..harness.results import csv_row, git_sha, write_csv
from ..harness.timing import Summary, summarize
from . import DIM, ENGINE_VARIANTS, TABLES


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV from every rank's result; ``load``: the runnable tasks while the ranks
    ran, where known."""
    sha = git_sha()
    # The calibration is the same on every rank (agreed, or from every rank's times).
    result = results[0]
    print(
        f"\nrecsys_torchrec: DLRM {TABLES} tables x {DIM}d table-wise, {link}; calibration: T_comm "
        f"{statistics.median(result['comm_s']) * 1e3:.1f} ms, one dense layer {result['t_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<10} {'step ms: median [p20-p80]':<26} {'/stock':>6} "
        f"{'backward ms':<22} {'/stock':>6} {'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>5}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (harness.calibration.calibrate_t_comm says why not
    # the comm variant).
    all_comm = summarize([t * 1e3 for t in result["comm_s"]])
    t_comm = all_comm.median / 1e3
    scenario = f"DLRM {TABLES} tables x {DIM}d table-wise"
    rows = [csv_row("comm", "recsys", f"{scenario}, {link}", "t_comm_ms", all_comm, sha)]
    for point in merge_ranks([r["points"] for r in results]):
        samples = point["samples"]
        comm = summarize([t * 1e3 for t in samples["comm"]["backward_s"]])
        stock_step = statistics.median(samples["stock"]["step_s"])
        stock_backward = statistics.median(samples["stock"]["backward_s"])
        case = sweep_case("recsys", point["ratio"])
        size = f"{scenario}, {point['dense_layers']} dense layers, {link}"
        # Stock's compute, repetition by repetition: its backward less the communication it waited for.
        stock_compute = [
            b - e for b, e in zip(samples["stock"]["backward_s"], samples["stock"]["exposed_s"], strict=True)
        ]
        ratio = measured_ratio(stock_compute, t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in ENGINE_VARIANTS:
            step = summarize([t * 1e3 for t in samples[variant]["step_s"]])
            backward = summarize([t * 1e3 for t in samples[variant]["backward_s"]])
            rows.append(csv_row(variant, case, size, "step_ms", step, sha))
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            # Stock's compute is its own backward less its exposed time: by step time it would repeat its efficiency.
            exposed = variant_exposure(
                variant, case, size, samples, t_comm, sha, None if variant == "stock" else stock_compute
            )
            rows += exposed.rows
            by_step_text = "" if exposed.by_step is None else f"{exposed.by_step.median:.2f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<10} {step!s:<26} "
                f"{step.median / 1e3 / stock_step:6.2f} {backward!s:<22} "
                f"{backward.median / 1e3 / stock_backward:6.2f} {exposed.exposed_ms.median:10.1f} "
                f"{exposed.efficiency.median:10.2f} {by_step_text:>7} {ideal:5.2f}"
            )
        rows.append(csv_row("comm", case, size, "backward_ms", comm, sha))
        print(f"{point['ratio']:5g} {point['dense_layers']:6d} {'comm':<10} {'':<26} {'':>6} {comm!s:<22}")
        print(f"{point['ratio']:5g} {point['dense_layers']:6d} measured ratio (stock's compute / T_comm) {ratio:.2f}")
    if load is not None:
        rows.append(csv_row("machine", "recsys", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print_t_comm(all_comm, len(result["comm_s"]))
    print_load(load)
    print(f"wrote {out}")
