"""overlap's table and CSV, from every rank's result (on the launcher, without torch)."""

from __future__ import annotations

import statistics

from ..harness.exposure import measured_ratio, merge_ranks, variant_exposure
from ..harness.report import measured_ratio_row, print_load, print_t_comm, sweep_case
from ..harness.results import csv_row, git_sha, write_csv
from ..harness.timing import Summary, summarize
from . import BATCH, COLLECTIVE_VARIANTS, FEATURES, VARIANTS, compute_of


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    """Prints the table and writes the CSV from every rank's result; ``load``: the runnable tasks while the ranks
    ran, where known."""
    sha = git_sha()
    # The calibration is the same on every rank (agreed, or from every rank's times); the held gradients rank 0's.
    result = results[0]
    calibration = result["calibration"]
    print(
        f"\noverlap: {result['dim']}d x {BATCH * FEATURES} rows, {link}; calibration: T_comm "
        f"{statistics.median(calibration['comm_s']) * 1e3:.1f} ms, one dense layer "
        f"{calibration['dense_layer_s'] * 1e3:.2f} ms"
    )
    print(
        f"{'ratio':>5} {'layers':>6} {'variant':<18} {'backward ms: median [p20-p80]':<30} {'/stock':>6} "
        f"{'exposed ms':>10} {'efficiency':>10} {'by step':>7} {'ideal':>5} {'- compute ms':>12}"
    )
    # One T_comm for the sweep: stock's wait with no dense layer (harness.calibration.calibrate_t_comm says why not
    # the comm variant).
    comm = summarize([t * 1e3 for t in calibration["comm_s"]])
    t_comm = comm.median / 1e3
    rows = [csv_row("comm", "overlap", f"{result['dim']}d x {BATCH * FEATURES} rows, {link}", "t_comm_ms", comm, sha)]
    for point in merge_ranks([r["points"] for r in results]):
        samples = point["samples"]
        stock = statistics.median(samples["stock"]["backward_s"])
        case = sweep_case("overlap", point["ratio"])
        size = f"{result['dim']}d x {BATCH * FEATURES} rows, {point['dense_layers']} dense layers, {link}"
        # The ratio the point had: stock's communication-free backward over T_comm. Its ideal is min(1, that).
        ratio = measured_ratio(samples["compute"]["backward_s"], t_comm)
        ideal = min(1.0, ratio)
        rows.append(measured_ratio_row(case, size, ratio, sha))
        for variant in (v for v in VARIANTS if v in samples):
            times = samples[variant]["backward_s"]
            backward = summarize([t * 1e3 for t in times])
            rows.append(csv_row(variant, case, size, "backward_ms", backward, sha))
            exposed_text = efficiency_text = by_step_text = ideal_text = over_text = ""
            if variant in COLLECTIVE_VARIANTS:
                # The same repetition's compute-only backward on the same engine: what the step costs beyond it,
                # the communication's exposed part and the slowdown it causes (noisy: two backward times' gap).
                compute = samples[compute_of(variant)]["backward_s"]
                exposed = variant_exposure(variant, case, size, samples, t_comm, sha, compute)
                over_compute = summarize([(b - c) * 1e3 for b, c in zip(times, compute, strict=True)])
                rows += [*exposed.rows, csv_row(variant, case, size, "over_compute_ms", over_compute, sha)]
                exposed_text, efficiency_text = f"{exposed.exposed_ms.median:.1f}", f"{exposed.efficiency.median:.2f}"
                by_step_text, ideal_text = f"{exposed.by_step.median:.2f}", f"{ideal:.2f}"
                over_text = f"{over_compute.median:.1f}"
            print(
                f"{point['ratio']:5g} {point['dense_layers']:6d} {variant:<18} {backward!s:<30} "
                f"{backward.median / 1e3 / stock:6.2f} {exposed_text:>10} {efficiency_text:>10} {by_step_text:>7} "
                f"{ideal_text:>5} {over_text:>12}"
            )
        print(
            f"{point['ratio']:5g} {point['dense_layers']:6d} measured ratio (compute-only backward / T_comm) {ratio:.2f}"
        )
    if load is not None:
        rows.append(csv_row("machine", "overlap", link, "runnable_tasks", load, sha))
    write_csv(out, rows)
    print_t_comm(comm, len(calibration["comm_s"]))
    print_load(load)
    held = result.get("held")
    if held is not None:
        # Gradients that reached a buffer ahead of stock's order wait there for their turn (issue #12).
        print(
            f"bit-stable sums (rank 0, every torch_ext backward): {held['ordered_calls']} calls in stock's "
            f"delivery order, {held['held_gradients']} gradients held back, at most "
            f"{held['peak_held_bytes'] / 2**10:.1f} KiB at once"
        )
    print(f"wrote {out}")
