"""microbatch_overlap's models, one microbatch's forward each: pre-path's MoE layer (benchmarks/moe_layer.py, which
trainer_overlap runs too), and dispatch-first's blocks (.shapes declares the shapes that build them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..moe_layer import MoELayer, dense, moe_layer
from ..moe_libraries import no_all_to_all
from . import DIM, DISPATCH_FIRST_BLOCKS, N_MICROBATCHES


def _dense(layers: int) -> nn.Sequential:
    return dense(DIM, layers)


class DispatchFirstBlock(nn.Module):
    """One MoE block whose forward issues its dispatch all_to_all before any dense compute: a router projection,
    the dispatch, the expert, the combine gated by the projection, then a shared expert of ``shared_layers`` dense
    layers on the block's input. Its output is its input plus the routed path's and the shared expert's."""

    def __init__(self, shared_layers: int) -> None:
        super().__init__()
        # The projection makes the dispatched tokens need a gradient: the dispatch's backward all_to_all runs.
        self.router = nn.Linear(DIM, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.gate = nn.Linear(DIM, 1)
        self.shared = _dense(shared_layers)

    def forward(self, tokens: torch.Tensor, all_to_all: Callable) -> torch.Tensor:
        group = dist.group.WORLD
        routed = self.router(tokens)
        returned = all_to_all(group, self.expert(all_to_all(group, routed)))
        # The residual keeps the second block's input at the first's magnitude: the routed path adds at most 1 a
        # value (tanh, gated), the shared expert's Linear + ReLU layers shrink what they read.
        output = tokens + returned * torch.sigmoid(self.gate(routed))
        if self.shared:
            output = output + self.shared(tokens)
        return output


class DispatchFirstModel(nn.Module):
    """dispatch-first's model: DISPATCH_FIRST_BLOCKS ``DispatchFirstBlock``s, their ``dense_layers`` split between
    their shared experts, and a head. With no dense layer, the all_to_alls have nothing to hide behind (T_comm's
    calibration)."""

    def __init__(self, all_to_all: Callable, dense_layers: int) -> None:
        super().__init__()
        self.all_to_all = all_to_all
        per_block = [dense_layers // DISPATCH_FIRST_BLOCKS] * DISPATCH_FIRST_BLOCKS
        per_block[-1] += dense_layers % DISPATCH_FIRST_BLOCKS
        self.blocks = nn.ModuleList(DispatchFirstBlock(layers) for layers in per_block)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, communicate: bool = True) -> torch.Tensor:
        all_to_all = self.all_to_all if communicate else no_all_to_all
        hidden = tokens
        for block in self.blocks:
            hidden = block(hidden, all_to_all)
        return self.head(hidden).sum() / N_MICROBATCHES


def pre_path_model(all_to_all: Callable, dense_layers: int) -> MoELayer:
    return moe_layer(all_to_all, DIM, dense_layers, N_MICROBATCHES)
