"""Backward priorities on small single-process graphs: order changes, gradients stay stock's bits."""

import pytest
import torch
from engine_helpers import recsys_like

import torch_ext
from torch_ext.testing import assert_identical


def run_and_record(run, seed=0):
    """Runs `run(loss, lookup, w_sparse, w_dense)` and returns (node order, leaf grads, graph)."""
    loss, lookup, w_sparse, w_dense, leaves = recsys_like(seed)
    order, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda grads, node=node: order.append(node))
        stack.extend(n for n, _ in node.next_functions)
    run(loss, lookup, w_sparse, w_dense)
    return order, [leaf.grad for leaf in leaves], (lookup, w_sparse, w_dense)


def position(order, node):
    return order.index(node)


def stock_run(loss, *_):
    torch.autograd.backward(loss)


def names(order):
    return [node.name() for node in order]


def test_default_order_is_stock_order():
    stock_order, stock_grads, _ = run_and_record(stock_run)
    ext_order, ext_grads, _ = run_and_record(lambda loss, *_: torch_ext.backward(loss))
    assert names(ext_order) == names(stock_order)
    assert_identical(ext_grads, stock_grads, "gradients")


def test_stock_runs_dense_path_first():
    # The premise of the priority tests: without priorities the lookup's node runs after all the dense work.
    order, _, (lookup, _, w_dense) = run_and_record(stock_run)
    dense_accumulators = [
        n for n in order if n.name().endswith("AccumulateGrad") and any(n.variable is w for w in w_dense)
    ]
    assert position(order, lookup.grad_fn) > max(position(order, n) for n in dense_accumulators)


def _lookup_runs_before_dense_matmuls(order, lookup):
    first_dense_mm = next(i for i, n in enumerate(order) if n.name() == "ReluBackward0")
    return position(order, lookup.grad_fn) < first_dense_mm


def test_set_priority_propagates_to_the_path_and_keeps_gradients():
    stock_order, stock_grads, _ = run_and_record(stock_run)

    def prioritised(loss, lookup, *_):
        torch_ext.set_priority(lookup, 10)
        torch_ext.backward(loss)

    order, grads, (lookup, _, _) = run_and_record(prioritised)
    assert _lookup_runs_before_dense_matmuls(order, lookup)
    # Every node between the loss and the lookup ran before any dense node.
    sparse_prefix = names(order)[: names(order).index("ExpBackward0") + 1]
    assert "ReluBackward0" not in sparse_prefix
    assert sparse_prefix.count("TanhBackward0") == 3
    assert sorted(names(order)) == sorted(names(stock_order))
    assert_identical(grads, stock_grads, "gradients")


def test_propagate_false_boosts_only_the_target_once_ready():
    def target_only(loss, lookup, *_):
        torch_ext.set_priority(lookup, 10, propagate=False)
        torch_ext.backward(loss)

    order, _, (lookup, _, _) = run_and_record(target_only)
    stock_order, _, _ = run_and_record(stock_run)
    # The path to the lookup keeps stock's order, so it is reached late; but once ready it runs at
    # once, before the AccumulateGrad that became ready with it and runs first on stock.
    assert not _lookup_runs_before_dense_matmuls(order, lookup)
    made_ready_by = order[position(order, lookup.grad_fn) - 1]
    assert made_ready_by.name() == "MmBackward0"
    assert position(order, lookup.grad_fn) < position(stock_order, stock_order[-1])
    assert names(order) != names(stock_order) and sorted(names(order)) == sorted(names(stock_order))


def test_negative_priority_runs_after_other_ready_work():
    def deprioritised(loss, lookup, w_sparse, w_dense):
        # The dense path's last node: with -1 (not propagated) every sparse node runs first.
        dense_first_layer_acc = torch.autograd.graph.get_gradient_edge(w_dense[0]).node
        torch_ext.set_priority(dense_first_layer_acc, -1, propagate=False)
        torch_ext.backward(loss)

    order, _, (_, _, w_dense) = run_and_record(deprioritised)
    assert order[-1].name().endswith("AccumulateGrad") and order[-1].variable is w_dense[0]


