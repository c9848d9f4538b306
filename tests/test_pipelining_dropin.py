"""torch_ext.pipelining's stage_backward_input/stage_backward_weight against torch.distributed.pipelining's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import _backward as stock_backward
from torch.distributed.pipelining import stage as stage_module

import torch_ext
import torch_ext.pipelining
from torch_ext.testing import assert_identical

SEED = 0


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.lin2(torch.tanh(self.lin1(x))))


def run(implementation, microbatches: int = 2) -> dict:
    torch.manual_seed(SEED)
    stage = Stage()
    accumulated = []
    stage.lin1.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    results: dict = {"dinputs": [], "input_grads": [], "returned": [], "detached": []}
    for _ in range(microbatches):
        x = torch.randn(4, 8, requires_grad=True)
        out = stage(x)
        grad = torch.randn_like(out)
        dinputs, param_groups = implementation.stage_backward_input([out], [grad], [x, 3], stage.parameters())
        results["dinputs"].append(dinputs)
        results["input_grads"].append(x.grad)
        results["detached"].append(out.grad_fn is None)
        returned = implementation.stage_backward_weight(stage.parameters(), param_groups)
        results["returned"].append([None if g is None else g.clone() for g in returned])
    results["grads"] = [p.grad for p in stage.parameters()]
    results["accumulate_grad_hook_calls"] = len(accumulated)
    return results


def test_drop_in_matches_stock_split() -> None:
    ours = run(torch_ext.pipelining)
    theirs = run(stock_backward)
    for key in ("dinputs", "input_grads", "returned", "detached", "grads"):
        assert_identical(ours[key], theirs[key], key)
    # Stock assigns .grad itself (pytorch#144530: DDP's hooks never fire); torch_ext accumulates
    # through AccumulateGrad.
    assert (ours["accumulate_grad_hook_calls"], theirs["accumulate_grad_hook_calls"]) == (2, 0)


def test_shared_weight_is_counted_once() -> None:
    """pytorch#180952's reproducer."""
    w = nn.Parameter(torch.tensor([[0.4, -0.2], [0.7, 0.3]]))
    x = torch.tensor([[1.1, -0.7]], requires_grad=True)
    expected = torch.autograd.grad((x @ w @ w).sum(), [x, w])
    out = (x @ w @ w).sum()
    dinputs, param_groups = torch_ext.pipelining.stage_backward_input([out], None, [x], iter([w]))
    torch_ext.pipelining.stage_backward_weight(iter([w]), param_groups)
    assert_identical((dinputs[0], w.grad), expected, "x's and w's gradients")


def test_stock_param_groups_are_refused() -> None:
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    _, param_groups = stock_backward.stage_backward_input([lin(x).sum()], None, [x], lin.parameters())
    with pytest.raises(TypeError, match="from torch.distributed.pipelining's own stage_backward_input"):
        torch_ext.pipelining.stage_backward_weight(lin.parameters(), param_groups)


def test_patch_zero_bubble() -> None:
    stock = (stage_module.stage_backward_input, stage_module.stage_backward_weight)
    patch = torch_ext.pipelining.patch_zero_bubble()
    assert stage_module.stage_backward_input is torch_ext.pipelining.stage_backward_input
    assert stage_module.stage_backward_weight is torch_ext.pipelining.stage_backward_weight
    patch.undo()
    patch.undo()
    assert (stage_module.stage_backward_input, stage_module.stage_backward_weight) == stock
    with torch_ext.pipelining.patch_zero_bubble():
        assert stage_module.stage_backward_input is torch_ext.pipelining.stage_backward_input
    assert (stage_module.stage_backward_input, stage_module.stage_backward_weight) == stock
