"""On every rank of a sweep, before its points: T_comm (``calibrate_t_comm``) and one dense layer's backward
(``dense_layer_s``), which set each point's depth (``sweep.sweep_depth``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .exposure import exposed_of_each_step
from .sweep import SweepConfig

# T_comm: how long stock's backward waits for the collective with nothing to hide it behind (calibrate_t_comm),
# the median of this many steps after a few untimed ones (a process's first all_to_alls are slower: in moe_sync
# the first library's read 1.5-1.8x the later ones'). ~2 s.
WARMUP_STEPS = 3
COMM_CALIBRATION_REPS = 15
# Seconds of calls one dense layer's calibration takes at least (dense_layer_backward_s).
CALIBRATION_S = 2.0
# A dense layer's backward is calibrated on this many layers one after the other: calls of 8-20 ms here, not 1-2.
CALIBRATION_LAYERS = 8


def calibrate_t_comm(step: Callable[[], dict[str, float]]) -> list[float]:
    """T_comm's samples, on every rank (the same on each): WARMUP_STEPS untimed calls of ``step``, then
    COMM_CALIBRATION_REPS timed ones, each step's exposed communication read as the sweep's points read theirs
    (exposure.exposed_past_the_slowest_rank). ``step()`` runs stock's backward of the model with no dense layer, the
    ranks started together, and returns its ``backward_s`` and ``blocked_s`` (``timing.timed_blocking``).

    Stock's wait where nothing can hide the collective, not the all_to_all timed alone: on the shaped veth the
    wait was 35-38 ms for 2 MiB each way in every run, loaded or not, while the all_to_all alone, back to back or
    between steps, took either ~36 or ~19 ms on the slower rank (both directions at the link's rate), and which of
    the two dominated changed from run to run (medians of 36, 28 and 24 ms between steps in three runs; 24 ms for
    25 back to back in a fourth, then 36-38 ms in its steps).
    """
    for _ in range(WARMUP_STEPS):
        step()
    steps = [step() for _ in range(COMM_CALIBRATION_REPS)]
    mine = torch.tensor([[s["backward_s"], s["blocked_s"]] for s in steps], dtype=torch.float64)
    every_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, mine)
    return exposed_of_each_step(
        [rank[:, 0].tolist() for rank in every_rank], [rank[:, 1].tolist() for rank in every_rank]
    )


def dense_layer_s(hidden: int, rows: int, config: SweepConfig) -> float:
    """On every rank: one dense layer's backward (``dense_layer_backward_s``, ``config.calibration_reps`` calls at
    least), the largest of the ranks' (all ranks build the same depths)."""
    measured = torch.tensor(
        [dense_layer_backward_s(hidden, rows, config.calibration_reps, CALIBRATION_S)], dtype=torch.float64
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return measured.item()


def dense_layer_backward_s(hidden: int, rows: int, reps: int, min_s: float) -> float:
    """Seconds of one Linear(hidden, hidden) + ReLU layer's backward at ``rows`` rows: the lower quartile of the
    backward calls of a stack of CALIBRATION_LAYERS such layers (after one untimed call), ``reps`` of them and as
    many more as ``min_s`` seconds take, over their number; this process's, timed while the other rank times its.

    A stack, not one layer: a median of 9 calls of 1-2 ms spans ~20 ms, and a moment of another process's load set
    the whole sweep's depths (one layer read 5.4 ms instead of 1.9 beside a pytest run). The lower quartile, not
    the median: with nothing else running, medians of 9 calls of the stack still read 1.57, 2.89 and 1.86 ms in
    three runs of recsys_torchrec (torch_ext's x1 point 0.99, 0.49, 0.90 with them). Seconds of calls, not a count:
    the lower quartile of 25 calls (~0.3 s) read 1.00, 1.04 and 1.36 ms for overlap's layer in three quiet runs
    whose sweeps' compute-only backward gave 1.00, 0.91 and 0.98 ms a layer, so a slow spell of a second can fill
    such a window; over 2 s it fills less than the three quarters the quartile needs.
    """
    stack = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(CALIBRATION_LAYERS))
    )
    x = torch.randn(rows, hidden)
    stack(x).sum().backward()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < reps or time.perf_counter() - started < min_s:
        loss = stack(x).sum()
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.quantiles(times, n=4, method="inclusive")[0] / CALIBRATION_LAYERS
