"""The API's names: one convention (torch_ext/_api.py), setters that a ``with`` block undoes, the debugging helpers
in one namespace (torch_ext.debug), and none of the names deprecated before 0.1.0 left."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

import torch_ext
import torch_ext.collectives
from torch_ext import kernels

# The names deprecated before 0.1.0, removed with it (nothing was released), and the debugging helpers that moved
# to torch_ext.debug without an alias: old name -> where it went.
REMOVED_NAMES = {
    "enabled": "enable",
    "set_auto_collective_priority": "set_auto_collective_priority_enabled",
    "auto_collective_priority": "is_auto_collective_priority_enabled",
    "weight_accumulation_batching": "get_weight_accumulation_batching",
    "current_node_supported": "debug.is_current_node_supported",
    "collective_checks": "debug.collective_check_count",
    "execution_order": "debug.execution_order",
    "is_current_node_supported": "debug.is_current_node_supported",
    "collective_check_count": "debug.collective_check_count",
}
REMOVED_KERNELS_NAMES = {"use_triton": "set_triton_enabled", "triton_enabled": "is_triton_enabled"}
REMOVED_MODULES = {
    "torch_ext.lanes": "torch_ext.collectives.lanes",
    "torch_ext.collective_check": "torch_ext.collectives.order_check",
}


def test_the_removed_names_are_gone_and_their_replacements_are_public():
    for old, new in REMOVED_NAMES.items():
        assert not hasattr(torch_ext, old), old
        assert not hasattr(torch_ext.collectives, old), old
        namespace, _, name = new.rpartition(".")
        assert name in getattr(torch_ext, namespace, torch_ext).__all__, new
    for old, new in REMOVED_KERNELS_NAMES.items():
        assert not hasattr(kernels, old), old
        assert new in kernels.__all__, new
    assert not hasattr(torch_ext.MicrobatchOverlap, "run_backward")  # backward_by
    assert all(hasattr(torch_ext, name) for name in torch_ext.__all__)


@pytest.mark.parametrize("old, new", REMOVED_MODULES.items())
def test_the_collectives_old_module_paths_are_gone(old, new):
    assert importlib.util.find_spec(old) is None
    assert importlib.import_module(new) is sys.modules[new]


def test_the_debugging_helpers_are_one_namespace():
    assert "debug" in torch_ext.__all__
    assert torch_ext.debug.__all__ == ["collective_check_count", "execution_order", "is_current_node_supported"]
    assert not set(torch_ext.debug.__all__) & set(torch_ext.__all__)
    assert all(callable(getattr(torch_ext.debug, name)) for name in torch_ext.debug.__all__)


def test_the_collectives_names_are_torch_exts():
    # torch_ext.collectives is their one home; torch_ext re-exports them.
    assert set(torch_ext.collectives.__all__) <= set(torch_ext.__all__)
    for name in torch_ext.collectives.__all__:
        assert getattr(torch_ext.collectives, name) is getattr(torch_ext, name), name
    assert torch_ext.collectives.run_in_lane is torch_ext.collectives.lanes.run_in_lane
    assert torch_ext.collectives.check_collective_order is torch_ext.collectives.order_check.check_collective_order
    assert torch_ext.collectives.collective_role is torch_ext.collectives.roles.collective_role


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
