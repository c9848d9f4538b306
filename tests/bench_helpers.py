"""What the tests of ``python -m torch_ext bench`` (tests/test_bench.py) and of the benchmarks (tests/benchmarks/)
share: a benchmark's CSV as the benchmarks write it, a benchmark's command line, and the processes a run leaves."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torch_ext import bench

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def benchmark_command(module: str) -> list[str]:
    """The command line that runs the benchmarks' ``module`` (``"overlap"``), as bench runs it; run it with
    ``bench.benchmark_environment()``."""
    return [sys.executable, "-m", f"{bench.benchmarks_package()}.{module}"]


def run_benchmark(command: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Runs ``command`` (a benchmark's, or torchrun's around one) in the environment bench gives a benchmark, its
    output captured."""
    return subprocess.run(
        command, env=bench.benchmark_environment(), check=False, capture_output=True, text=True, timeout=timeout_s
    )


def write_rows(path: Path, rows: list[tuple]) -> None:
    """A benchmark's CSV, as benchmarks/harness/results.py writes it."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("what", "case", "size", "metric", "median", "p20", "p80", "torch_version", "git_sha"))
        writer.writerows(row + ("2.13.0", "abc") for row in rows)


def overlap_sweep_rows(link: str) -> list[tuple]:
    """benchmarks/overlap's CSV of a three-point sweep (x0.5: 20 dense layers, x1: 40, x2: 80), T_comm 40 ms."""
    rows = [
        ("comm", "overlap", f"256d x 4096 rows, {link}", "t_comm_ms", 40, 36, 42),
        ("machine", "overlap", link, "runnable_tasks", 3, 2, 4),
    ]
    for ratio, layers, compute, ext_efficiency in ((0.5, 20, 50, 0.4), (1, 40, 80, 0.7), (2, 80, 110, 0.9)):
        size = f"256d x 4096 rows, {layers} dense layers, {link}"
        case = f"overlap x{ratio:g}"
        for variant, efficiency in (("stock", 0.1), ("torch_ext", ext_efficiency)):
            exposed = (1 - efficiency) * 40
            rows.append((variant, case, size, "backward_ms", compute + exposed, 0, 0))
            rows.append((variant, case, size, "exposed_ms", exposed, 0, 0))
            rows.append((variant, case, size, "efficiency", efficiency, 0, 0))
        rows.append(("compute", case, size, "backward_ms", compute, 0, 0))
        rows.append(("comm", case, size, "backward_ms", 40, 36, 42))
    return rows


def our_namespaces() -> list[str]:
    """This process's hosts' namespaces (named with its pid): a benchmark running beside the tests has its own."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith("torch_ext_host")]
    return [name for name in names if name.endswith(f"_{os.getpid()}")]


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc", "unshare", "hostname"))


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if alive(child):
                found.add(child)
            pending.append(child)
    return found


def terminate_when(process: subprocess.Popen, ready, timeout_s: float) -> None:
    """SIGTERM to ``process`` once ``ready()`` (it must not exit before), and waits for it to end."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.1)
        process.terminate()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state
