"""The API's names: one convention (torch_ext/_api.py), setters that a ``with`` block undoes, and the deprecated
names, each of which warns, naming its replacement, and still works."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import torch_ext
import torch_ext.collectives
from torch_ext import kernels
from torch_ext._handed_backward import handed_backward


def _deprecated_call(name: str, replacement: str, call):
    """``call()``'s result, asserting that it warned once, a FutureWarning naming ``replacement``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            FutureWarning,
            f"{name} is deprecated and will be removed in the next release; use {replacement}"
            + (", a context manager too" if name == "torch_ext.enabled" else ""),
        )
    ]
    # Attributed to the caller's line, where the name has to change.
    assert caught[0].filename == __file__
    return result


def test_enabled_warns_and_is_enable():
    with _deprecated_call("torch_ext.enabled", "torch_ext.enable", torch_ext.enabled):
        assert torch_ext.is_enabled()
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()
    assert not torch_ext.is_enabled()
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_auto_collective_priority_names_warn_and_work():
    assert _deprecated_call(
        "torch_ext.auto_collective_priority",
        "torch_ext.is_auto_collective_priority_enabled",
        torch_ext.auto_collective_priority,
    )
    _deprecated_call(
        "torch_ext.set_auto_collective_priority",
        "torch_ext.set_auto_collective_priority_enabled",
        lambda: torch_ext.set_auto_collective_priority(False),
    )
    try:
        assert not torch_ext.is_auto_collective_priority_enabled()
    finally:
        torch_ext.set_auto_collective_priority_enabled(True)


def test_weight_accumulation_batching_warns_and_works():
    with torch_ext.set_weight_accumulation_batching("always"):
        assert (
            _deprecated_call(
                "torch_ext.weight_accumulation_batching",
                "torch_ext.get_weight_accumulation_batching",
                torch_ext.weight_accumulation_batching,
            )
            == "always"
        )


def test_current_node_supported_warns_and_works():
    supported = _deprecated_call(
        "torch_ext.current_node_supported", "torch_ext.is_current_node_supported", torch_ext.current_node_supported
    )
    assert supported == torch_ext.is_current_node_supported()


def test_collective_checks_warns_and_works():
    count = _deprecated_call(
        "torch_ext.collective_checks", "torch_ext.collective_check_count", torch_ext.collective_checks
    )
    assert count == torch_ext.collective_check_count()


@pytest.mark.parametrize(
    "old, new, hint",
    [
        ("torch_ext.lanes", "torch_ext.collectives.lanes", ", or torch_ext.run_in_lane"),
        (
            "torch_ext.collective_check",
            "torch_ext.collectives.order_check",
            ", or torch_ext.check_collective_order and torch_ext.collective_check_count",
        ),
    ],
)
def test_the_collectives_old_module_paths_warn_and_are_the_new_modules(monkeypatch, old, new, hint):
    # A module warns when first imported: forget any earlier import of the old path.
    monkeypatch.delitem(sys.modules, old, raising=False)
    module = _deprecated_call(old, new + hint, lambda: __import__(old, fromlist=["*"]))
    assert module is sys.modules[new]
    assert sys.modules[old] is module  # `import torch_ext.lanes` again: the same module, without a warning


def test_the_collectives_names_are_torch_exts():
    # torch_ext.collectives is their one home; torch_ext re-exports them.
    names = [*torch_ext.collectives.__all__, "collective_checks"]
    assert set(names) - {"collective_checks"} <= set(torch_ext.__all__)
    for name in names:
        assert getattr(torch_ext.collectives, name) is getattr(torch_ext, name), name
    assert torch_ext.collectives.run_in_lane is torch_ext.collectives.lanes.run_in_lane
    assert torch_ext.collectives.check_collective_order is torch_ext.collectives.order_check.check_collective_order
    assert torch_ext.collectives.collective_role is torch_ext.collectives.roles.collective_role


@pytest.mark.slow
def test_importing_torch_ext_imports_no_deprecated_path():
    code = "import sys, torch_ext; print([m for m in ('torch_ext.lanes', 'torch_ext.collective_check') if m in sys.modules])"
    run = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "[]"


def test_kernels_names_warn_and_work():
    installed = kernels._multi_tensor_kernels() is not None
    with kernels.set_triton_enabled(True):
        previous = _deprecated_call(
            "torch_ext.kernels.use_triton", "torch_ext.kernels.set_triton_enabled", lambda: kernels.use_triton(False)
        )
        assert previous is True  # use_triton returns the previous setting, as before
        assert not _deprecated_call(
            "torch_ext.kernels.triton_enabled", "torch_ext.kernels.is_triton_enabled", kernels.triton_enabled
        )
    assert kernels.is_triton_enabled() == installed


def test_microbatch_overlap_run_backward_warns_and_keeps_its_default():
    seen = []
    x = torch.ones(2, requires_grad=True)

    def backward() -> None:
        seen.append(handed_backward()[1])
        (x * 3).sum().backward()

    with torch_ext.overlap_microbatches() as overlap:
        _deprecated_call(
            "torch_ext.MicrobatchOverlap.run_backward",
            "torch_ext.MicrobatchOverlap.backward_by, whose forward_collectives defaults to the window's rule "
            "(run_backward's: 'after_backward')",
            lambda: overlap.run_backward(backward),
        )
    # Its old default, not the window's ("after_backward_collectives"), as before the rename.
    assert seen == ["after_backward"]
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_deprecated_names_stay_out_of_all():
    for name in (
        "enabled",
        "auto_collective_priority",
        "set_auto_collective_priority",
        "current_node_supported",
        "collective_checks",
        "weight_accumulation_batching",
    ):
        assert name not in torch_ext.__all__
    for name in ("use_triton", "triton_enabled"):
        assert name not in kernels.__all__
    assert all(hasattr(torch_ext, name) for name in torch_ext.__all__)


# The setters: in effect at once, and undone at the end of a with block.


def test_enable_is_a_call_and_a_context_manager():
    torch_ext.enable()
    try:
        with torch_ext.enable():
            assert torch_ext.is_enabled()
        assert torch_ext.is_enabled()  # the outer enable() is still on
    finally:
        torch_ext.disable()
    assert not torch_ext.is_enabled()
    with pytest.raises(ValueError, match="inside"), torch_ext.enable():
        raise ValueError("raised inside")
    assert not torch_ext.is_enabled()


@pytest.mark.parametrize(
    "setter, getter, value",
    [
        (
            torch_ext.set_auto_collective_priority_enabled,
            torch_ext.is_auto_collective_priority_enabled,
            False,
        ),
        (torch_ext.set_weight_accumulation_batching, torch_ext.get_weight_accumulation_batching, "always"),
    ],
    ids=["auto_collective_priority", "weight_accumulation_batching"],
)
def test_a_setter_in_a_with_block_restores_the_setting(setter, getter, value):
    before = getter()
    with setter(value):
        assert getter() == value
    assert getter() == before
    undo = setter(value)  # called plainly it stays in effect
    try:
        assert getter() == value
    finally:
        with undo:
            pass
    assert getter() == before
