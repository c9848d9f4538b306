"""torch_ext.pipelining's stage_backward_input/stage_backward_weight against torch.distributed.pipelining's.

The contracts of PyTorch's own split-backward tests (test/distributed/pipelining/test_backward.py),
each checked bit for bit against stock's functions on the same stage: the parameter groups' keys and
values, gradients written into ``"grads"`` before the weight pass, repeated microbatches, shared
weights, custom autograd Functions and outputs that are views.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import _backward as stock_backward
from torch.distributed.pipelining import stage as stage_module

import torch_ext
import torch_ext.pipelining
from torch_ext.pipelining import _WEIGHT_PASS_KEY
from torch_ext.testing import assert_identical, identity_difference

SEED = 0
BATCH = 5
WIDTH = 6

# -- stages -------------------------------------------------------------------------------------------------------


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.lin2 = nn.Linear(2 * WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.lin2(torch.tanh(self.lin1(x))))


class SharedWeight(nn.Module):
    """One weight at two places with an op between them: its group has two intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w) @ self.w


class PassBoth(torch.autograd.Function):
    """Two inputs, two outputs, returned as they are: its backward node has two gradients."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.view_as(a), w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad_a: torch.Tensor, grad_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_a, grad_w


class TwoGradientIntermediate(nn.Module):
    """The intermediate is PassBoth's node: one gradient towards the input, one towards the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH // 2, WIDTH // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, WIDTH // 2, dim=1)
        a, w = PassBoth.apply(a, self.w)
        return (a @ w) * b


class MatmulAsAsked(torch.autograd.Function):
    """A matmul whose backward computes only the gradients ``ctx.needs_input_grad`` asks for."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        grad_a = grad @ b.T if ctx.needs_input_grad[0] else None
        grad_b = a.T @ grad if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class CustomFunctionStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sin(MatmulAsAsked.apply(x, self.w)))


class ViewOfOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ViewOutputStage(Stage):
    """Ends in a custom Function that returns a view, as an activation checkpoint's boundary does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ViewOfOutput.apply(super().forward(x))


# -- the helper ---------------------------------------------------------------------------------------------------

STOCK = stock_backward
OURS = torch_ext.pipelining
EditGroups = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def split_backward(
    input_pass: ModuleType,
    weight_pass: ModuleType,
    make_stage: Callable[[], nn.Module],
    *,
    microbatches: int = 1,
    loss: bool = False,
    edit: EditGroups | None = None,
    one_call_per_group: bool = False,
    retain_graph: bool = False,
) -> dict[str, Any]:
    """Runs ``microbatches`` forwards of a fresh stage, each followed by ``input_pass``'s
    stage_backward_input and ``weight_pass``'s stage_backward_weight, and returns what a caller sees.

    ``loss``: the stage's output summed is what is differentiated (output_grads=None), as on a last
    stage. ``edit``: what to do to the groups between the passes; it returns the groups to pass on.
    ``one_call_per_group``: a weight pass for each group, in their order, rather than one for all.
    """
    torch.manual_seed(SEED)
    stage = make_stage()
    params = [p for p in stage.parameters() if p.requires_grad]
    name_of_node = {get_gradient_edge(p).node: name for name, p in stage.named_parameters() if p.requires_grad}
    accumulated = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    seen: dict[str, list] = {key: [] for key in ("dinputs", "input_grads", "groups", "after_input_pass", "returned")}
    seen["groups_after"] = []
    for _ in range(microbatches):
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        out = stage(x)
        outputs, output_grads = ([out.sum()], None) if loss else ([out], [torch.randn_like(out)])
        dinputs, groups = input_pass.stage_backward_input(
            outputs, output_grads, [x, "not a tensor"], stage.parameters()
        )
        # Cloned: in-place edits of the groups' gradients may reach tensors that stock shares with these.
        seen["dinputs"].append(_cloned(dinputs))
        seen["input_grads"].append(_cloned(x.grad))
        seen["after_input_pass"].append([_cloned(p.grad) for p in params])
        seen["groups"].append(describe(groups, name_of_node))
        assert outputs[0].grad_fn is None, "the outputs are detached"
        del out, outputs
        gc.collect()
        passed = groups if edit is None else edit(groups)
        for call in [[group] for group in passed] if one_call_per_group else [passed]:
            returned = weight_pass.stage_backward_weight(stage.parameters(), call, retain_graph=retain_graph)
            seen["returned"].append(_cloned(returned))
        seen["groups_after"].append([sorted(key for key in group if key != _WEIGHT_PASS_KEY) for group in groups])
    seen["weight_grads"] = [p.grad for p in params]
    seen["accumulate_grad_hook_calls"] = len(accumulated)
    return seen


