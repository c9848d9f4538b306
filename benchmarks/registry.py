"""Every benchmark ``python -m torch_ext bench`` runs, in the order it runs them (BENCHMARKS): cheapest first, so
that a broken install fails fast.

A benchmark is a module (or package) of this one that ``python -m`` runs: its main takes ``--out CSV`` and
``--quick`` (and the options of its extra outputs), writes its long-format CSV (harness/results.py), and exits 0
without writing it when it cannot run here (no GPU, a library missing), its last line saying why. Its summary
module has ``summary_rows(csv_rows) -> [SummaryRow]`` (its lines of bench's table, from its CSV) and
``plot(rows, figure)`` (its picture, from those rows). bench runs each benchmark in a process of its own, and
imports a summary module only after the runs: the modules are named here, not imported, so that reading this
list costs nothing and one benchmark's broken import fails that benchmark alone.

Adding one: its module beside the others (harness/ has the sweep, the two hosts, the CSV and the summary rows),
one ``Benchmark`` line below, and its summary's test in tests/benchmarks/.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    # Its name in bench's --only and of its files in the results folder (<name>.csv, .log and .png).
    name: str
    # The module ``python -m`` runs, relative to this package (default: name).
    module: str | None = None
    # The module with its summary_rows and plot, relative to this package (default: module).
    summary: str | None = None
    # Files it writes into the results folder beside its CSV: (its option, the file's name). A PNG's events are
    # written beside it (same name, .json).
    extra_outputs: tuple[tuple[str, str], ...] = ()

    @property
    def main_module(self) -> str:
        return self.module or self.name

    @property
    def summary_module(self) -> str:
        return self.summary or self.main_module


BENCHMARKS = (
    Benchmark("engine_overhead"),
    Benchmark("trace_overhead"),
    Benchmark("order_check_scale"),
    Benchmark("backward_memory"),
    Benchmark("split_backward"),
    Benchmark("overlap", summary="overlap.summary", extra_outputs=(("--timeline", "overlap_timeline.png"),)),
    Benchmark("recsys_torchrec", summary="recsys_torchrec.summary"),
    Benchmark("moe_sync", summary="moe_sync.summary"),
    Benchmark("compile_overlap", summary="compile_overlap.summary"),
    Benchmark("microbatch_overlap", summary="microbatch_overlap.summary"),
    Benchmark("trainer_overlap", summary="trainer_overlap.summary"),
    Benchmark("kernels"),
)
