"""benchmarks/harness/hosts.py: 2 ranks as 2 torchrun hosts; their results, the fallback, a failed rank."""

import os
import time

import pytest
from bench_helpers import can_make_namespaces, descendants, our_namespaces

from torch_ext import bench

# A module run by harness.hosts.run_on_two_hosts: both ranks all_reduce and hand back what they saw; with --fail-rank R,
# rank R fails after joining the process group while the other waits in the all_reduce.
RANK_SCRIPT = """
import argparse, os, socket, sys
import torch, torch.distributed as dist
from {package}.harness.hosts import leave_rank, write_rank_result
parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int)
parser.add_argument("--rank-results")
args = parser.parse_args()
dist.init_process_group("gloo")
if dist.get_rank() == args.fail_rank:
    sys.exit("failing on purpose")
value = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(value)
write_rank_result(args.rank_results, {{"rank": dist.get_rank(), "sum": value.item(), "host": socket.gethostname()}})
dist.destroy_process_group()
leave_rank()
"""


@pytest.fixture
def hosts(monkeypatch, tmp_path):
    """benchmarks/harness/hosts.py, and a module of ranks for it (importable here; the hosts find it where it was
    imported from, and the benchmarks' package through the PYTHONPATH bench gives a benchmark)."""
    (tmp_path / "ranks_for_hosts.py").write_text(RANK_SCRIPT.format(package=bench.benchmarks_package()))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", bench.benchmark_environment().get("PYTHONPATH", ""))
    return bench.benchmark_module("harness.hosts"), "ranks_for_hosts"


@pytest.mark.distributed
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root, iproute2 and util-linux")
def test_two_hosts_run_torchrun_in_their_namespaces(hosts):
    hosts_module, module = hosts
    run = hosts_module.run_on_two_hosts(module, [], timeout_s=120)
    assert run.network.mode == "two-hosts" and "veth" in run.network.label
    assert run.results == [{"rank": 0, "sum": 3.0, "host": "host0"}, {"rank": 1, "sum": 3.0, "host": "host1"}]
    assert not our_namespaces()
    assert not list(hosts_module.NETNS_ETC.glob(f"{hosts_module.NETNS_PREFIX}*_{os.getpid()}"))


@pytest.mark.distributed
def test_hosts_fall_back_to_loopback_and_say_why(hosts, monkeypatch, capfd):
    hosts_module, module = hosts
    monkeypatch.setattr(hosts_module.os, "geteuid", lambda: 1000)
    run = hosts_module.run_on_two_hosts(module, [], timeout_s=120)
    assert run.network.mode == "loopback"
    assert run.network.label.startswith("plain loopback (fallback; no two-hosts: ")
    assert "need root" in run.network.label and ", " not in run.network.label
    assert [result["sum"] for result in run.results] == [3.0, 3.0]
    assert "cannot run as two-hosts" in capfd.readouterr().err


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["two-hosts", "loopback"])
def test_a_failed_rank_is_reported_promptly_and_nothing_is_left(hosts, mode):
    hosts_module, module = hosts
    if mode == "two-hosts" and not can_make_namespaces():
        pytest.skip("needs root, iproute2 and util-linux")
    before = descendants(os.getpid())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host[01] failed \(exit status 1\)"):
        hosts_module.run_on_two_hosts(module, ["--fail-rank", "1"], mode=mode, timeout_s=120)
    assert time.monotonic() - start < 60
    assert descendants(os.getpid()) == before
    assert not our_namespaces()
