"""Runs a benchmark on 2 ranks as 2 hosts, each started by torchrun as users start it on real machines.

On two machines a user runs, on machine i (0 or 1), from the checkout's top level::

    torchrun --nnodes 2 --node-rank i --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        -m benchmarks.<name>

Here each "machine" is a network namespace of its own, joined to the other by a veth pair whose both ends are
shaped to LINK_RATE with HTB (a NIC that moves bytes without the CPU: docs/design.md, "Measuring overlap on
this machine"). Each namespace gets its own host name (a UTS namespace, ``hostname hostI``) and an ``/etc/hosts``
naming both hosts (``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``), so
that the torchrun line above runs unchanged: node 0 finds that it hosts the rendezvous store because the
endpoint is its own name, every rank learns rank 0's address from its host name, and gloo binds to the address
its host name resolves to, the veth's.

The launcher runs the benchmark's module on both hosts (``python -m``, from the folder it was imported from,
whatever the working directory), and passes it ``--rank-results DIR``: each rank writes its result there with
``write_rank_result``, then leaves with ``leave_rank``, and ``run_on_two_hosts`` returns the results in rank order.
When the namespaces cannot be made (not root, no iproute2 or util-linux, no veth), it says why and falls back: to
both torchruns in one namespace whose loopback is shaped, then to both on plain loopback, where gloo's copies
compete with compute for the same cores and nothing can overlap. ``Network.label`` says which ran, for a
benchmark's CSV.

Stopping: as soon as one host exits with an error, the other is stopped (SIGTERM, which torchrun passes to its
worker; SIGKILL after STOP_GRACE_S) and the error raised; on any exception (Ctrl-C, a SIGTERM turned into
KeyboardInterrupt here, a timeout) the same; every process left in the namespaces (``ip netns pids``)
is killed, and the namespaces and their ``/etc/netns`` folders deleted, in a ``finally``. Imports no torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from .results import progress

HOSTS = 2
# The modelled NIC. At 1 Gbit/s a few MiB take tens of milliseconds, comparable to a few dense layers'
# backward on one core here, and the HTB shaper (not memcpy) sets the transfer time.
LINK_RATE = "1gbit"
# Private addresses, used only inside the namespaces made here: host i is SUBNET.(i + 1).
SUBNET = "10.77.0"
# torchrun's default rendezvous port; the namespaces are fresh, so it is free there.
RDZV_PORT = 29500
NETNS_PREFIX = "torch_ext_host"
NETNS_ETC = Path("/etc/netns")
# How often the launcher checks the hosts while they run.
POLL_S = 0.2
# How often it notes the processes each host has started (its torchrun's worker), to stop them at the end.
REFRESH_S = 1.0
# How long a host gets to stop after SIGTERM (torchrun stops its worker) before it is killed.
STOP_GRACE_S = 10.0
RANK_RESULTS_OPTION = "--rank-results"

MODES = ("two-hosts", "one-namespace", "loopback")


@dataclass(frozen=True)
class Network:
    """What the ranks ran on: ``mode`` (one of MODES) and a label for a CSV (no ", " in it), which names the
    fallback and why when the mode is not the one asked for."""

    mode: str
    label: str


@dataclass(frozen=True)
class HostsRun:
    network: Network
    # Each rank's result, as it passed it to write_rank_result, in rank order.
    results: list


def write_rank_result(directory: str, result: object) -> None:
    """In the benchmark, on every rank: hands ``result`` (JSON-serializable) to the launcher. ``directory`` is the
    value of ``--rank-results``; the rank is torchrun's ``RANK``."""
    path = Path(directory) / f"rank{os.environ['RANK']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    # A result is there whole or not at all.
    partial.replace(path)


