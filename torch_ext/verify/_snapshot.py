"""The state a step reads and writes, saved before the stock run and restored before the torch_ext run and after
both: every parameter, buffer, shard and ``.grad`` of the models, the optimizers' and ``stateful`` objects'
state dicts, and the generators (``_rng``). Leaves and optimizers the step touches without being named are added
while it runs, before they change (the session calls :meth:`_Snapshot.add_leaf` and
:meth:`_Snapshot.add_optimizer`).

Also here: which models and optimizers a step refers to when the caller names none (``_referenced_state``), since
that decides what the snapshot holds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

import torch

from torch_ext.verify._report import _kind
from torch_ext.verify._rng import _RngState


def _named(objects, label: str) -> dict[str, Any]:
    """``{name: object}``: the names a dict already has, else ``label[i]`` (the bare name for a single one)."""
    if isinstance(objects, dict):
        return dict(objects)
    # One model or optimizer given without a list (a Sequential is iterable: over its children).
    objects = [objects] if isinstance(objects, (torch.nn.Module, torch.optim.Optimizer)) else list(objects)
    if len(objects) == 1:
        return {"": objects[0]}
    return {f"{label}[{index}]": value for index, value in enumerate(objects)}


def _referenced_state(step) -> tuple[dict[str, torch.nn.Module], dict[str, torch.optim.Optimizer]]:
    """The modules and optimizers ``step`` refers to by name, outermost modules only."""
    referenced: dict[str, Any] = {}
    function = step
    while isinstance(function, functools.partial):
        referenced |= {f"partial argument {i}": value for i, value in enumerate(function.args)}
        referenced |= function.keywords
        function = function.func
    if inspect.ismethod(function):
        referenced |= {f"self.{name}": value for name, value in vars(function.__self__).items()}
        referenced["self"] = function.__self__
        function = function.__func__
    elif not inspect.isfunction(function) and hasattr(function, "__dict__"):
        referenced |= {f"self.{name}": value for name, value in vars(function).items()}
        function = type(function).__call__
    if inspect.isfunction(function):
        closure = inspect.getclosurevars(function)
        referenced |= closure.nonlocals | closure.globals
    modules = {name: value for name, value in referenced.items() if isinstance(value, torch.nn.Module)}
    inner = {id(sub) for module in modules.values() for sub in module.modules() if sub is not module}
    modules = {name: module for name, module in modules.items() if id(module) not in inner}
    unique_modules = {}
    for name, module in modules.items():
        if all(module is not seen for seen in unique_modules.values()):
            unique_modules[name] = module
    optimizers = {}
    for name, value in referenced.items():
        if isinstance(value, torch.optim.Optimizer) and all(value is not seen for seen in optimizers.values()):
            optimizers[name] = value
    return unique_modules, optimizers


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else _local(tensor).detach().clone()


@dataclasses.dataclass
class _Tracked:
    name: str
    live: torch.Tensor
    saved: torch.Tensor
    # Only for parameters (tensors whose .grad is compared): the .grad at snapshot time.
    is_parameter: bool
    saved_grad: torch.Tensor | None = None


class _Snapshot:
    """The state verify restores between and after the runs; things found while the step runs are added."""

    def __init__(self, models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer], stateful):
        self.tracked: dict[int, _Tracked] = {}
        self.found_leaves = 0
        self.optimizers: dict[int, tuple[str, torch.optim.Optimizer, dict]] = {}
        self.found_optimizers: list[str] = []
        self.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in stateful]
        self.rng = _RngState.capture()
        for prefix, model in models.items():
            self._add_model(model, f"{prefix}." if prefix else "")
        for name, optimizer in optimizers.items():
            self.add_optimizer(optimizer, name or "optimizer")

    def _add_model(self, model: torch.nn.Module, prefix: str) -> None:
        for name, param in model.named_parameters():
            self.add_tensor(param, prefix + name, is_parameter=True)
        for name, buffer in model.named_buffers():
            self.add_tensor(buffer, prefix + name, is_parameter=False)
        # TorchRec's sharded tables: their local shards, which the fused optimizer updates in backward.
        for name, value in model.state_dict(keep_vars=True).items():
            for index, shard in enumerate(getattr(value, "local_shards", list)()):
                self.add_tensor(shard.tensor, f"{prefix}{name} (local shard {index})", is_parameter=False)

    def add_tensor(self, tensor: torch.Tensor, name: str, is_parameter: bool) -> None:
        if id(tensor) in self.tracked:
            return
        self.tracked[id(tensor)] = _Tracked(
            name, tensor, _clone(tensor), is_parameter, _clone(tensor.grad) if is_parameter else None
        )

    def add_leaf(self, leaf: torch.Tensor) -> None:
        """A leaf the step's backward accumulates into that no model holds: snapshotted before accumulation."""
        if id(leaf) not in self.tracked:
            self.found_leaves += 1
            name = f"<leaf {self.found_leaves}: {_kind(leaf)}"
            # Such as the flat weights of TorchRec's fused tables, whose per-table views a model names.
            storage = _local(leaf).untyped_storage().data_ptr()
            owner = next(
                (
                    t.name
                    for t in self.tracked.values()
                    if storage and _local(t.live).untyped_storage().data_ptr() == storage
                ),
                None,
            )
            self.add_tensor(leaf, name + (f", the storage of {owner}>" if owner else ">"), is_parameter=True)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, name: str | None = None) -> None:
        if id(optimizer) in self.optimizers:
            return
        if name is None:
            name = f"<optimizer {len(self.found_optimizers) + 1}: {type(optimizer).__name__}>"
            self.found_optimizers.append(name)
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.add_leaf(param)
        self.optimizers[id(optimizer)] = (name, optimizer, copy.deepcopy(optimizer.state_dict()))

    def parameters(self) -> list[_Tracked]:
        return [tracked for tracked in self.tracked.values() if tracked.is_parameter]

    def name_of(self, tensor: torch.Tensor) -> str:
        tracked = self.tracked.get(id(tensor))
        return tracked.name if tracked is not None else f"<untracked {list(tensor.shape)}>"

    def restore(self, rng: bool) -> None:
        with torch.no_grad():
            for tracked in self.tracked.values():
                _local(tracked.live).copy_(tracked.saved)
                if tracked.is_parameter:
                    _restore_grad(tracked.live, tracked.saved_grad)
        for _, optimizer, state in self.optimizers.values():
            optimizer.load_state_dict(copy.deepcopy(state))
        for obj, state in self.stateful:
            obj.load_state_dict(copy.deepcopy(state))
        if rng:
            self.rng.restore()

    def discovery_notes(self) -> list[str]:
        notes = []
        if self.found_leaves:
            notes.append(
                f"{self.found_leaves} leaf tensor(s) received gradients without being in models=: "
                "snapshotted on first use, named <leaf k>"
            )
        if self.found_optimizers:
            notes.append(f"optimizer(s) not in optimizers= snapshotted on their first step: {self.found_optimizers}")
        return notes


def _restore_grad(param: torch.Tensor, saved: torch.Tensor | None) -> None:
    # In place where the shapes allow: DDP's gradient_as_bucket_view makes .grad a view of its bucket.
    if saved is None:
        param.grad = None
    elif param.grad is not None and _local(param.grad).shape == saved.shape and not param.grad.is_sparse:
        _local(param.grad).copy_(saved)
    else:
        param.grad = saved.clone()
