"""Random graphs on torch_ext and on stock torch.autograd: the same gradient bits and node order.

Hypothesis draws a small program (``engine_helpers.programs``) over a few (N, N) leaves: elementwise, matmul, reduction, view and
in-place-on-clone ops, detached branches, logging hooks, and one to four roots (tensors, scalars or
GradientEdges; a root may be reachable from another). ``engine_helpers.assert_backward_matches_stock``
builds it once per engine and compares gradients bit for bit (``torch_ext.testing.assert_identical``), node execution
order and hook calls, and checks torch_ext's engine ran every node.
"""

import torch
from engine_helpers import (
    NUM_LEAVES,
    assert_backward_matches_stock,
    fuzz_settings,
    programs,
    run_recorded,
)
from hypothesis import assume, given

import torch_ext
from torch_ext.testing import assert_identical


@fuzz_settings(150)
@given(programs())
def test_random_graph_matches_stock(program):
    assert_backward_matches_stock(
        program.build,
        grad_tensors=program.grad_tensors(),
        retain_graph=program.runs > 1,
        runs=program.runs,
    )


# Split backward's two passes (backward_input, then backward_weight) over random graphs: the first leaves are
# the stage's inputs, the others its weights. Together the passes must give every leaf stock's full backward's
# bits.
SPLIT_INPUTS = 2


@fuzz_settings(60)
@given(programs())
def test_random_graph_split_passes_match_stock(program):
    assume(all(root.kind != "edge" and root.value >= NUM_LEAVES for root in program.roots))
    built = []

    def build():
        roots, values = program.build()
        built[:] = values[:NUM_LEAVES]
        return roots, built

    def split_backward(roots, grad_tensors, retain_graph):
        inputs, weights = built[:SPLIT_INPUTS], built[SPLIT_INPUTS:]
        input_grads, state = torch_ext.backward_input(roots, grad_tensors, inputs, weights, allow_unused=True)
        torch_ext.backward_weight(state)
        for leaf, grad in zip(inputs, input_grads, strict=True):
            leaf.grad = grad

    stock = run_recorded(build, torch.autograd.backward, grad_tensors=program.grad_tensors())
    split = run_recorded(build, split_backward, grad_tensors=program.grad_tensors())
    # An input's gradient is returned as grad() returns it, in the layout it arrived in; stock's .grad went through
    # AccumulateGrad, which lays it out like the leaf: strides that stock does not fix for grad(). Same bits.
    assert_identical(split.grads[:SPLIT_INPUTS], stock.grads[:SPLIT_INPUTS], "input gradient", compare_strides=False)
    assert_identical(split.grads[SPLIT_INPUTS:], stock.grads[SPLIT_INPUTS:], "weight .grad")
