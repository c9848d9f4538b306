"""Proves the stream tests can fail: plants each stream bug in a copy of the checkout, in turn, and runs the stream
tests on the test accelerator (tests/testdev) against it. Each bug must fail at least one test; the copy without a
bug must pass them all.

    python tools/planted_stream_bugs.py [--dir DIR] [pytest args, default: tests/test_accelerator_streams.py]

The copy (default /tmp/torch_ext-planted) keeps its build between runs, so each bug rebuilds one translation unit;
the test device's build is kept in DIR/testdev-build. Prints, per bug, the tests that failed and how; exits 1 if a
bug went unnoticed or the copy without a bug failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    path: str
    correct: str
    planted: str


BUGS = (
    Bug(
        "the lane's side stream does not wait for the node's stream",
        "csrc/engine/run/call_lanes.cpp",
        "  lane_stream.wait(inputs_ready);\n",
        "",
    ),
    Bug(
        "the overlap's backward thread does not take the caller's stream",
        "torch_ext/microbatch_overlap.py",
        "                torch.accelerator.set_stream(stream)\n",
        "                pass\n",
    ),
    Bug(
        "the caller's stream does not wait for the leaf streams",
        "csrc/engine/run/run_loop.cpp",
        "  sync_leaf_streams_with_caller();\n",
        "",
    ),
    Bug(
        "a lane's input is not recorded on the side stream",
        "csrc/engine/run/call_lanes.cpp",
        "      guard.recordDataPtrOnStream(input.storage().data_ptr(), lane_stream);\n",
        "",
    ),
)


def copy_checkout(directory: Path) -> None:
    """The checkout's files (tracked and new, not ignored) into ``directory``, times kept so ninja rebuilds only
    what changed; csrc/ replaced whole (setup.py globs it)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    shutil.rmtree(directory / "csrc", ignore_errors=True)
    for name in filter(None, files):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = directory / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def build(directory: Path) -> None:
    subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=directory,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", "2")},
    )


def run_tests(directory: Path, pytest_args: list[str]) -> tuple[int, list[str]]:
    """pytest's exit code and its summary lines of failed tests."""
    env = {
        **os.environ,
        "PYTHONPATH": str(directory),  # ahead of an editable install of the checkout
        "TESTDEV_BUILD_DIR": str(directory / "testdev-build"),
        "COLUMNS": "300",  # room for each failure's message in pytest's summary lines
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *pytest_args],
        check=False,
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
    )
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return done.returncode, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/torch_ext-planted"))
    args, pytest_args = parser.parse_known_args()
    pytest_args = pytest_args or ["tests/test_accelerator_streams.py"]
    directory = args.dir
    directory.mkdir(parents=True, exist_ok=True)
    copy_checkout(directory)
    originals = {bug.path: (directory / bug.path).read_text() for bug in BUGS}
    for bug in BUGS:
        if originals[bug.path].count(bug.correct) != 1:
            print(f"cannot plant {bug.name!r}: {bug.path} no longer has exactly one {bug.correct.strip()!r}")
            return 1

    problems = 0
    for bug in (None, *BUGS):
        for path, text in originals.items():
            (directory / path).write_text(text)
        if bug is not None:
            (directory / bug.path).write_text(originals[bug.path].replace(bug.correct, bug.planted))
        build(directory)
        code, failed = run_tests(directory, pytest_args)
        name = bug.name if bug is not None else "no bug"
        caught = code != 0
        print(f"{name}: {'failed' if caught else 'passed'} ({len(failed)} failed)")
        for line in failed:
            print("    " + re.sub(r"\s+", " ", line)[:300])
        if caught != (bug is not None):
            problems += 1
            print("    UNEXPECTED")
    # Leave the copy without a bug.
    for path, text in originals.items():
        (directory / path).write_text(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
