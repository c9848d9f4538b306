"""``python -m torch_ext bench``: every benchmark against stock PyTorch, one summary, one results folder.

The benchmarks are the package ``benchmarks`` of the checkout torch_ext runs from (installed from a wheel:
``torch_ext.benchmarks``), and ``benchmarks/registry.py`` declares which there are and in what order. Each runs as
its own subprocess (``python -m benchmarks.<name>``), so that the benchmarks do not share a process's warm caches,
allocator state or threads, and so that the two-host ones can launch their torchrun hosts
(benchmarks/harness/hosts.py). Each writes its long-format CSV and log into the results folder. Afterwards this
module is the table: each CSV is read back and turned into summary rows and a bar chart of the ratios to stock by
its benchmark's summary module (``summary_rows`` and ``plot``: each benchmark knows its CSV's layout), and the rows
of all of them are printed and written as ``summary.md`` and ``summary.csv``. Plots are made from the CSVs, outside
the timed runs.

A benchmark that exits nonzero makes the whole command exit nonzero, after the others have run and the
summary of what there is has been written. One that exits 0 without writing its CSV (kernels without
a CUDA device) is reported as skipped, with its last line as the reason.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import itertools
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from torch_ext.bench_progress import make_progress

# How often the progress display reads the running benchmark's log.
POLL_S = 0.5
# What a failed benchmark's message quotes from its log.
FAILURE_LOG_LINES = 20
# How long a stopped benchmark gets to clean up after SIGINT before its process group is killed.
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Benchmark:
    """A benchmark as bench runs it: ``command`` and its options, its output in the results folder."""

    name: str
    # What runs it, before its options (--out CSV, --quick, its extra outputs').
    command: tuple[str, ...]
    # (option, file name in the results folder) pairs passed to it.
    extra_outputs: tuple[tuple[str, str], ...] = ()

    def command_line(self, folder: Path, quick: bool) -> list[str]:
        command = [*self.command, "--out", str(folder / f"{self.name}.csv")]
        if quick:
            command.append("--quick")
        for option, file_name in self.extra_outputs:
            command += [option, str(folder / file_name)]
        return command

    def extra_files(self, folder: Path) -> list[Path]:
        """Its extra outputs, with the events a timeline PNG is written with (same name, ``.json``)."""
        files = []
        for _, file_name in self.extra_outputs:
            files.append(folder / file_name)
            if file_name.endswith(".png"):
                files.append((folder / file_name).with_suffix(".json"))
        return files

    def outputs(self, folder: Path) -> list[Path]:
        """Every file in ``folder`` that running it (and summarizing it) writes."""
        return [folder / f"{self.name}{suffix}" for suffix in (".csv", ".log", ".png")] + self.extra_files(folder)


def _checkout() -> Path | None:
    """The source checkout torch_ext runs from (imported through PYTHONPATH, or installed editable), whose
    ``benchmarks/`` are this torch_ext's; None when torch_ext is installed from a wheel."""
    top = Path(__file__).resolve().parent.parent
    return top if (top / "setup.py").is_file() and (top / "benchmarks" / "registry.py").is_file() else None


@functools.cache
def benchmarks_package() -> str:
    """The name the benchmarks of the torch_ext being run import as: ``benchmarks`` in a source checkout, whose top
    level goes on sys.path (and on the benchmarks' PYTHONPATH: ``benchmark_environment``), ``torch_ext.benchmarks``
    from a wheel. The checkout's own first, rather than ``torch_ext.benchmarks`` wherever it is: with PYTHONPATH
    pointing at one checkout while another is installed editable, setuptools' editable finder would lead to the
    other checkout's benchmarks."""
    checkout = _checkout()
    if checkout is None:
        return "torch_ext.benchmarks"
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """The module ``name`` of the benchmarks' package (``"overlap.summary"``, ``"harness.results"``)."""
    return importlib.import_module(f"{benchmarks_package()}.{name}")


def benchmark_environment() -> dict[str, str]:
    """A benchmark's environment: this process's, unbuffered (its log shows its lines as they come and in the order
    printed), with a checkout's top level first on PYTHONPATH so that it imports this checkout's benchmarks and
    torch_ext, whatever the working directory."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    checkout = _checkout()
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    return env


def registry() -> tuple:
    """benchmarks/registry.py's BENCHMARKS: every benchmark's declaration, in the order they run."""
    return benchmark_module("registry").BENCHMARKS


def all_benchmarks() -> dict[str, Benchmark]:
    """Every declared benchmark as bench runs it: ``python -m <package>.<its module>``."""
    return {
        declared.name: Benchmark(
            declared.name,
            (sys.executable, "-m", f"{benchmarks_package()}.{declared.main_module}"),
            declared.extra_outputs,
        )
        for declared in registry()
    }


def _summary_module(name: str) -> ModuleType:
    """Benchmark ``name``'s module with ``summary_rows(csv_rows)`` and ``plot(rows, figure)``."""
    declared = next(declared for declared in registry() if declared.name == name)
    return benchmark_module(declared.summary_module)


