"""torch_ext's collective ops on two gloo ranks: values, deferred waits, automatic priority, opcheck, compile.

The checks are grouped by concern, one pair of spawned ranks per group (spawning, ~7 s, dominates a
distributed test's time): the ops' values and errors, scheduling, failures during backward, and
torch.compile. A failure or hang in one group fails only the tests of that group. Each rank returns
plain data and the tests below assert on it. Reference values come from stock
PyTorch: c10d for forward, PyTorch's functional collectives (``*_autograd``) on the stock engine
for backward, which torch_ext's formulas must match bit for bit on either engine.

Whether a collective is still in flight is read from c10d's work registry: the functional
collectives register each launched work there until ``wait_tensor`` takes it out.
"""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _harness import WORLD_SIZE, run_ranks

import torch_ext
import torch_ext.ops as xops
from torch_ext import _C
from torch_ext.testing import assert_identical

pytestmark = pytest.mark.distributed

in_flight = torch._C._distributed_c10d._get_work_registry_size


def _splits(rank: int) -> tuple[list[int], list[int]]:
    """Uneven all_to_all splits: rank r sends 1 + r + 2i rows to rank i (and so receives 1 + i + 2r from i)."""
    sent = [1 + rank + 2 * peer for peer in range(WORLD_SIZE)]
    received = [1 + peer + 2 * rank for peer in range(WORLD_SIZE)]
    return received, sent


def _leaf(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(*shape, generator=generator).requires_grad_()


def _backward(loss: torch.Tensor, engine: str, **kwargs) -> None:
    if engine == "stock":
        loss.backward(**kwargs)
    else:
        torch_ext.backward(loss, **kwargs)


def _values(rank: int) -> dict:
    """Forward and input gradient of each op on both engines, and stock references."""
    received, sent = _splits(rank)
    world = dist.group.WORLD
    name = world.group_name
    cases = {
        "all_to_all_single": (
            lambda x: xops.all_to_all_single(x, received, sent),
            lambda x: funcol.all_to_all_single_autograd(x, received, sent, world),
            (sum(sent), 3),
        ),
        "all_reduce": (
            lambda x: xops.all_reduce(x),
            lambda x: funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name)),
            (4, 3),
        ),
        "reduce_scatter_tensor": (
            lambda x: xops.reduce_scatter_tensor(x),
            lambda x: funcol.reduce_scatter_single_autograd(x, "sum", 0, world),
            (4, 3),
        ),
        "all_gather_into_tensor": (
            lambda x: xops.all_gather_into_tensor(x),
            lambda x: funcol.all_gather_single_autograd(x, 0, world),
            (2, 3),
        ),
    }
    results = {}
    for op_name, (ours, reference, shape) in cases.items():
        per_engine = {}
        # Backward seeds with a rank-dependent gradient so the gradient collective moves real data.
        for engine in ("stock", "torch_ext", "reference"):
            x = _leaf(rank, *shape)
            y = (reference if engine == "reference" else ours)(x)
            if isinstance(y, funcol.AsyncCollectiveTensor):
                y = y.wait()
            weights = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) * (rank + 1)
            _backward((y * weights).sum(), "stock" if engine == "reference" else engine)
            per_engine[engine] = {"forward": y.detach(), "grad": x.grad}
        results[op_name] = per_engine
    x = _leaf(rank, sum(sent), 3)
    c10d_out = torch.empty(sum(received), 3)
    dist.all_to_all_single(c10d_out, x.detach(), received, sent)
    results["all_to_all_single"]["c10d"] = {"forward": c10d_out}
    return results