def test_equal_priorities_everywhere_keep_stock_order():
    stock_order, _, _ = run_and_record(stock_run)

    def all_equal(loss, *_):
        node_stack, seen = [loss.grad_fn], set()
        while node_stack:
            node = node_stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            torch_ext.set_priority(node, 7, propagate=False)
            node_stack.extend(n for n, _ in node.next_functions)
        torch_ext.backward(loss)

    order, _, _ = run_and_record(all_equal)
    assert names(order) == names(stock_order)


def test_per_call_priorities_override_and_do_not_persist():
    def per_call(loss, lookup, *_):
        torch_ext.set_priority(lookup, -5)
        torch_ext.backward(loss, priorities={lookup: 10})
        assert torch_ext.get_priority(lookup) == (-5, True)

    order, _, (lookup, _, _) = run_and_record(per_call)
    assert _lookup_runs_before_dense_matmuls(order, lookup)


def test_grad_accepts_priorities():
    grads = {}

    def grad_of_every_leaf(grad, call_kwargs):
        def run(loss, lookup, w_sparse, w_dense):
            table = lookup.grad_fn.next_functions[0][0].variable  # lookup = table.exp()
            grads[grad] = grad(loss, [table, *w_sparse, *w_dense], **call_kwargs(lookup))

        return run

    stock_order, _, (stock_lookup, _, _) = run_and_record(grad_of_every_leaf(torch.autograd.grad, lambda _: {}))
    order, _, (lookup, _, _) = run_and_record(
        grad_of_every_leaf(torch_ext.grad, lambda lookup: {"priorities": {lookup: 3}})
    )
    # Ignoring the priority would leave stock's order, where the lookup runs after the dense path.
    assert not _lookup_runs_before_dense_matmuls(stock_order, stock_lookup)
    assert _lookup_runs_before_dense_matmuls(order, lookup)
    assert sorted(names(order)) == sorted(names(stock_order))
    assert_identical(grads[torch_ext.grad], grads[torch.autograd.grad], "grad() results")


def test_clear_priority_restores_stock_order():
    stock_order, _, _ = run_and_record(stock_run)

    def cleared(loss, lookup, *_):
        torch_ext.set_priority(lookup, 10)
        assert torch_ext.get_priority(lookup) == (10, True)
        assert torch_ext.clear_priority(lookup) is True
        assert torch_ext.clear_priority(lookup) is False
        assert torch_ext.get_priority(lookup) is None
        torch_ext.backward(loss)

    order, _, _ = run_and_record(cleared)
    assert names(order) == names(stock_order)


def test_launch_first_uses_the_highest_priority():
    def first(loss, lookup, *_):
        torch_ext.launch_first(lookup)
        assert torch_ext.get_priority(lookup) == (torch_ext.LAUNCH_FIRST, True)
        torch_ext.backward(loss)

    order, _, (lookup, _, _) = run_and_record(first)
    assert _lookup_runs_before_dense_matmuls(order, lookup)


def test_targets_tensor_leaf_node_and_gradient_edge():
    loss, lookup, w_sparse, _, _ = recsys_like()
    torch_ext.set_priority(w_sparse[0], 1)  # a leaf: its AccumulateGrad
    assert torch_ext.get_priority(torch.autograd.graph.get_gradient_edge(w_sparse[0]).node) == (1, True)
    torch_ext.set_priority(torch.autograd.graph.get_gradient_edge(lookup), 2, propagate=False)
    assert torch_ext.get_priority(lookup.grad_fn) == (2, False)
    torch_ext.set_priority(loss.grad_fn, 3)
    assert torch_ext.get_priority(loss) == (3, True)


def test_sequence_nr_boost_still_works_like_stock():
    def boosted(backward):
        def run(loss, lookup, *_):
            lookup.grad_fn._set_sequence_nr(2**40)
            backward(loss)

        return run

    stock_order, stock_grads, _ = run_and_record(boosted(torch.autograd.backward))
    ext_order, ext_grads, _ = run_and_record(boosted(torch_ext.backward))
    assert names(ext_order) == names(stock_order)
    assert_identical(ext_grads, stock_grads, "gradients")


def test_priorities_do_not_change_sequence_nr():
    _, lookup, *_ = recsys_like()
    before = lookup.grad_fn._sequence_nr()
    torch_ext.set_priority(lookup, 10)
    assert lookup.grad_fn._sequence_nr() == before