def leave_rank() -> NoReturn:
    """In the benchmark, on every rank, after ``write_rank_result`` (and ``destroy_process_group``): exits with
    status 0 at once, without the interpreter's and C++'s exit-time teardown. Ranks that had done all their
    work died there ("terminate called without an active exception", some library's thread still joinable at
    exit): in a CI run of overlap, and in 2 of 4 runs of tests/benchmarks/test_bench_hosts.py's all_reduce ranks
    without it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_two_hosts(
    module: str, args: Sequence[str], *, mode: str = "two-hosts", timeout_s: float | None = None
) -> HostsRun:
    """Runs ``python -m module *args --rank-results DIR`` on 2 ranks, each started by torchrun on its own host.

    ``mode`` is the network wanted (MODES, in order of preference); what cannot be made falls back to the
    next, said on stderr. Raises RuntimeError when a host fails (within about a second of its exit, the other
    stopped) or when a rank exits without a result, TimeoutError after ``timeout_s``.

    While it runs (from the main thread), SIGTERM (bench stopped, a CI job cancelled) raises KeyboardInterrupt
    as Ctrl-C does, and so does SIGINT even where the caller was started with it ignored (a shell's background
    job; bench stops a benchmark with SIGINT): either way the hosts are stopped and the namespaces deleted.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_keyboard_interrupt),
            signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        }
    try:
        return _run_on_two_hosts(module, args, mode, timeout_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_on_two_hosts(module: str, args: Sequence[str], mode: str, timeout_s: float | None) -> HostsRun:
    with tempfile.TemporaryDirectory(prefix="torch_ext_ranks_") as results:
        command = ["-m", module, *args, RANK_RESULTS_OPTION, results]
        with _network(mode) as (network, hosts):
            progress(f"hosts: 2 ranks on {network.label}")
            _run_hosts(hosts, command, _environment(module), timeout_s)
        paths = [Path(results) / f"rank{rank}.json" for rank in range(HOSTS)]
        missing = [rank for rank, path in enumerate(paths) if not path.is_file()]
        if missing:
            raise RuntimeError(f"ranks {missing} exited without writing a result")
        return HostsRun(network, [json.loads(path.read_text()) for path in paths])


def _environment(module: str) -> dict[str, str]:
    """The hosts' environment: this process's, with the folder ``module``'s top-level package was imported from
    (a checkout's top level) first on PYTHONPATH, so that every rank imports the same benchmark as the launcher,
    whatever the working directory. Not a site-packages folder (installed from a wheel): every Python finds that
    already, and first on PYTHONPATH it would come before the standard library."""
    top = importlib.util.find_spec(module.partition(".")[0])
    if top is None or top.origin is None:
        raise ValueError(f"{module!r} cannot be imported here")
    folder = Path(top.origin).resolve().parent
    if top.submodule_search_locations is not None:  # a package: its folder's parent
        folder = folder.parent
    if folder in {Path(path).resolve() for path in [*site.getsitepackages(), site.getusersitepackages()]}:
        return dict(os.environ)
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


# --- the hosts ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Host:
    # Runs the torchrun command line given to it (a namespace's ip netns exec + hostname, or nothing).
    prefix: tuple[str, ...]
    rdzv_endpoint: str
    # The namespace it runs in, whose processes are killed at the end (None: plain loopback).
    netns: str | None

    def command(self, node_rank: int, benchmark_command: Sequence[str]) -> list[str]:
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(HOSTS), "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint,
            *benchmark_command,
        ]  # fmt: skip
        return [*self.prefix, *torchrun]


class _Setup:
    """Namespaces and /etc/netns folders made so far, undone in reverse by ``close``."""

    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.etc_dirs: list[Path] = []

    def add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        for name in self.namespaces:
            _kill_netns_processes(name)
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        for directory in self.etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self.namespaces.clear()
        self.etc_dirs.clear()