def _coalesced(rank: int) -> dict:
    """all_reduce_coalesced: values against one functional all_reduce per tensor, and its backward
    bucket in flight while later nodes run."""
    name = dist.group.WORLD.group_name
    shapes = [(3, 2), (5,), (2, 2, 2)]
    results = {}
    for engine in ("stock", "torch_ext", "reference"):
        leaves = [_leaf(rank, *shape, salt=i) for i, shape in enumerate(shapes)]
        if engine == "reference":
            outs = [funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(t, "sum", name)) for t in leaves]
        else:
            outs = xops.all_reduce_coalesced(leaves)
        loss = sum((out * (i + 1) * (rank + 1)).sum() for i, out in enumerate(outs))
        _backward(loss, "stock" if engine == "reference" else engine)
        results[engine] = {"forward": [out.detach() for out in outs], "grads": [leaf.grad for leaf in leaves]}

    leaves = [_leaf(rank, *shape, salt=i) for i, shape in enumerate(shapes)]
    outs = xops.all_reduce_coalesced([leaf * 1.0 for leaf in leaves])
    dense = _leaf(rank, 4, 3, salt=7)
    for _ in range(2):
        dense = dense.tanh()
    log = []
    dense.grad_fn.register_prehook(lambda grads: log.append(("dense_top", in_flight())))
    torch_ext.backward(sum(out.sum() for out in outs) + dense.sum())
    results["dense_top_in_flight"] = dict(log)["dense_top"]
    results["in_flight_after"] = in_flight()
    return results


def _sparse_dense_loss(rank: int, collective) -> tuple[torch.Tensor, torch.Tensor, list, dict]:
    """A recommendation-style graph: lookup -> collective -> one sparse layer; a dense chain created later.

    Stock runs the dense chain first (higher sequence numbers); returns the loss, the sparse leaf, the
    nodes to watch (name -> node) and a log the pre-hooks append (node name, works in flight) to.
    """
    received, sent = _splits(rank)
    table = _leaf(rank, sum(sent), 3, salt=1)
    exchanged = collective(table * 1.0, received, sent)
    sparse = exchanged * 2.0
    dense = _leaf(rank, 4, 3, salt=2)
    weight = _leaf(rank, 3, 3, salt=3)
    for _ in range(3):
        dense = (dense @ weight).tanh()
    loss = sparse.sum() + dense.sum()
    log: list = []
    collective_node = exchanged.grad_fn
    # PyTorch's functional collectives hand their result out through _c10d_functional::_wrap_tensor_autograd,
    # an identity node between the collective's node and its readers.
    if "_wrap_tensor_autograd" in collective_node.name():
        collective_node = collective_node.next_functions[0][0]
    watched = {
        "sparse": sparse.grad_fn,
        "collective": collective_node,
        "dense_top": dense.grad_fn,
        "dense_bottom": dense.grad_fn.next_functions[0][0].next_functions[0][0],
        # The node that reads the collective's result: the `table * 1.0` MulBackward.
        "consumer": collective_node.next_functions[0][0],
    }
    for label, node in watched.items():
        node.register_prehook(lambda grads, label=label: log.append((label, in_flight())))
    return loss, table, log, watched


def _ours(x, received, sent):
    return xops.all_to_all_single(x, received, sent)


def _functional(x, received, sent):
    return funcol.all_to_all_single_autograd(x, received, sent, dist.group.WORLD)


def _scheduling(rank: int) -> dict:
    """Node order and works in flight, per op family, engine and auto-priority setting."""
    results = {}
    for family, collective in (("torch_ext", _ours), ("functional", _functional)):
        for variant in ("stock", "torch_ext", "torch_ext_auto_off"):
            loss, table, log, watched = _sparse_dense_loss(rank, collective)
            torch_ext.set_auto_collective_priority_enabled(variant != "torch_ext_auto_off")
            try:
                _backward(loss, "stock" if variant == "stock" else "torch_ext")
            finally:
                torch_ext.set_auto_collective_priority_enabled(True)
            results[(family, variant)] = {
                "log": list(log),
                "grad": table.grad,
                "in_flight_after": in_flight(),
                "is_collective": _C.is_collective_node(watched["collective"]),
            }
    return results


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("dense backward failed")


def _error_with_collective_in_flight(rank: int) -> dict:
    """A node fails after the collective launched: the error propagates, the work is still waited on,
    and the engine (and the ranks' collective sequence) stays usable."""
    received, sent = _splits(rank)
    table = _leaf(rank, sum(sent), 3)
    exchanged = xops.all_to_all_single(table * 1.0, received, sent)
    dense = _FailsInBackward.apply(_leaf(rank, 4, 3, salt=2))
    loss = exchanged.sum() + dense.sum()
    try:
        torch_ext.backward(loss)
        message = None
    except RuntimeError as error:
        message = str(error)
    after_error = in_flight()
    # Still in step: one more collective round trip on both ranks.
    again = _leaf(rank, sum(sent), 3)
    torch_ext.backward(xops.all_to_all_single(again, received, sent).sum())
    return {"message": message, "in_flight_after_error": after_error, "grad_after": again.grad}