def describe(groups: list[dict[str, Any]], name_of_node: dict) -> list[dict[str, Any]]:
    """What a reader of the groups sees, the intermediates in the order the forward made them (stock's
    own order is a set's), and the private key left out (test_groups_are_stocks_dicts checks it)."""
    assert type(groups) is list
    described = []
    for group in groups:
        assert type(group) is dict
        intermediates, grads = group["intermediates"], group["grads"]
        order = sorted(range(len(intermediates)), key=lambda i: intermediates[i]._sequence_nr())
        described.append(
            {
                "keys": sorted(key for key in group if key != _WEIGHT_PASS_KEY),
                "types": [type(group[key]).__name__ for key in ("params", "intermediates", "grads")],
                "params": sorted(name_of_node[node] for node in group["params"]),
                "intermediates": [intermediates[i].name() for i in order],
                "grads": [_cloned(grads[i]) for i in order],
            }
        )
    return sorted(described, key=lambda group: group["params"])


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return value


def assert_as_stock(make_stage: Callable[[], nn.Module], *, resumed: bool = True, **options: Any) -> dict:
    """torch_ext's pair against stock's pair, bit for bit; ``resumed``: whether torch_ext's own weight
    pass ran (it accumulates through AccumulateGrad, so the hooks see it; stock assigns ``.grad``)."""
    ours = split_backward(OURS, OURS, make_stage, **options)
    theirs = split_backward(STOCK, STOCK, make_stage, **options)
    for key in ("dinputs", "input_grads", "after_input_pass", "groups", "returned", "groups_after", "weight_grads"):
        assert_identical(ours[key], theirs[key], key)
    assert theirs["accumulate_grad_hook_calls"] == 0
    assert (ours["accumulate_grad_hook_calls"] > 0) == resumed, ours["accumulate_grad_hook_calls"]
    return ours


# -- the contracts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_stage",
    [Stage, SharedWeight, TwoGradientIntermediate, CustomFunctionStage],
    ids=lambda make_stage: make_stage.__name__,
)
@pytest.mark.parametrize("loss", [False, True], ids=["output_grads", "loss"])
def test_split_backward_as_stock(make_stage: Callable[[], nn.Module], loss: bool) -> None:
    assert_as_stock(make_stage, loss=loss)


def test_an_output_that_is_a_view_raises_as_stock() -> None:
    """PyTorch's newer test_backward.py splits a stage whose output is a view; torch 2.13's
    stage_backward_input detaches its outputs in place, which a view refuses, and so does torch_ext's."""
    for implementation in (OURS, STOCK):
        with pytest.raises(RuntimeError) as raised:
            split_backward(implementation, implementation, ViewOutputStage)
        assert "Can't detach views in-place" in str(raised.value.__cause__)


def test_repeated_microbatches_accumulate_as_stock() -> None:
    ours = assert_as_stock(Stage, microbatches=4)
    # Weights still None after the first input pass, then each earlier microbatch's sum.
    assert all(grad is None for grad in ours["after_input_pass"][0])
    assert ours["accumulate_grad_hook_calls"] == 4 * 4


def test_weight_pass_retaining_the_graph() -> None:
    assert_as_stock(Stage, retain_graph=True)


def test_the_weight_pass_leaves_groups_as_stock_does() -> None:
    ours = assert_as_stock(Stage)
    assert ours["groups_after"] == [[["params"], ["params"]]]