class _network:
    """Context manager: (Network, [_Host, _Host]) for ``mode`` or the first fallback that can be made."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.setup = _Setup()

    def __enter__(self) -> tuple[Network, list[_Host]]:
        why_not = []
        for mode in MODES[MODES.index(self.mode) :]:
            try:
                hosts, label = _MAKERS[mode](self.setup)
            except _Unavailable as error:
                self.setup.close()
                why_not.append(f"no {mode}: {error}")
                progress(f"hosts: cannot run as {mode} ({error}); falling back")
                continue
            except BaseException:
                self.setup.close()
                raise
            if why_not:
                label += f" (fallback; {'; '.join(why_not)})"
            return Network(mode, label.replace(", ", "; ")), hosts
        raise AssertionError("unreachable: loopback always works")

    def __exit__(self, *exc_info) -> None:
        self.setup.close()


class _Unavailable(Exception):
    """A network mode cannot be made here; the message says why."""


def _check_tools(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise _Unavailable(f"{', '.join(missing)} not installed")
    if os.geteuid() != 0:
        raise _Unavailable("network namespaces need root")


def _run(*command: str) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise _Unavailable(f"{shlex.join(command)} failed: {error.stderr.strip()}") from None


def _shape(netns: str, device: str) -> None:
    _run("tc", "-n", netns, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "10")
    _run(
        "tc", "-n", netns, "class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb",
        "rate", LINK_RATE, "ceil", LINK_RATE,
    )  # fmt: skip


def _make_two_hosts(setup: _Setup) -> tuple[list[_Host], str]:
    _check_tools("ip", "tc", "unshare", "hostname")
    names = [f"{NETNS_PREFIX}{i}_{os.getpid()}" for i in range(HOSTS)]
    addresses = [f"{SUBNET}.{i + 1}" for i in range(HOSTS)]
    # Interface names are at most 15 characters.
    devices = [f"te{os.getpid() % 10**7}h{i}" for i in range(HOSTS)]
    for name in names:
        setup.add_netns(name)
    _run("ip", "link", "add", devices[0], "netns", names[0], "type", "veth", "peer", devices[1], "netns", names[1])
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{address} host{i}\n" for i, address in enumerate(addresses))
    hosts = []
    for i, (name, address, device) in enumerate(zip(names, addresses, devices, strict=True)):
        _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "-n", name, "link", "set", device, "up")
        _shape(name, device)
        etc = NETNS_ETC / name
        setup.etc_dirs.append(etc)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)
        # A UTS namespace of its own, for its host name; sh execs torchrun, so the pid is torchrun's.
        prefix = ("ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", f'hostname host{i} && exec "$@"', "sh")
        hosts.append(_Host(prefix, f"host0:{RDZV_PORT}", name))
    return hosts, f"2 hosts over a veth shaped to {LINK_RATE}"


def _make_one_namespace(setup: _Setup) -> tuple[list[_Host], str]:
    _check_tools("ip", "tc")
    name = f"{NETNS_PREFIX}s_{os.getpid()}"
    setup.add_netns(name)
    _shape(name, "lo")
    host = _Host(("ip", "netns", "exec", name), f"127.0.0.1:{RDZV_PORT}", name)
    return [host, host], f"1 namespace with loopback shaped to {LINK_RATE}"


def _make_loopback(setup: _Setup) -> tuple[list[_Host], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host = _Host((), f"127.0.0.1:{port}", None)
    return [host, host], "plain loopback"


_MAKERS = {"two-hosts": _make_two_hosts, "one-namespace": _make_one_namespace, "loopback": _make_loopback}


# --- running and stopping ------------------------------------------------------------------------------------


def _run_hosts(
    hosts: Sequence[_Host], benchmark_command: Sequence[str], environment: dict[str, str], timeout_s: float | None
) -> None:
    processes = []
    try:
        for node_rank, host in enumerate(hosts):
            processes.append(_start(host.command(node_rank, benchmark_command), environment, f"host{node_rank}"))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_refresh = 0.0
        while True:
            if time.monotonic() - last_refresh >= REFRESH_S:
                last_refresh = time.monotonic()
                for _, descendants in processes:
                    descendants.refresh()
            codes = [process.poll() for process, _ in processes]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"host{failed[0]} failed (exit status {codes[failed[0]]}); its output is above, prefixed "
                    f"host{failed[0]}:"
                )
            if all(code == 0 for code in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the hosts did not finish in {timeout_s:g} s")
            time.sleep(POLL_S)
    finally:
        _stop(processes)


def _start(command: list[str], environment: dict[str, str], name: str) -> tuple[subprocess.Popen, _Descendants]:
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=environment
    )
    threading.Thread(target=_prefix_lines, args=(process.stdout, f"{name}: "), daemon=True).start()
    return process, _Descendants(process.pid)


def _prefix_lines(stream, prefix: str) -> None:
    # The worker's output too (it inherits the pipe): stderr, as progress lines; the caller prints results.
    for line in stream:
        print(prefix + line, end="", file=sys.stderr, flush=True)


def _stop(processes: Sequence[tuple[subprocess.Popen, _Descendants]]) -> None:
    """SIGTERM to every host still running, then SIGKILL to it and to every process it started (torchrun
    starts its worker in a session of its own, so no process group holds both)."""
    for process, descendants in processes:
        descendants.refresh()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process, _ in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for _, descendants in processes:
        descendants.kill()


class _Descendants:
    """The processes below ``pid``, remembered with their start times while they can still be found through
    their parents (a worker outlives a killed torchrun as init's child), so that they can be killed later
    without mistaking a reused pid for one of them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.known: dict[int, str] = {}

    def refresh(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None:
                    children.setdefault(int(stat[1]), []).append(int(entry))
        pending = [self.pid]
        while pending:
            for child in children.get(pending.pop(), []):
                stat = _stat(child)
                if stat is not None:
                    self.known[child] = stat[19]
                    pending.append(child)

    def kill(self) -> None:
        for pid, start in self.known.items():
            stat = _stat(pid)
            if stat is not None and stat[19] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name: [state, ppid, ...]; index 19 is the start time."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def _kill_netns_processes(name: str) -> None:
    listed = subprocess.run(["ip", "netns", "pids", name], check=False, capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
