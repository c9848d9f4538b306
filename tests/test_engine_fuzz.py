"""Random graphs on torch_ext and on stock torch.autograd: the same gradient bits and node order.

Hypothesis draws a small program (``engine_helpers.programs``) over a few (N, N) leaves: elementwise, matmul, reduction, view and
in-place-on-clone ops, detached branches, logging hooks, and one to four roots (tensors, scalars or
GradientEdges; a root may be reachable from another). ``engine_helpers.assert_backward_matches_stock``
builds it once per engine and compares gradients with torch.equal, node execution order and hook calls.
"""

from engine_helpers import assert_backward_matches_stock, programs
from hypothesis import HealthCheck, given, settings


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    # The helper seeds torch itself before every build; the autouse seed fixture does not matter here.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(programs())
def test_random_graph_matches_stock(program):
    assert_backward_matches_stock(
        program.build,
        grad_tensors=program.grad_tensors(),
        retain_graph=program.runs > 1,
        runs=program.runs,
    )
