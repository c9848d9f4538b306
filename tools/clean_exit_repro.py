"""How often does a rank's exit abort with "terminate called without an active exception"? (issue #21)

    python tools/clean_exit_repro.py CASE [--runs N] [--pin] [--preimport] [--leave]

Each run starts 2 gloo ranks (``sys.executable``, a store held here). The ranks do CASE and then exit
normally, or through ``leave_rank`` of benchmarks/harness/hosts.py (os._exit) with --leave. The script counts the
rank exits that abort (SIGABRT, or the message on stderr). Cases:

  stock-no-destroy       all_reduce of a tensor Python keeps, then exit without destroy_process_group
  stock-destroy          the same, then destroy_process_group (the group is freed and gloo's workers joined)
  pinned-group-destroy   torch.distributed.nn imported after init_process_group (torch._dynamo, FSDP and a
                         functional collective's first call all import it): its defaults hold group.WORLD,
                         so destroy_process_group no longer frees the group
  torch-ext-ops-destroy  torch_ext.ops.all_to_all_single in torch_ext.backward (3 steps), then destroy
  torch-ext-lane-destroy a synchronous all_to_all Function declared with torch_ext.run_in_lane (5 steps),
                         then destroy

--pin puts each rank on a core of its own (taskset), as on a loaded machine. The gloo worker that wakes a
rank's main thread then shares its core with it, so it often drops the finished work late, next to the exit.
--preimport imports torch._dynamo before init_process_group, so torch.distributed.nn's defaults bind None.

The cause (tests/distributed/test_clean_exit.py has the deterministic reproducer and the backtrace): a gloo
worker thread drops the last reference to a finished work. A tensor of that work that Python holds goes from
2 C++ references to 1, and that step decrefs its PyObject under the GIL (PyTorch 2.10 and later). Once the
interpreter is finalizing, CPython 3.13 and older end that thread with pthread_exit. The forced unwind meets
noexcept destructors, and std::terminate is called.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

WORLD_SIZE = 2
TIMEOUT_S = 120
ABORT = "terminate called without an active exception"
CASES = ("stock-no-destroy", "stock-destroy", "pinned-group-destroy", "torch-ext-ops-destroy", "torch-ext-lane-destroy")
CHECKOUT = Path(__file__).resolve().parent.parent


def _rank(case: str, rank: int, port: int, preimport: bool, leave: bool) -> None:
    sys.path.insert(0, str(CHECKOUT))
    import torch
    import torch.distributed as dist

    from benchmarks.harness.hosts import leave_rank

    if preimport:
        import torch._dynamo
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
    if case.startswith("stock") or case == "pinned-group-destroy":
        if case == "pinned-group-destroy":
            import torch.distributed.nn
        tensor = torch.ones(1000)  # kept: the worker's release decrefs its PyObject
        dist.all_reduce(tensor)
    elif case == "torch-ext-ops-destroy":
        import torch_ext
        import torch_ext.ops

        x, w = torch.randn(64, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        for _ in range(3):
            torch_ext.backward(torch_ext.ops.all_to_all_single(x * 1.0).sum() + torch.tanh(x @ w).sum())
    else:
        import torch_ext
        from torch_ext.testing import SyncAllToAll

        torch_ext.run_in_lane(SyncAllToAll)
        x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
        for _ in range(5):
            dense = x
            for _ in range(8):
                dense = torch.tanh(dense @ w)
            with torch_ext.enable():
                (SyncAllToAll.apply(x @ w).sum() + dense.sum()).backward()
    if case != "stock-no-destroy":
        dist.destroy_process_group()
    if leave:
        leave_rank()


def _run(case: str, pin: bool, preimport: bool, leave: bool) -> list[tuple[int, str]]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    flags = [flag for flag, on in (("--preimport", preimport), ("--leave", leave)) if on]
    ranks = []
    for rank in range(WORLD_SIZE):
        taskset = ["taskset", "-c", str(rank % os.cpu_count())] if pin else []
        command = [*taskset, sys.executable, __file__, case, "--rank", str(rank), "--port", str(store.port), *flags]
        ranks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    exits = []
    try:
        for process in ranks:
            output, _ = process.communicate(timeout=TIMEOUT_S)
            exits.append((process.returncode, output))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return exits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--pin", action="store_true", help="each rank on a core of its own")
    parser.add_argument("--preimport", action="store_true", help="import torch._dynamo before init_process_group")
    parser.add_argument(
        "--leave", action="store_true", help="ranks leave with benchmarks.harness.hosts.leave_rank (os._exit)"
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.case, args.rank, args.port, args.preimport, args.leave)
        return 0
    aborts = failures = 0
    start = time.monotonic()
    for run in range(args.runs):
        for rank, (code, output) in enumerate(_run(args.case, args.pin, args.preimport, args.leave)):
            if ABORT in output or code in (-6, 134):
                aborts += 1
                print(f"run {run} rank {rank}: exit {code}: {ABORT}", flush=True)
            elif code != 0:
                failures += 1
                print(f"run {run} rank {rank}: exit {code}\n{output[-2000:]}", flush=True)
    print(
        f"{args.case}{' --pin' if args.pin else ''}{' --preimport' if args.preimport else ''}"
        f"{' --leave' if args.leave else ''}: {args.runs} runs, {WORLD_SIZE * args.runs} rank exits, "
        f"{aborts} aborted, {failures} failed otherwise ({time.monotonic() - start:.0f} s)"
    )
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