def _opchecks(rank: int) -> dict:
    received, sent = _splits(rank)
    name = dist.group.WORLD.group_name
    samples = {
        "all_to_all_single": (
            torch.ops.torch_ext.all_to_all_single.default,
            (_leaf(rank, sum(sent), 3), received, sent, name),
        ),
        "all_reduce": (torch.ops.torch_ext.all_reduce.default, (_leaf(rank, 4, 3), "sum", name)),
        "reduce_scatter_tensor": (
            torch.ops.torch_ext.reduce_scatter_tensor.default,
            (_leaf(rank, 4, 3), "sum", WORLD_SIZE, name),
        ),
        "all_gather_into_tensor": (
            torch.ops.torch_ext.all_gather_into_tensor.default,
            (_leaf(rank, 2, 3), WORLD_SIZE, name),
        ),
        "all_reduce_coalesced": (
            torch.ops.torch_ext.all_reduce_coalesced.default,
            ([_leaf(rank, 3, 2), _leaf(rank, 5, salt=1)], "sum", name),
        ),
    }
    return {op_name: torch.library.opcheck(op, args) for op_name, (op, args) in samples.items()}


def _compiled(rank: int) -> dict:
    """torch.compile(fullgraph=True) traces the ops, forward and backward (aot_eager: AOTAutograd's
    tracing without Inductor's codegen, which adds minutes on this machine and nothing for the ops)."""
    received, sent = _splits(rank)

    def step(x, y):
        exchanged = xops.all_to_all_single(x * 2.0, received, sent)
        gathered = xops.all_gather_into_tensor(y)
        return (exchanged.sum(0) * gathered.sum(0)).sum() + xops.all_reduce(y).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = {}
    for label, fn in (("eager", step), ("compiled", compiled)):
        x, y = _leaf(rank, sum(sent), 3), _leaf(rank, 2, 3, salt=1)
        loss = fn(x, y)
        torch_ext.backward(loss)
        results[label] = {"loss": loss.detach(), "x_grad": x.grad, "y_grad": y.grad}
    return results


def _bad_input(rank: int) -> dict:
    received, sent = _splits(rank)
    x = _leaf(rank, sum(sent), 3)
    attempts = {
        "split_sum": lambda: xops.all_to_all_single(x, received, [s + 1 for s in sent]),
        "split_count": lambda: xops.all_to_all_single(x, received + [1], sent + [1]),
        "split_half_given": lambda: xops.all_to_all_single(x, received, None),
        "equal_split_indivisible": lambda: xops.all_to_all_single(_leaf(rank, 3, 2)),
        "reduce_op": lambda: xops.all_reduce(x, "max"),
        "scatter_indivisible": lambda: xops.reduce_scatter_tensor(_leaf(rank, 3, 2)),
        "group_type": lambda: xops.all_reduce(x, group=3),
        "bucket_dtypes": lambda: xops.all_reduce_coalesced([x, x.double()]),
        "bucket_empty": lambda: xops.all_reduce_coalesced([]),
        "bucket_unsupported_dtype": lambda: xops.all_reduce_coalesced([x.double()]),
    }
    messages = {}
    for label, attempt in attempts.items():
        try:
            attempt()
            messages[label] = None
        except (ValueError, TypeError) as error:
            messages[label] = f"{type(error).__name__}: {error}"
    return messages


def _anomaly_nan(rank: int) -> dict:
    """Anomaly mode's NaN check reads a collective node's outputs as soon as it returns: the engine must
    not leave them in flight then. Rank 1 launches its half of the backward all_to_all late (a tensor
    hook sleeps) and sends rank 0 a NaN; stock names the all_to_all's node on rank 0, and so must
    torch_ext."""
    messages = {}
    for engine in ("stock", "torch_ext"):
        x = _leaf(rank, 2, 3)
        y = xops.all_to_all_single(x)
        if rank == 1:

            def late_nan(grad):
                time.sleep(0.5)
                grad = grad.clone()
                grad[0, 0] = float("nan")
                return grad

            y.register_hook(late_nan)
        loss = (y * 2).sum()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # anomaly mode's own "enabled" warning
                with torch.autograd.detect_anomaly(check_nan=True):
                    _backward(loss, engine)
            messages[engine] = None
        except RuntimeError as error:
            messages[engine] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    messages["in_flight_after"] = in_flight()
    return messages


