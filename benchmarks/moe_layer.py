"""The MoE layer that microbatch_overlap (its pre-path shape) and trainer_overlap run a microbatch through: a dense
pre-path, the dispatch all_to_all, an expert, the combine all_to_all, and a dense path from the pre-path's output
beside the expert's branch, as a shared expert is. Each benchmark gives its own sizes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .moe_libraries import no_all_to_all


def dense(dim: int, layers: int) -> nn.Sequential:
    """``layers`` Linear + ReLU layers of width ``dim`` (the layer harness/calibration.py times)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])


class MoELayer(nn.Module):
    """One microbatch's layer: the pre-path (a projection, then ``pre_layers`` dense layers), dispatch, expert,
    combine, and ``post_layers`` dense layers from the pre-path's output after it; its loss is divided by
    ``microbatches``, as gradient accumulation over that many does. With no dense layer, the all_to_alls have
    nothing to hide behind (T_comm's calibration)."""

    def __init__(self, all_to_all: Callable, dim: int, pre_layers: int, post_layers: int, microbatches: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        self.microbatches = microbatches
        # The projection makes the dispatched tokens need a gradient: the dispatch's backward all_to_all runs.
        self.pre = nn.Sequential(nn.Linear(dim, dim), dense(dim, pre_layers))
        self.expert = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.gate = nn.Linear(dim, 1)
        self.head = nn.Linear(dim, 1)
        self.post = dense(dim, post_layers)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else no_all_to_all
        group = dist.group.WORLD
        hidden = self.pre(tokens)
        returned = all_to_all(group, self.expert(all_to_all(group, hidden)))
        loss = self.head(returned * torch.sigmoid(self.gate(hidden))).sum()
        if self.post:
            loss = loss + self.post(hidden).sum()
        return loss / self.microbatches


def moe_layer(all_to_all: Callable, dim: int, dense_layers: int, microbatches: int) -> MoELayer:
    """The layer with ``dense_layers`` dense layers, half of them (rounded down) in the pre-path."""
    pre_layers = dense_layers // 2
    return MoELayer(all_to_all, dim, pre_layers, dense_layers - pre_layers, microbatches)
