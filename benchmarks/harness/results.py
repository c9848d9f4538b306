"""What a benchmark writes: its long-format CSV (and ``read_csv`` for reading one back), the git sha and torch
version its rows carry, its table's columns and its progress lines. Imports no torch (a sweep's launcher uses it)."""

from __future__ import annotations

import csv
import functools
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from .timing import Summary

CSV_COLUMNS = ("what", "case", "size", "metric", "median", "p20", "p80", "torch_version", "git_sha")


def progress(message: str) -> None:
    """Prints a progress line: to stderr, flushed at once, so that stdout carries only results and
    whoever watches a run (a terminal, ``python -m torch_ext bench`` reading the log) sees where it is."""
    print(message, file=sys.stderr, flush=True)


def git_sha() -> str:
    """Short sha of the checkout this package lives in, or "nogit" (no git, not a checkout: installed from a wheel);
    the CSVs' git_sha column and the name of bench's results folder.

    The checkout's top level is the parent of ``benchmarks/`` (this folder's parent); installed as
    ``torch_ext/benchmarks`` in site-packages, any repository around it is not torch_ext's.
    """
    directory = os.path.dirname(os.path.realpath(__file__))
    top_level = os.path.dirname(os.path.dirname(directory))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != top_level:
            return "nogit"
        return git("rev-parse", "--short", "HEAD") or "nogit"
    except (OSError, subprocess.CalledProcessError):
        return "nogit"


@functools.cache
def torch_version() -> str:
    """The CSVs' torch_version: the installed torch's, read from its metadata (the same string as
    ``torch.__version__``), so that a sweep's launcher, which writes the CSV, never imports torch (~1.4 s here
    before its ranks could start); ``torch.__version__`` for a torch that is not installed (a source tree on the
    path)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def csv_row(what: str, case: str, size: str, metric: str, summary: Summary, sha: str) -> dict[str, object]:
    return {
        "what": what,
        "case": case,
        "size": size,
        "metric": metric,
        "median": summary.median,
        "p20": summary.p20,
        "p80": summary.p80,
        "torch_version": torch_version(),
        "git_sha": sha,
    }


def write_csv(path: str, rows: Iterable[dict[str, object]]) -> None:
    """Writes long-format rows (CSV_COLUMNS) to ``path``, creating its directory."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> dict[tuple[str, str, str], dict[str, object]]:
    """A benchmark's long-format CSV, keyed by (what, case, metric); median, p20, p80 as floats."""
    with open(path, newline="") as f:
        return rows_by_key(csv.DictReader(f))


def rows_by_key(rows: Iterable[dict]) -> dict[tuple[str, str, str], dict[str, object]]:
    """Long-format rows keyed as ``read_csv`` keys them (median, p20, p80 as floats): what a summary reads, from a
    CSV or from the rows a report has just made."""
    keyed = {}
    for row in rows:
        row = {**row, **{column: float(row[column]) for column in ("median", "p20", "p80")}}
        keyed[(row["what"], row["case"], row["metric"])] = row
    return keyed


def csv_cases(rows: dict, metric: str | None = None) -> list[str]:
    """Cases in the order the CSV has them."""
    return list(dict.fromkeys(case for _, case, row_metric in rows if metric is None or row_metric == metric))


def print_columns(lines: Sequence[Sequence[str]]) -> None:
    """Prints rows of cells (the first one the header) as left-aligned columns two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