@dataclass
class Outcome:
    name: str
    returncode: int
    seconds: float
    log: Path
    csv: Path

    @property
    def status(self) -> str:
        if self.returncode != 0:
            return "failed"
        return "ok" if self.csv.is_file() else "skipped"

    @property
    def reason(self) -> str:
        """Why it failed or was skipped: the last line of its log."""
        lines = _log_lines(self.log)
        return lines[-1] if lines else ""


def _log_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()]


# --- running ----------------------------------------------------------------------------------------


def run_benchmark(benchmark: Benchmark, folder: Path, quick: bool, progress) -> Outcome:
    """Runs one benchmark, its stdout and stderr into ``<folder>/<name>.log``."""
    log_path = folder / f"{benchmark.name}.log"
    # An earlier run's files in the same folder must not pass for this run's (a CSV makes it "ok").
    for path in benchmark.outputs(folder):
        path.unlink(missing_ok=True)
    progress.start(benchmark.name)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session and process group (with the ranks a two-host benchmark spawns), so that stopping it reaches
        # all of them, however bench itself was stopped.
        process = subprocess.Popen(
            benchmark.command_line(folder, quick),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=benchmark_environment(),
            start_new_session=True,
        )
        try:
            while not _exited(process, POLL_S):
                lines = _log_lines(log_path)
                progress.running(benchmark.name, time.perf_counter() - started, lines[-1] if lines else "")
        except BaseException:
            stop_process_group(process)
            raise
    elapsed = time.perf_counter() - started
    outcome = Outcome(benchmark.name, process.returncode, elapsed, log_path, folder / f"{benchmark.name}.csv")
    progress.finish(outcome.name, outcome.status, outcome.seconds)
    return outcome


def _exited(process: subprocess.Popen, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for ``process``; whether it has exited. Returns as soon as it exits, where a sleep
    of the poll's interval lost a quarter of a second a benchmark on average."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT to the benchmark's process group, as Ctrl-C would send; SIGKILL if it is not done in ``grace_s``.

    The grace lets the benchmark clean up (a two-host one stops its ranks and deletes its network namespaces).
    """
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # The group may outlive its leader (ranks still stopping): kill what is left of it.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def machine_description() -> str:
    """The CPU's model and the core count: numerics and timings both depend on them (MKL takes other paths on
    another vendor's CPU), so every run says which machine made it."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def run_all(benchmarks: Sequence[Benchmark], folder: Path, quick: bool) -> int:
    """Runs the benchmarks, writes the summary and plots into ``folder``; 0 unless a benchmark failed."""
    folder.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    print(f"bench: on {machine}", file=sys.stderr, flush=True)
    progress = make_progress(len(benchmarks))
    outcomes = []
    # SIGTERM (a CI job cancelled, kill) stops the running benchmark as Ctrl-C does, rather than orphaning it.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main_thread else None
    try:
        for benchmark in benchmarks:
            outcomes.append(run_benchmark(benchmark, folder, quick, progress))
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm if previous_sigterm is not None else signal.SIG_DFL)
        progress.close()

    rows = summarize_folder(folder, [outcome.name for outcome in outcomes if outcome.status == "ok"])
    table = format_table(rows)
    print(table)
    status_lines = [
        f"{o.name}: {o.status} in {o.seconds:.1f} s" + (f" ({o.reason})" if o.status != "ok" else "") for o in outcomes
    ]
    print("\n".join(status_lines))
    print(f"machine: {machine}")
    write_summary(folder, rows, outcomes, quick, machine)
    plots = write_plots(folder, rows)
    # The benchmarks' own pictures (the overlap timelines), where they wrote them.
    by_name = {benchmark.name: benchmark for benchmark in benchmarks}
    plots += [
        path
        for outcome in outcomes
        if outcome.status == "ok"
        for path in by_name[outcome.name].extra_files(folder)
        if path.suffix == ".png" and path.exists()
    ]

    failed = [o for o in outcomes if o.status == "failed"]
    for outcome in failed:
        tail = "\n".join("    " + line for line in _log_lines(outcome.log)[-FAILURE_LOG_LINES:])
        print(
            f"\nbench: {outcome.name} FAILED (exit status {outcome.returncode}); the end of {outcome.log}:\n{tail}",
            file=sys.stderr,
        )
    if plots:
        print(f"plots: {', '.join(path.name for path in plots)}")
    print(f"results in {folder}")
    return 1 if failed else 0


