"""torch_ext.verify on two gloo ranks: an expert-parallel MoE layer and TorchRec's DLRM, each rank its own step.

The models are the ones test_moe.py and test_torchrec.py train (imported, not copied). Every rank
verifies its step; the ranks agree on the verdict; the collectives each engine ran in backward are
reported with their launch and wait; the snapshot is restored after the call, TorchRec's sharded
tables included. A step that differs on one rank only makes every rank report the difference, and
``python -m torch_ext verify`` under torchrun exits nonzero for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from _harness import run_ranks
from test_moe import DIM, TOKENS, ExpertParallelMoE
from test_torchrec import HAS_TORCHREC, NEEDS_TORCHREC, _batch, _dlrm, _local_tables

import torch_ext
from torch_ext.testing import identity_difference

pytestmark = pytest.mark.distributed

STEPS = 2
LEARNING_RATE = 0.1


def _moe_step(rank: int, differ_on_rank: int | None = None):
    torch.manual_seed(rank)
    model = ExpertParallelMoE()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    generator = torch.Generator().manual_seed(100 * rank)
    tokens = torch.randn(TOKENS[rank], DIM, generator=generator)
    target = torch.randn(TOKENS[rank], 1, generator=generator)

    def step():
        optimizer.zero_grad()
        output, _ = model(tokens)
        loss = F.mse_loss(output, target)
        if rank == differ_on_rank and torch_ext.is_enabled():
            loss = loss * 1.0001
        loss.backward()
        optimizer.step()
        return loss

    return step, model, optimizer


def _dlrm_step(rank: int):
    model = _dlrm(rank)
    dense = [p for name, p in model.named_parameters() if "embedding_bags" not in name]
    optimizer = torch.optim.SGD(dense, lr=LEARNING_RATE)
    dense_features, sparse_features, labels = _batch(rank, 0)

    def step():
        optimizer.zero_grad()
        logits = model(dense_features, sparse_features).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        optimizer.step()
        return loss

    return step, model, optimizer


def _report(report, step_state: dict | None = None) -> dict:
    """The report as plain data (the harness sends results back with torch.save)."""
    return {
        "identical": report.identical,
        "ranks_identical": report.ranks_identical,
        "all_ranks_identical": report.all_ranks_identical,
        "compared": report.compared,
        "first_difference": None if report.first_difference is None else dataclass_fields(report.first_difference),
        "collectives": {
            engine: [[(c.node, c.role, len(c.waits)) for c in run.collectives] for run in runs]
            for engine, runs in report.backward.items()
        },
        "orders_equal": [s.order == t.order for s, t in zip(report.backward["stock"], report.backward["torch_ext"])],
        "overlap": {engine: report.overlap(engine) for engine in ("stock", "torch_ext")},
        "summary": report.summary(),
        **(step_state or {}),
    }


def dataclass_fields(difference) -> dict:
    return {"what": difference.what, "name": difference.name, "produced_by": list(difference.produced_by)}


def _verify_everything(rank: int) -> dict:
    results = {}
    step, model, optimizer = _moe_step(rank)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    report = torch_ext.verify(step, steps=STEPS, models=[model], optimizers=[optimizer])
    restored = identity_difference(dict(model.state_dict()), before) is None
    results["moe"] = _report(report, {"restored": restored, "parameters": len(list(model.parameters()))})

    step, model, optimizer = _moe_step(rank, differ_on_rank=1)
    results["moe_rank1_differs"] = _report(torch_ext.verify(step, models=[model], optimizers=[optimizer]))

    if HAS_TORCHREC:
        step, model, optimizer = _dlrm_step(rank)
        tables_before = _local_tables(model)
        report = torch_ext.verify(step, steps=STEPS, models=[model], optimizers=[optimizer])
        tables_after = _local_tables(model)
        step()  # the tables do change in a step: their restore is not vacuous
        changed_by_step = _local_tables(model)
        results["dlrm"] = _report(
            report,
            {
                "tables_restored": identity_difference(tables_after, tables_before) is None,
                "tables_change_in_a_step": any(
                    not torch.equal(a, b)
                    for name in tables_before
                    for a, b in zip(tables_before[name], changed_by_step[name])
                ),
                "table_shards_compared": sum(len(shards) for shards in tables_before.values()),
            },
        )
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(_verify_everything, tmp_path_factory.mktemp("verify"))


def test_moe_is_identical_with_its_all_to_alls_reported(rank_results):
    for rank, result in enumerate(rank_results):
        moe = result["moe"]
        assert moe["identical"] and moe["ranks_identical"] == [True, True], moe["summary"]
        assert moe["restored"]
        # Per step: each parameter's gradient, value and momentum buffer, and the loss.
        assert moe["compared"] == STEPS * (3 * moe["parameters"] + 1), moe["summary"]
        for engine in ("stock", "torch_ext"):
            calls = moe["collectives"][engine]
            assert len(calls) == STEPS and all(len(call) == 2 for call in calls), (engine, calls)
            assert all("all_to_all_single" in node for call in calls for node, _, _ in call)
        # Stock waits inside each all_to_all's node; torch_ext defers each wait to the result's first reader.
        assert all(waits == 0 for call in moe["collectives"]["stock"] for _, _, waits in call)
        assert all(waits == 1 for call in moe["collectives"]["torch_ext"] for _, _, waits in call)
        assert moe["overlap"]["stock"] == 0.0
        assert moe["overlap"]["torch_ext"] is not None
        assert "collective, torch_ext:" in moe["summary"] and "waited on in" in moe["summary"]
        # torch_ext reordered backward (the automatic collective priority), and the bits are stock's all the same.
        assert not any(moe["orders_equal"]), f"rank {rank}: torch_ext ran stock's order: nothing tested"


def test_a_difference_on_one_rank_is_reported_by_every_rank(rank_results):
    for rank, result in enumerate(rank_results):
        report = result["moe_rank1_differs"]
        assert report["ranks_identical"] == [True, False], report["summary"]
        assert not report["all_ranks_identical"]
        assert report["identical"] == (rank == 0)
        assert "different on rank(s) [1]" in report["summary"]
    first = rank_results[1]["moe_rank1_differs"]["first_difference"]
    # The head is nearest the loss: stock accumulates its gradients first.
    assert first["what"] == "gradient" and first["name"].startswith("head."), first
    assert first["produced_by"], first


@NEEDS_TORCHREC
def test_dlrm_is_identical_and_its_tables_are_restored(rank_results):
    for rank, result in enumerate(rank_results):
        dlrm = result["dlrm"]
        assert dlrm["identical"] and dlrm["all_ranks_identical"], dlrm["summary"]
        assert dlrm["tables_restored"] and dlrm["tables_change_in_a_step"], f"rank {rank}"
        assert dlrm["table_shards_compared"] >= 1
        assert "local shard" not in dlrm["summary"]
        for engine in ("stock", "torch_ext"):
            for call in dlrm["collectives"][engine]:
                # TorchRec's pooled all_to_all: the Wait's node launches, the Req's waits.
                assert [(node.split(" #")[0], role, waits) for node, role, waits in call] == [
                    ("All2All_Pooled_WaitBackward", "launch", 1)
                ], (engine, call)
        assert not any(dlrm["orders_equal"]), f"rank {rank}: torch_ext ran stock's order: nothing tested"


TORCHRUN_MODULE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_ext
import torch_ext.ops as xops


def build():
    rank = dist.get_rank()
    torch.manual_seed(rank)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)
    if rank == 1:
        # Only this rank's gradient of second.weight differs: it feeds no collective.
        second.weight.register_hook(lambda grad: grad * 1.0001 if torch_ext.is_enabled() else grad)

    def step():
        optimizer.zero_grad()
        loss = F.mse_loss(second(xops.all_reduce(first(inputs))), targets)
        loss.backward()
        optimizer.step()
        return loss

    return step, {"first": first, "second": second}, [optimizer]
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_command_under_torchrun_exits_nonzero_when_one_rank_differs(tmp_path):
    (tmp_path / "two_ranks.py").write_text(textwrap.dedent(TORCHRUN_MODULE))
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "torch_ext", "verify", "--factory"]
    command.append(f"{tmp_path / 'two_ranks.py'}:build")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.pathsep.join(sys.path)}
    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert finished.returncode != 0, finished.stdout + finished.stderr
    out = finished.stdout
    # Rank 0 prints every rank's report, once.
    assert out.count("rank 0: torch_ext.verify: IDENTICAL") == 1, out + finished.stderr
    assert out.count("rank 1: torch_ext.verify: DIFFERENT") == 1, out
    assert "first: step 0, backward call 0: gradient of second.weight" in out
    assert out.count("ranks: 2, different on rank(s) [1]") == 2
    assert "collective, torch_ext: GeneratedBackwardFor_torch_ext_all_reduce" in out