# One spawn per concern: {concern: {result key: what each rank runs}}.
CONCERNS = {
    "ops": {"values": _values, "coalesced": _coalesced, "opcheck": _opchecks, "bad_input": _bad_input},
    # Node order and deferred waits, the thing most likely to hang when the engine changes.
    "scheduling": {"scheduling": _scheduling},
    # Backward raising, or a peer late with a NaN, while a collective is in flight.
    "failures": {"error": _error_with_collective_in_flight, "anomaly_nan": _anomaly_nan},
    "compile": {"compiled": _compiled},
}


def _run_concern(concern: str, rank: int) -> dict:
    results = {key: run(rank) for key, run in CONCERNS[concern].items()}
    results["current_node_supported"] = torch_ext.debug.is_current_node_supported()
    return results


# Deferred waits and the order they give must not depend on the current-node slot, which torch_ext
# finds only on x86-64 (issue #12): the concerns about them also run with TORCH_EXT_CURRENT_NODE=off.
CURRENT_NODE_MODES = ("on", "off")


def _spawned_for(concern: str, both_current_node_modes: bool = False):
    @pytest.fixture(scope="module", params=CURRENT_NODE_MODES if both_current_node_modes else ("on",))
    def results(request, tmp_path_factory) -> list[dict]:
        mode = request.param
        rank_results = run_ranks(
            functools.partial(_run_concern, concern),
            tmp_path_factory.mktemp(f"{concern}_{mode}"),
            env={"TORCH_EXT_CURRENT_NODE": mode},
        )
        if mode == "off":
            assert not any(result["current_node_supported"] for result in rank_results), "the slot was used"
        return rank_results

    return results


ops_results = _spawned_for("ops")
scheduling_results = _spawned_for("scheduling", both_current_node_modes=True)
failures_results = _spawned_for("failures", both_current_node_modes=True)
compile_results = _spawned_for("compile")


@pytest.mark.parametrize(
    "op_name", ["all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"]
)
def test_values_match_stock(op_name, ops_results):
    for rank, result in enumerate(ops_results):
        runs = result["values"][op_name]
        # Forward and input gradient: torch_ext's op, on either engine, equals PyTorch's own.
        assert_identical(runs["stock"], runs["reference"], f"rank {rank} {op_name} stock engine")
        assert_identical(runs["torch_ext"], runs["reference"], f"rank {rank} {op_name} torch_ext engine")
        if "c10d" in runs:
            assert_identical(
                runs["stock"]["forward"], runs["c10d"]["forward"], f"rank {rank} {op_name} forward, c10d's"
            )


def test_all_reduce_coalesced_matches_one_all_reduce_per_tensor(ops_results):
    for rank, result in enumerate(ops_results):
        runs = result["coalesced"]
        assert_identical(runs["stock"], runs["reference"], f"rank {rank} stock engine")
        assert_identical(runs["torch_ext"], runs["reference"], f"rank {rank} torch_ext engine")
        # The bucket's gradient all_reduce was launched first and still in flight at the dense chain.
        assert runs["dense_top_in_flight"] == 1
        assert runs["in_flight_after"] == 0


def _order(log) -> list[str]:
    return [label for label, _ in log]


@pytest.mark.parametrize("family", ["torch_ext", "functional"])
def test_collective_launches_first_on_torch_ext(family, scheduling_results):
    for rank, result in enumerate(scheduling_results):
        runs = {
            variant: result["scheduling"][(family, variant)] for variant in ("stock", "torch_ext", "torch_ext_auto_off")
        }
        assert runs["stock"]["is_collective"], "the engine does not recognise the collective's node"
        stock_order = _order(runs["stock"]["log"])
        ours_order = _order(runs["torch_ext"]["log"])
        # Stock: the dense chain (created later) runs before the collective.
        assert stock_order.index("dense_bottom") < stock_order.index("collective"), stock_order
        # torch_ext: straight from the loss to the collective, then the dense chain.
        assert ours_order[:2] == ["sparse", "collective"], ours_order
        assert ours_order.index("collective") < ours_order.index("dense_top")
        # With the automatic priority off, stock's order.
        assert _order(runs["torch_ext_auto_off"]["log"]) == stock_order
        for variant, run in runs.items():
            assert_identical(run["grad"], runs["stock"]["grad"], f"rank {rank} {variant}")
            assert run["in_flight_after"] == 0, f"rank {rank} {variant}: a collective was never waited on"


