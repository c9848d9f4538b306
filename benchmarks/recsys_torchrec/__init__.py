"""TorchRec's own embedding all_to_all in backward: stock PyTorch against torch_ext, on 2 ranks as 2 hosts.

The model is TorchRec's DLRM (``torchrec.models.dlrm.DLRM``): an EmbeddingBagCollection of TABLES
tables sharded table-wise over the 2 ranks by ``DistributedModelParallel``, with the fused CPU kernel
(the tables' SGD update runs inside their backward), a dense arch of the depth the sweep asks for and an over
arch.
TorchRec writes its collectives by hand as Req/Wait pairs of autograd Functions
(``torchrec/distributed/comm_ops.py``): in backward, ``All2All_Pooled_WaitBackward`` launches the pooled
embeddings' gradient all_to_all and ``All2All_Pooled_ReqBackward`` waits for it. Stock runs them back to
back after the dense arch, so the communication is exposed. torch_ext knows these classes
(``torch_ext.collectives``): it drives to the launch first and runs the wait as late as the nodes reading
its result allow, so the dense arch's backward runs while the bytes move. Nothing TorchRec-specific is
written by the user: ``torch_ext.enable()`` (here ``with torch_ext.enable():`` around the variant's steps).

Variants, alternating within every repetition, the slowest rank's time counting:

  stock      the training step on PyTorch's engine
  torch_ext  the same step under ``torch_ext.enable()``
  comm       the backward all_to_all alone: ``dist.all_to_all_single`` of the same pooled gradient
             bytes, between the steps (reported; T_comm is stock's wait with no dense layer, below)

Each step is timed as a whole (forward, backward, the dense SGD update; the tables' update is fused into
their backward) and its backward alone, with the time its thread was blocked in it (``harness.timing.timed_blocking``:
in the wait node, ``All2All_Pooled_ReqBackward``, where the step blocks on the transfer). The exposed
communication is the slowest rank's backward minus the longest time any rank spent unblocked in it
(``harness.exposure.exposed_past_the_slowest_rank``: a rank's wait for the other to arrive is not communication), as
overlap and moe_sync read it; overlap efficiency = 1 - exposed / T_comm: 0 when the whole transfer is
waited for, 1 when it had already arrived. T_comm is the same measure of stock's backward in a DLRM with no
dense layer to hide the transfer behind, the median of 15 steps (harness.calibration.calibrate_t_comm).

The dense arch is not wrapped in DistributedDataParallel (``init_data_parallel=False``): DDP's all_reduce of its
gradients would share the link with the all_to_all and set the dense arch's backward by its traffic.

Sizes: each rank looks up BATCH samples; the pooled gradient each rank sends the other is BATCH * (TABLES / 2) * DIM
floats (2 MiB with the defaults, 36-38 ms on the shaped link). The dense arch's backward is swept over multiples of
T_comm (``--ratios``; full 0.25,0.5,1,1.5,2, quick 1 alone: the headline's point): the script measures T_comm and
one Linear(HIDDEN, HIDDEN) layer's backward (both ranks agree on the larger) and gives the dense arch the depth that
makes its backward ``ratio`` x T_comm. Each point also reports the ratio it measured: its compute over T_comm, the
compute being stock's backward less its exposed time, repetition by repetition (there is no communication-free
variant of a sharded TorchRec model). The ideal efficiency is min(1, that): no more communication can hide than
there is compute beside it. Beside each torch_ext efficiency stands one by step time: 1 - (its backward - the same
repetition's stock compute) / T_comm.

The ranks run as two hosts (``harness.hosts.run_on_two_hosts``: two network namespaces joined by a veth shaped
to 1 Gbit/s, each rank started by torchrun in its own), falling back as overlap says. Before timing,
one step of each engine must give torch.equal dense gradients, losses and local tables after the fused
update at every sweep point, or the script fails. With ``--timeline PNG`` rank 0 draws one traced torch_ext
backward at the point nearest ratio 1.

    python -m benchmarks.recsys_torchrec [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...]
        [--timeline PNG] [--out CSV]
"""

WORLD_SIZE = 2
TABLES = 8
ROWS = 20_000
DIM = 256
BATCH = 512
DENSE_FEATURES = 256
HIDDEN = 256
# One dense layer's backward is 1-2 ms here against a ~36 ms transfer: the x2 point needs up to ~72 layers.
MAX_DENSE_LAYERS = 160
LEARNING_RATE = 0.01
VARIANTS = ("stock", "torch_ext", "comm")
ENGINE_VARIANTS = ("stock", "torch_ext")