# --- summary ----------------------------------------------------------------------------------------


TABLE_HEADER = ("benchmark", "case", "variant", "baseline", "measured", "measured/baseline", "notes")


def summarize_folder(folder: Path, names: Sequence[str]) -> list:
    """The summary rows (``SummaryRow`` of benchmarks/harness/report.py) of each benchmark's CSV in ``folder``, made
    by the benchmark's own ``summary_rows``: each benchmark knows its CSV's layout."""
    read_csv = benchmark_module("harness.results").read_csv
    rows = []
    for name in names:
        rows += _summary_module(name).summary_rows(read_csv(folder / f"{name}.csv"))
    return rows


def format_table(rows: Sequence) -> str:
    lines = [TABLE_HEADER] + [(r.benchmark, r.case, r.variant, r.baseline, r.measured, r.ratio, r.notes) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def format_markdown(rows: Sequence) -> str:
    lines = [TABLE_HEADER] + [(r.benchmark, r.case, r.variant, r.baseline, r.measured, r.ratio, r.notes) for r in rows]
    markdown = ["| " + " | ".join(line) + " |" for line in lines]
    markdown.insert(1, "|" + " --- |" * len(TABLE_HEADER))
    return "\n".join(markdown)


def write_summary(folder: Path, rows: Sequence, outcomes: Sequence[Outcome], quick: bool, machine: str) -> None:
    with open(folder / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("benchmark", "case", "variant", "metric", "value"))
        for row in rows:
            for metric, value in row.values.items():
                writer.writerow((row.benchmark, row.case, row.variant, metric, value))
    runs = "\n".join(
        f"- {o.name}: {o.status} in {o.seconds:.1f} s" + (f" ({o.reason})" if o.status != "ok" else "")
        for o in outcomes
    )
    plots = "\n".join(f"![{name}]({name}.png)" for name in dict.fromkeys(r.benchmark for r in rows))
    (folder / "summary.md").write_text(
        f"# torch_ext bench{' --quick' if quick else ''}\n\nOn {machine}.\n\n"
        "Ratios below 1: torch_ext is faster. Medians; each benchmark's CSV and log are beside this file.\n\n"
        f"{format_markdown(rows)}\n\n{runs}\n\n{plots}\n"
    )


# --- plots ------------------------------------------------------------------------------------------


def write_plots(folder: Path, rows: Sequence) -> list[Path]:
    """One PNG per benchmark with rows, drawn by the benchmark's own ``plot``; none (with a message) without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("bench: matplotlib is not installed (pip install 'torch_ext[bench]'): no plots", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    written = []
    for name in dict.fromkeys(r.benchmark for r in rows):
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        _summary_module(name).plot([r for r in rows if r.benchmark == name], figure)
        path = folder / f"{name}.png"
        figure.savefig(path, dpi=110)
        written.append(path)
    return written


# --- command line -----------------------------------------------------------------------------------


def fresh_folder(path: Path) -> Path:
    """Creates ``path``, or ``path-2``, ``path-3``... if it exists (two runs in the same second)."""
    candidate = path
    for suffix in itertools.count(2):
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            candidate = path.with_name(f"{path.name}-{suffix}")
    raise AssertionError("unreachable")


def default_folder(quick: bool) -> Path:
    """``results/bench-<UTC time>-<git sha or 'nogit'>[-quick]`` under the working directory."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    sha = benchmark_module("harness.results").git_sha()
    return Path("results") / f"bench-{stamp}-{sha}{'-quick' if quick else ''}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short runs of every benchmark (CI; 166-172 s on 2 CPU cores of an idle Intel Xeon, 209-216 s of an AMD EPYC)",
    )
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        # Not listed here: naming them means importing the registry, which every torch_ext command's parser would do.
        help="run only these benchmarks, in this order (benchmarks/registry.py; an unknown name lists them)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="results folder (default: results/bench-<UTC time>-<git sha>[-quick] in the working directory)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    available = all_benchmarks()
    names = tuple(available)
    if args.only is not None:
        # Each once, in the order given.
        names = tuple(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))
        if not names:
            parser.error(f"--only {args.only!r} selects no benchmark: choose from {', '.join(available)}")
        unknown = [name for name in names if name not in available]
        if unknown:
            parser.error(f"--only {args.only!r}: unknown {', '.join(unknown)}; choose from {', '.join(available)}")
    folder = args.out if args.out is not None else fresh_folder(default_folder(args.quick))
    return run_all([available[name] for name in names], folder, args.quick)