def test_backward_collective_overlaps_later_nodes(scheduling_results):
    """torch_ext's op leaves its gradient collective in flight while the dense chain runs, and its
    reader (the consumer) runs last and waits; on stock nothing is ever in flight at a node."""
    for rank, result in enumerate(scheduling_results):
        ours = result["scheduling"][("torch_ext", "torch_ext")]["log"]
        in_flight_at = dict(ours)
        assert in_flight_at["dense_top"] == 1 and in_flight_at["dense_bottom"] == 1, ours
        assert _order(ours)[-1] == "consumer", ours
        for variant in ("stock", "torch_ext_auto_off"):
            log = result["scheduling"][("torch_ext", variant)]["log"]
            # Auto-priority off still defers, but the dense chain already ran before the launch.
            assert all(count == 0 for label, count in log if label != "consumer"), (variant, log)
        # PyTorch's functional collectives wait inside their own node.
        functional = result["scheduling"][("functional", "torch_ext")]["log"]
        assert all(count == 0 for _, count in functional), functional


def test_error_after_launch_still_waits(failures_results):
    for rank, result in enumerate(failures_results):
        error = result["error"]
        assert error["message"] is not None and "dense backward failed" in error["message"]
        assert error["in_flight_after_error"] == 0
        assert error["grad_after"] is not None


@pytest.mark.parametrize(
    "op_name",
    ["all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce_coalesced"],
)
def test_opcheck(op_name, ops_results):
    for result in ops_results:
        outcomes = result["opcheck"][op_name]
        assert outcomes and all(outcome == "SUCCESS" for outcome in outcomes.values()), outcomes


def test_compile_fullgraph(compile_results):
    for rank, result in enumerate(compile_results):
        assert_identical(result["compiled"]["compiled"], result["compiled"]["eager"], f"rank {rank} compiled")


def test_bad_input_errors(ops_results):
    expected = {
        "split_sum": "ValueError: torch_ext.ops.all_to_all_single: input_split_sizes sum to",
        "split_count": "ValueError: torch_ext.ops.all_to_all_single: output_split_sizes has 3 entries, the group has 2",
        "split_half_given": "ValueError: torch_ext.ops.all_to_all_single: give both",
        "equal_split_indivisible": "ValueError: torch_ext.ops.all_to_all_single: equal splits need",
        "reduce_op": "ValueError: torch_ext.ops.all_reduce: reduce_op must be one of",
        "scatter_indivisible": "ValueError: torch_ext.ops.reduce_scatter_tensor: input.shape[0] must be divisible",
        "group_type": "TypeError: torch_ext.ops.all_reduce: group must be a torch.distributed.ProcessGroup",
        "bucket_dtypes": "ValueError: torch_ext.ops.all_reduce_coalesced: inputs[1] is torch.float64",
        "bucket_empty": "ValueError: torch_ext.ops.all_reduce_coalesced: inputs is empty",
        "bucket_unsupported_dtype": "ValueError: torch_ext.ops.all_reduce_coalesced: inputs[0] is torch.float64; a bucket",
    }
    for result in ops_results:
        for label, prefix in expected.items():
            message = result["bad_input"][label]
            assert message is not None and message.startswith(prefix), (label, message)


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch_ext.ops.all_to_all_single: no process group"):
        xops.all_to_all_single(torch.ones(2, 2))


def test_anomaly_mode_finds_nan_in_a_collective_gradient_as_on_stock(failures_results):
    for rank, result in enumerate(failures_results):
        messages = result["anomaly_nan"]
        assert messages["torch_ext"] == messages["stock"], f"rank {rank}: {messages}"
        assert messages["in_flight_after"] == 0
    # Rank 0 received the NaN: stock's message names the collective's node.
    assert "all_to_all_single" in failures_results[0]["anomaly_nan"]["stock"]
    assert "returned nan values" in failures_results[0]["anomaly_nan"]["stock"]