def halve_written(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for group in groups:
        group["grads"] = [tuple(None if grad is None else grad * 0.5 for grad in grads) for grads in group["grads"]]
    return groups


def halve_in_place(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for group in groups:
        for grads in group["grads"]:
            for grad in grads:
                if grad is not None:
                    grad.mul_(0.5)
    return groups


def keep_gradient(position: int) -> EditGroups:
    def keep(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for group in groups:
            group["grads"] = [
                tuple(grad if i == position else None for i, grad in enumerate(grads)) for grads in group["grads"]
            ]
        return groups

    return keep


@pytest.mark.parametrize(
    ("make_stage", "edit", "changes_weight_grads"),
    [
        pytest.param(Stage, halve_written, True, id="Stage-written"),
        pytest.param(Stage, halve_in_place, True, id="Stage-in_place"),
        pytest.param(CustomFunctionStage, halve_written, True, id="CustomFunctionStage-written"),
        pytest.param(CustomFunctionStage, halve_in_place, True, id="CustomFunctionStage-in_place"),
        pytest.param(TwoGradientIntermediate, halve_written, True, id="TwoGradientIntermediate-written"),
        pytest.param(TwoGradientIntermediate, halve_in_place, True, id="TwoGradientIntermediate-in_place"),
        # PyTorch's "1 grad, 1 None" and "1 None, 1 grad": only the second reaches the weight.
        pytest.param(TwoGradientIntermediate, keep_gradient(0), True, id="TwoGradientIntermediate-first_only"),
        pytest.param(TwoGradientIntermediate, keep_gradient(1), False, id="TwoGradientIntermediate-second_only"),
    ],
)
def test_written_grads_are_used_as_stock_uses_them(
    make_stage: Callable[[], nn.Module], edit: EditGroups, changes_weight_grads: bool
) -> None:
    """PyTorch's own test writes "grads" before the weight pass; torch_ext's state has its own
    references to the gradients, so a group whose gradients changed is computed as stock does."""
    ours = assert_as_stock(make_stage, edit=edit, resumed=False, microbatches=2)
    unedited = split_backward(OURS, OURS, make_stage, microbatches=2)
    difference = identity_difference(ours["weight_grads"], unedited["weight_grads"])
    assert (difference is not None) == changes_weight_grads, difference


@pytest.mark.parametrize(
    "edit",
    [
        lambda groups: [dict(group) for group in groups],
        lambda groups: [group | {"grads": list(group["grads"])} for group in groups],
        lambda groups: list(reversed(groups)),
    ],
    ids=["copied_dicts", "same_gradients_new_list", "reordered"],
)
def test_groups_holding_the_same_objects_resume_torch_exts_pass(edit: EditGroups) -> None:
    assert_as_stock(Stage, edit=edit)


def test_groups_passed_apart_are_computed_as_stock() -> None:
    """Stock's weight pass computes each group on its own; torch_ext's state is for all of one call's
    groups at once, so groups passed in calls of their own are computed as stock does."""
    assert_as_stock(Stage, one_call_per_group=True, resumed=False, microbatches=2)


def test_groups_are_stocks_dicts() -> None:
    """Plain dicts with stock's three keys, and one more: the state torch_ext's weight pass resumes."""
    stage = Stage()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    _, groups = OURS.stage_backward_input([stage(x)], None, [x], stage.parameters())
    assert [type(group) for group in groups] == [dict, dict]
    assert [set(group) for group in groups] == [{"params", "intermediates", "grads", _WEIGHT_PASS_KEY}] * 2
    for group in groups:
        grads = group["grads"]
        assert [type(grad_tuple) for grad_tuple in grads] == [tuple] * len(group["intermediates"])
    OURS.stage_backward_weight(stage.parameters(), groups)
    assert groups == [{"params": group["params"]} for group in groups]


def test_stocks_groups_are_computed_as_stock() -> None:
    theirs = split_backward(STOCK, STOCK, Stage, microbatches=2)
    mixed = split_backward(STOCK, OURS, Stage, microbatches=2)
    for key in ("returned", "groups_after", "weight_grads"):
        assert_identical(mixed[key], theirs[key], key)


def test_stocks_weight_pass_takes_torch_exts_groups() -> None:
    theirs = split_backward(STOCK, STOCK, Stage, microbatches=2)
    mixed = split_backward(OURS, STOCK, Stage, microbatches=2)
    for key in ("returned", "weight_grads"):
        assert_identical(mixed[key], theirs[key], key)


def test_written_grads_where_the_input_pass_freed_the_path_between_intermediates() -> None:
    """Stock's way of computing a written group runs the ReLU between the shared weight's two uses,
    whose saved tensor torch_ext's input pass freed: torch_ext raises, saying why."""
    with pytest.raises(RuntimeError) as raised:
        split_backward(OURS, OURS, SharedWeight, edit=halve_written)
    assert any("torch_ext's input pass kept" in note for note in getattr(raised.value, "__notes__", []))


def test_shared_weight_is_counted_once() -> None:
    """pytorch#180952's reproducer."""
    w = nn.Parameter(torch.tensor([[0.4, -0.2], [0.7, 0.3]]))
    x = torch.tensor([[1.1, -0.7]], requires_grad=True)
    expected = torch.autograd.grad((x @ w @ w).sum(), [x, w])
    out = (x @ w @ w).sum()
    dinputs, param_groups = OURS.stage_backward_input([out], None, [x], iter([w]))
    OURS.stage_backward_weight(iter([w]), param_groups)
    assert_identical((dinputs[0], w.grad), expected, "x's and w's gradients")


def test_an_output_computed_from_weights_alone() -> None:
    """Stock's groups reach a weight only through intermediates: they miss the gradient that an output
    computed from weights alone sends it, and a weight only such an output reaches is in no group.
    torch_ext's weight pass accumulates what a full backward does."""

    def weight_grads(implementation: ModuleType | None) -> list[torch.Tensor | None]:
        torch.manual_seed(SEED)
        lin, bias = nn.Linear(WIDTH, WIDTH), nn.Parameter(torch.randn(WIDTH))
        params = [*lin.parameters(), bias]
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        outputs = [lin(x), lin.weight.sum(0) + bias]
        output_grads = [torch.randn_like(output) for output in outputs]
        if implementation is None:
            torch.autograd.backward(outputs, output_grads)
        else:
            _, groups = implementation.stage_backward_input(outputs, output_grads, [x], iter(params))
            implementation.stage_backward_weight(iter(params), groups)
        return [p.grad for p in params]

    full = weight_grads(None)
    assert_identical(weight_grads(OURS), full, "torch_ext's split")
    stocks = weight_grads(STOCK)
    assert identity_difference(stocks[0], full[0]) is not None
    assert stocks[2] is None


def test_no_input_needs_a_gradient() -> None:
    """Stock's walk finds no group when no input needs a gradient (a first stage): no weight gradient."""
    for implementation in (OURS, STOCK):
        stage = Stage()
        x = torch.randn(BATCH, WIDTH)
        dinputs, groups = implementation.stage_backward_input([stage(x).sum()], None, [x], stage.parameters())
        assert (dinputs, groups) == ((None,), [])
        implementation.stage_backward_weight(stage.parameters(), groups)
        assert all(p.grad is None for p in stage.parameters())


class SavedTensorCount:
    """Counts the saved tensors still held by the graph: each is packed into an object of its own."""

    def __init__(self) -> None:
        self._packed: list[weakref.ref] = []

    def pack(self, tensor: torch.Tensor) -> Any:
        holder = _Holder(tensor)
        self._packed.append(weakref.ref(holder))
        return holder

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.tensor

    def alive(self) -> int:
        return sum(ref() is not None for ref in self._packed)


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_the_input_pass_frees_what_the_weight_pass_does_not_need() -> None:
    alive = {}
    for implementation in (OURS, STOCK):
        torch.manual_seed(SEED)
        stage = CustomFunctionStage()
        count = SavedTensorCount()
        x = torch.randn(BATCH, WIDTH, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
            out = stage(x)
        _, groups = implementation.stage_backward_input([out], [torch.randn_like(out)], [x], stage.parameters())
        del out
        gc.collect()
        after_input_pass = count.alive()
        implementation.stage_backward_weight(stage.parameters(), groups)
        alive[implementation.__name__] = (after_input_pass, count.alive())
    # Saved: the matmul's a and b, sin's input, the Linear's input (and its weight, a view). Stock
    # keeps them all until the weight pass; torch_ext frees sin's, which the weight pass does not need.
    ours, theirs = alive[OURS.__name__], alive[STOCK.__name__]
    assert ours[0] == theirs[0] - 1, alive
    assert ours[1] == 0, alive


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
