"""The progress display of ``python -m torch_ext bench`` (torch_ext/bench.py): a tqdm bar on a terminal, lines
otherwise."""

from __future__ import annotations

import sys

# Without a progress bar (CI logs), a line this often while a benchmark runs, so the log never stays
# silent for long.
HEARTBEAT_S = 30.0


class PlainProgress:
    """Progress as lines (stderr is not a terminal, or tqdm is not installed)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.index = 0
        self.last_heartbeat = 0.0

    def start(self, name: str) -> None:
        self.index += 1
        self.last_heartbeat = 0.0
        _progress(f"bench: [{self.index}/{self.total}] {name} ...")

    def running(self, name: str, elapsed: float, last_line: str) -> None:
        if elapsed - self.last_heartbeat >= HEARTBEAT_S:
            self.last_heartbeat = elapsed
            _progress(f"bench:   {name} running for {elapsed:.0f} s: {last_line}")

    def finish(self, name: str, status: str, seconds: float) -> None:
        _progress(f"bench: [{self.index}/{self.total}] {name} {status} in {seconds:.1f} s")

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar over the benchmarks; the running one's name, elapsed time and latest log line."""

    def __init__(self, total: int, tqdm) -> None:
        self.bar = tqdm(
            total=total,
            file=sys.stderr,
            dynamic_ncols=True,
            # No rate: benchmarks differ too much in length for one.
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}",
        )

    def start(self, name: str) -> None:
        self.bar.set_description(name)

    def running(self, name: str, elapsed: float, last_line: str) -> None:
        self.bar.set_postfix_str(f"{elapsed:.0f} s: {last_line[:60]}")

    def finish(self, name: str, status: str, seconds: float) -> None:
        self.bar.write(f"bench: {name} {status} in {seconds:.1f} s", file=sys.stderr)
        self.bar.set_postfix_str("")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def make_progress(total: int) -> PlainProgress | BarProgress:
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return BarProgress(total, tqdm)
    return PlainProgress(total)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
