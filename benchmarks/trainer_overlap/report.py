"""trainer_overlap's table and CSV, from every rank's result (on the launcher, without torch)."""

from __future__ import annotations

from ..harness.exposure import merge_ranks
from ..harness.report import print_load
from ..harness.results import csv_row, git_sha, write_csv
from ..harness.timing import Summary, summarize
from . import LIBRARY_NAMES, N_MICROBATCHES, NAME, VARIANTS


def report(results: list[dict], link: str, out: str, load: Summary | None = None) -> None:
    sha = git_sha()
    rows = []
    print(f"\n{NAME}: {N_MICROBATCHES} microbatches a step, {link}")
    print(f"{'library':<14} {'variant':<8} {'step ms':>9} {'exposed ms':>11} {'/ own':>6}")
    for library in results[0]:
        first = results[0][library]
        # Each repetition's step, the slower rank's (the step waits for it).
        samples = merge_ranks([[r[library]] for r in results])[0]["samples"]
        comm = summarize([t * 1e3 for t in first["comm_s"]])
        size = f"{first['dense_layers']} dense layers, {link}"
        rows.append(csv_row("comm", library, size, "t_comm_ms", comm, sha))
        compute = samples["compute"]["step_s"]
        exposed = {}
        for variant in VARIANTS:
            steps = samples[variant]["step_s"]
            step = summarize([s * 1e3 for s in steps])
            rows.append(csv_row(variant, library, size, "step_ms", step, sha))
            text = ""
            if variant != "compute":
                exposed[variant] = summarize([(s - c) * 1e3 for s, c in zip(steps, compute, strict=True)])
                rows.append(csv_row(variant, library, size, "exposed_ms", exposed[variant], sha))
                text = f"{exposed[variant].median:11.1f} {exposed[variant].median / exposed['own'].median:6.2f}"
            print(f"{LIBRARY_NAMES[library]:<14} {variant:<8} {step.median:9.1f} {text}")
        print(f"{'':<14} T_comm {comm} ms, {first['dense_layers']} dense layers")
    if load is not None:
        rows.append(csv_row("machine", NAME, link, "runnable_tasks", load, sha))
    print_load(load)
    write_csv(out, rows)
    print(f"wrote {out}")
