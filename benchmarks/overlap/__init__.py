"""Overlap of a backward all_to_all with the rest of backward: stock PyTorch against torch_ext.

The scenario is a recommendation model's step on 2 gloo ranks:

  sparse  embedding lookup -> all_to_all_single -> SPARSE_LAYERS cheap per-row layers -> pooled
  dense   an MLP (Linear(HIDDEN, HIDDEN) + ReLU) of the depth the sweep asks for, created after the sparse part
  over    concat(sparse, dense) -> Linear -> ReLU -> Linear -> sum

In backward, stock runs ready nodes by descending sequence number, so after the overarch it runs the
whole dense MLP (created later) before the sparse layers, and only then the all_to_all's backward,
whose communication is exposed at the end of the step. Boosting the all_to_all's node with
``grad_fn._set_sequence_nr`` (PyTorch PR #114120) does not help here: the node is not ready until
the sparse layers between it and the loss have run, and they keep their order. torch_ext propagates
the collective's automatic priority to every node on the path from the loss, launches the
all_to_all, runs the dense MLP while it is in flight and waits only at the embedding's backward.

Variants, each timed as the backward call alone (forward, which waits for its own all_to_all, is
not timed), the slowest rank's time counting for the step:

  stock              PyTorch's functional all_to_all (``all_to_all_single_autograd``), stock engine
  stock+seq_nr       the same, with the all_to_all's node boosted by ``_set_sequence_nr``
  torch_ext          ``torch_ext.ops.all_to_all_single`` on torch_ext's engine (automatic priority,
                     wait at first use)
  torch_ext(funcol)  PyTorch's functional all_to_all on torch_ext's engine: priority alone, the
                     functional op still waits inside its node
  torch_ext(funcol lane)  the same, its op declared with ``torch_ext.run_in_lane``: the node runs on its
                     group's lane beside the dense MLP
  compute            the same graph with the all_to_all replaced by a local copy (no communication),
                     stock engine: the compute of stock and stock+seq_nr
  compute(torch_ext) the same on torch_ext's engine: the compute of torch_ext and torch_ext(funcol)
                     (torch_ext's engine alone ran this graph's backward 2-7% faster than stock's)
  comm               the backward all_to_all alone, between the steps (reported; T_comm is stock's
                     wait with no dense layer: harness.calibration.calibrate_t_comm)

The all_to_all sends ``--payload-mib`` MiB to the other rank. The dense MLP's backward is swept over multiples of
T_comm (``--ratios``; full 0.25,0.5,1,1.5,2, quick 1 alone: the headline's point): the script measures T_comm and
one dense layer's backward (both ranks agree on the larger) and builds the depth that makes the dense backward
``ratio`` x T_comm. At each point, per repetition, each rank's backward thread's blocked time is measured (waiting
for the all_to_all's bytes: ``harness.timing.timed_blocking``); exposed communication = the slowest rank's backward
minus the longest time any rank spent unblocked in it (``harness.exposure.exposed_past_the_slowest_rank``: a rank's
wait for the other to arrive is not communication), and overlap efficiency = 1 - exposed / T_comm (stock's wait with
no dense layer, read the same way): 1 when the communication is completely hidden, 0 when it is fully exposed.
Beside it, the backward's excess over its engine's compute variant (``over_compute_ms``): what the communication
costs the step in all, noisier, and from it the efficiency by step time, 1 - that / T_comm (``step_efficiency``).
Each point reports the ratio it measured, stock's compute variant's backward over T_comm, and its ideal is min(1,
that): no more communication can hide than there is compute beside it (the sweep asks for a ratio of dense layers,
and the rest of backward computes too). A quick run leaves out ``stock+seq_nr`` and ``torch_ext(funcol)``
(QUICK_LEFT_OUT).

On this machine's loopback, gloo's transfer is kernel memcpy on the same two cores the ranks compute
on, so nothing can overlap (docs/design.md, "Measuring overlap on this machine"). A real NIC moves bytes
without the CPU; to model one, the ranks run as two hosts (``harness.hosts.run_on_two_hosts``): two network
namespaces joined by a veth pair shaped to 1 Gbit/s with HTB, each rank started by ``torchrun
--nnodes 2 --rdzv-backend c10d`` in its own, as on two machines (needs root, iproute2 and util-linux).
What cannot be made falls back, said in the log and in the CSV's size column: to one namespace with a
shaped loopback, then to plain loopback, where no engine can show overlap.

Started by torchrun itself (on two real machines, README "Across machines"), the script is one rank:
rank 0 prints the table and writes the CSV.

With ``--timeline PNG``, after timing the point nearest ratio 1, both ranks run one more backward of stock
and one of torch_ext under a tracer (stock: ``torch.profiler``, converted by ``stock_backward_events``; torch_ext:
``torch_ext.trace()``), and rank 0 draws rank 0's two timelines one above the other with
``torch_ext.tracing.plot_timelines`` and writes their events beside the PNG (same name, ``.json``).

    python -m benchmarks.overlap [--quick] [--reps N] [--ratios 0.5,1,2] [--payload-mib M]
        [--network two-hosts|one-namespace|loopback] [--timeline PNG] [--out CSV]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..harness.sweep import SweepConfig

WORLD_SIZE = 2

BATCH = 256
FEATURES = 16  # embedding lookups per sample
# One dense layer's backward is ~1 ms here (2 ms with the other rank computing beside it), 1/20-1/40 of the
# 2 MiB all_to_all's ~40 ms: fine steps for the sweep. With 1024 (17-35 ms a layer) the x0.5 point was one
# layer, and the calibrated depth of the one-point benchmark jumped between 1 and 3 layers between runs.
HIDDEN = 256
SPARSE_LAYERS = 3
MAX_DENSE_LAYERS = 240
COLLECTIVE_VARIANTS = ("stock", "stock+seq_nr", "torch_ext", "torch_ext(funcol)", "torch_ext(funcol lane)")
VARIANTS = (*COLLECTIVE_VARIANTS, "compute", "compute(torch_ext)", "comm")
# Left out of a quick run's timing: the sequence-number boost and the functional all_to_all on torch_ext's engine
# without its lane. Neither can hide the transfer (stock's order keeps the boosted node behind the sparse layers; the
# functional op waits inside its node), and each read stock's efficiency within 0.15 at every point of every run in
# docs/benchmarks.md and on an Intel Xeon; a full run times them.
QUICK_LEFT_OUT = ("stock+seq_nr", "torch_ext(funcol)")
# The variants run on torch_ext's engine; each variant's compute-only baseline is the compute variant on its engine.
ON_TORCH_EXT = ("torch_ext", "torch_ext(funcol)", "torch_ext(funcol lane)", "compute(torch_ext)")


@dataclass(frozen=True)
class Config(SweepConfig):
    # The timeline_png, if any, draws stock's and torch_ext's backward.
    payload_mib: float

    @property
    def embedding_dim(self) -> int:
        # Half of every rank's lookup rows go to the other rank: rows * dim * 4 bytes / 2 = payload.
        rows = BATCH * FEATURES
        return max(8, round(self.payload_mib * 2**20 * 2 / 4 / rows))


def compute_of(variant: str) -> str:
    """The compute variant whose backward, on the same engine, is ``variant``'s without communication."""
    return "compute(torch_ext)" if variant in ON_TORCH_EXT else "compute"