@pytest.mark.parametrize(
    "call, error, message",
    [
        pytest.param(lambda: torch_ext.set_priority(torch.ones(2), 1), ValueError, "no grad_fn", id="no-grad-fn"),
        pytest.param(
            lambda: torch_ext.set_priority(torch.ones(2, requires_grad=True), 1.5), TypeError, "int", id="float"
        ),
        pytest.param(
            lambda: torch_ext.set_priority(torch.ones(2, requires_grad=True), True), TypeError, "int", id="bool"
        ),
        pytest.param(
            lambda: torch_ext.set_priority(torch.ones(2, requires_grad=True), 2**64), ValueError, "64 bits", id="range"
        ),
        pytest.param(lambda: torch_ext.set_priority("loss", 1), TypeError, "got str", id="target-type"),
        pytest.param(
            lambda: torch_ext.backward((torch.ones(2, requires_grad=True) * 2).sum(), priorities=[1]),
            TypeError,
            "dict",
            id="priorities-not-dict",
        ),
    ],
)
def test_bad_input_raises_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _identity_function(name):
    """A pass-through autograd.Function of its own (not an op's): never a collective by itself."""

    def forward(ctx, x):
        return x.clone()

    def backward(ctx, grad):
        return grad

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    )


@pytest.mark.parametrize(
    "make, is_collective",
    [
        # Ops of torch.library (engine_helpers) whose formulas torch.library wraps in Functions it generates: the
        # engine knows a node by the op its class was made for.
        pytest.param(lambda x: torch.ops.torch_ext_test.exchange(x), True, id="declared-op"),
        pytest.param(lambda x: torch.ops.torch_ext_test.exchange_list([x])[0], True, id="declared-list-op"),
        pytest.param(lambda x: torch.ops.torch_ext_test.all_to_all_single(x), False, id="undeclared-op"),
        pytest.param(lambda x: _identity_function("AllToAll").apply(x), False, id="function"),
    ],
)
def test_collective_nodes_are_recognised_by_their_op(make, is_collective):
    node = make(torch.ones(2, requires_grad=True)).grad_fn
    assert torch_ext._C.is_collective_node(node) is is_collective
    # C++ nodes never are.
    assert not torch_ext._C.is_collective_node((torch.ones(2, requires_grad=True) * 2).grad_fn)


def test_collectives_get_a_propagated_priority_unless_switched_off():
    def run(on_torch_ext):
        loss, exchanged, _, _, leaves = recsys_like(exchange=torch.ops.torch_ext_test.exchange)
        dense = loss.grad_fn.next_functions[0][0].next_functions[1][0]  # Sum <- Mul(sparse, dense)
        order = []
        exchanged.grad_fn.register_prehook(lambda grads: order.append("collective"))
        dense.register_prehook(lambda grads: order.append("dense_top"))
        (torch_ext.backward if on_torch_ext else torch.autograd.backward)(loss)
        return order, [leaf.grad for leaf in leaves]

    stock_order, stock_grads = run(False)
    assert stock_order == ["dense_top", "collective"]
    assert torch_ext.is_auto_collective_priority_enabled()
    ext_order, ext_grads = run(True)
    assert ext_order == ["collective", "dense_top"]
    assert_identical(ext_grads, stock_grads, "gradients")
    torch_ext.set_auto_collective_priority_enabled(False)
    try:
        off_order, off_grads = run(True)
    finally:
        torch_ext.set_auto_collective_priority_enabled(True)
    assert off_order == stock_order
    assert_identical(off_grads, stock_grads, "gradients")
    with pytest.raises(TypeError, match="expected a bool"):
        torch_ext.set_auto_collective_priority_enabled(1)


def test_engine_run_backward_accepts_priorities():
    def ext_run(loss, lookup, w_sparse, w_dense):
        torch_ext.Engine().run_backward(
            (loss,), (torch.ones_like(loss),), False, False, (), True, True, priorities={lookup: 5}
        )

    stock_order, stock_grads, (lookup, *_) = run_and_record(stock_run)
    ext_order, ext_grads, (ext_lookup, *_) = run_and_record(ext_run)
    assert_identical(ext_grads, stock_grads, "gradients")
    assert position(ext_order, ext_lookup.grad_fn) < len(ext_order) // 2 < position(stock_order, lookup.grad_fn)
