"""Overlap across microbatches (``torch_ext.overlap_microbatches``) on synchronous MoE all_to_alls: step time,
exposed communication and the activations held, against the stock loop, the lane alone, and the least exposure an
overlapped order of the same work could reach on this machine.

A training step here is gradient accumulation over N_MICROBATCHES microbatches and one SGD step, on 2 ranks as 2
hosts on the shaped link (``harness.hosts.run_on_two_hosts``), for two shapes of model (``SHAPES``):

  pre-path        one expert-parallel layer (CSV cases ``<library> x<ratio>``). A microbatch's forward: a dense
                  pre-path (a projection and Linear + ReLU layers over its tokens), the dispatch all_to_all, the
                  expert, the combine all_to_all, and a dense path after it (Linear + ReLU layers from the
                  pre-path's output, beside the expert's branch, as a shared expert is)
  dispatch-first  two MoE blocks and a head (cases ``<library> dispatch-first x<ratio>``), each block's forward
                  issuing its dispatch all_to_all before any dense compute, as many MoE models' do: a router
                  projection, the dispatch, the expert, the combine (gated by the projection), then a shared expert
                  of Linear + ReLU layers on the block's input, beside the routed path. A block's output is its
                  input plus both, a residual, so the second block reads values of the first's magnitude

The all_to_all is the library's synchronous ``_AllToAll``: Megatron-core's, or DeepSpeed's where only it is
installed. Its backward runs the gradient's all_to_all inside its node, so a MoE layer carries four all_to_alls a
microbatch, two in forward and two in backward: four a microbatch for pre-path, eight for dispatch-first.
Variants:

  compute             the stock loop with the all_to_alls replaced by the identity: the communication-free
                      reference
  compute_overlapped  the same communication-free microbatches under ``torch_ext.overlap_microbatches()``: the
                      compute on two threads, no collective at all; a part of the limit (below)
  stock               the stock loop, ``loss.backward()`` per microbatch on PyTorch's engine: every all_to_all
                      exposed
  lane                torch_ext's engine with ``torch_ext.run_in_lane(_AllToAll)``, the same sequential loop: the
                      backward's all_to_alls hide behind the dense path after (its backward runs beside them); the
                      forward's cannot
  overlap             the lane and ``torch_ext.overlap_microbatches()``: microbatch i's backward runs on the
                      backward thread while the caller runs microbatch i+1's forward, so each phase's all_to_alls
                      hide behind the other phase's compute (the forward's all_to_alls start once the backward's
                      have started)
  turns               the same with ``forward_collectives="in_turns_with_backward_collectives"``: the two phases'
                      all_to_alls take turns, the backward's first (pre-path: backward's combine gradient,
                      forward's dispatch, backward's dispatch gradient, forward's combine), so the forward's first
                      no longer waits for the backward's last, and the backward's k+1-th waits for the forward's
                      k-th
  twins               the same with ``forward_collectives="beside_backward_collectives"``: the backward's
                      all_to_alls go to a twin of their group (a gloo group of the same ranks), so neither phase's
                      wait for the other's

T_comm is how long stock waits for one microbatch's all_to_alls (forward and backward) with no dense layer, each
shape its own: that shape with no dense layer (``harness.calibration.calibrate_t_comm`` over one microbatch: its
blocked time, the median of 15 steps). The dense layers' backward per microbatch is swept over multiples of T_comm
(--ratios), split between the pre-path and the path after (dispatch-first: between the two blocks' shared experts);
their forward adds about half as much. (No efficiency against T_comm: a step's exposed communication measured as
below read 1.2-1.6 x N_MICROBATCHES x T_comm for stock, which is blocked time alone; the fraction of stock's exposed
at the same point is the comparison.)

Per point and repetition (the variants alternating, every metric the slower rank's): step time (zero_grad, the
microbatches, the SGD step); exposed communication = the step - the same repetition's ``compute`` step. For
stock and the lane, the exposure of each phase: the sum of the microbatches' forward (backward) times -
compute's. The overlap's phases run at once, so it has the total only. ``compute_overlapped``'s step - the same
repetition's ``compute`` step is what two threads cost the compute. Reported as medians, and the exposed
communication as a fraction of stock's at the same point.

The limit, per point (``exposure_limit``, which derives it): the least exposed communication an order that runs
two microbatches at once, the only kind that can hide a synchronous forward all_to_all, could reach on this
machine. The larger of two bounds, from parts measured at the point: the compute on two threads plus the edges
(microbatch 0's forward all_to_alls, with no backward beside them, and the last microbatch's backward ones, with
no forward after them: about 1 / N_MICROBATCHES of stock's exposure) plus the CPU time the communication itself
takes (stock's above its compute step, which any order of the same collectives spends on a rank's one core), and
the link's time for all the step's bytes (N_MICROBATCHES x T_comm), which at low compute outlasts the compute
beside it. Each rule (lane, overlap, turns, twins) is then read as the fraction of the gap between stock's exposure
and the limit it closes (``gap_closed``): 0 at stock's, 1 at the limit. On this 2-core machine two compute threads
per rank cost more than one, which the limit counts.

Traces (--timeline PNG): after timing the point nearest x1, each rank runs TRACED_STEPS more steps of each
overlapped rule it timed, under ``torch_ext.trace()`` with the forward thread's waits recorded (its all_to_alls,
the hand-overs, the close), and the table splits each rank's traced exposure (``step_split``): the time some
compute thread (the forward's or the backward's) was busy above the rank's compute step, and the time both waited,
at the leading edge, the trailing edge and in between. Only the last is time an order of the same work could
still fill. Beside it, the compute threads' time on a core and ready with none free (the kernel's counts,
``/proc/self/task/*/schedstat``), and the other threads' time on a core (gloo's, the lanes': the process's CPU
time less the compute threads').
``trace +``, the traced step less the rank's untraced median, shows whether tracing changed the step. Rank 0
draws its first traced step of each rule.

CPU time: each variant's step also records the CPU time its process used (``time.process_time``, every thread),
and the table's ``cpu +ms`` is that above the same repetition's ``compute`` step's. With two ranks on two cores, a
rank has about one core: CPU time a variant adds cannot hide behind anything, only waiting can; the summary
prints that part of the exposure.

A quick run (--quick) times pre-path alone, without turns, twins and compute_overlapped (``QUICK_SHAPES``,
``QUICK_LEFT_OUT``), so it prints no limit; a full run times every shape and variant. --shapes picks the shapes;
--ratios 1 --dense-layers N times one point at a fixed depth, so that runs compare the same work: T_comm's
calibration on the shaped link reads one of two rates from run to run (dispatch-first: 62 or 129 ms a
microbatch in two runs minutes apart, the depth at x1 16 or 31 layers), though stock's exposure at either depth
read the same (741 and 750 ms a step).

The figures (each rule's runs, what was traced, the CPU costs) are in docs/benchmarks.md, "Overlap across
microbatches", and docs/guides/moe.md, with the runs that made them.

Peak memory: there are no allocator statistics on CPU, so one untimed step per variant counts the activations
held at once: a saved-tensors pack hook tallies the bytes of every distinct storage autograd saved (parameters and
the microbatches' inputs left out), each until the last saved reference to it is freed; the peak of that sum
over the step, against stock's, whose peak is one microbatch's graph (the overlap holds one more at most: the
next forward's, beside the backward in flight). Before timing, one step of each engine variant must give
torch.equal gradients to stock's.

    python -m benchmarks.microbatch_overlap [--quick] [--reps N] [--ratios 0.5,1,2] [--shapes pre-path,dispatch-first]
        [--dense-layers N] [--network ...] [--timeline PNG] [--out CSV]
"""

NAME = "microbatch_overlap"
WORLD_SIZE = 2
# Microbatches a step: 8, as gradient accumulation commonly uses; the edges that no order hides are about 1 / this
# of stock's exposure (exposure_limit). Quick runs' figures, with 4 and with 8, are in docs/benchmarks.md.
N_MICROBATCHES = 8
# Tokens each rank sends each expert per microbatch, and their width: 512 x 256 floats = 0.5 MiB to the other
# rank per all_to_all, four all_to_alls a MoE layer a microbatch.
CAPACITY = 512
DIM = 256
# Tokens of a microbatch on a rank (every dense layer reads them all).
ROWS = WORLD_SIZE * CAPACITY
# MoE blocks a microbatch in dispatch-first: more than one, so that a forward's all_to_alls also come after dense
# work (the first block's shared expert), as in a model of many.
DISPATCH_FIRST_BLOCKS = 2
# Dense layers a MoE layer at most (a shape with two has twice as many): a cap on the sweep's depth.
MAX_DENSE_LAYERS = 64
ENGINE_VARIANTS = ("stock", "lane", "overlap", "turns", "twins")
# The variants whose all_to_alls are the identity: no collective at all.
COMPUTE_VARIANTS = ("compute", "compute_overlapped")
# The variants that overlap microbatches, and their rule for the forward's collectives (compute_overlapped has none
# to order: the default).
OVERLAPPED_VARIANTS = {
    "compute_overlapped": "after_backward_collectives",
    "overlap": "after_backward_collectives",
    "turns": "in_turns_with_backward_collectives",
    "twins": "beside_backward_collectives",
}
TIMED_VARIANTS = ("compute", "compute_overlapped", *ENGINE_VARIANTS)
# The rules read against the limit: the fraction of the gap between stock's exposure and the limit each closes.
RULES = ("lane", "overlap", "turns", "twins")
# Left out of a quick run's timing. The turns rule, not the default (its bits are still checked): it was a fifth of
# a quick run's steps, and the default rule's figures are the quick run's claim. compute_overlapped, which only the
# limit reads: at x1 of a full run here (456eb1e) the compute step took 563 ms of the quick variants' 2894 ms a
# repetition, so it would add about a fifth to this benchmark's ~50 s quick run, where bench --quick (166-172 s) has
# 8-14 s left of its 3 minutes. A quick run prints no limit.
QUICK_LEFT_OUT = ("turns", "twins", "compute_overlapped")
# The variants whose forward and backward run one after the other, so that each phase has its own time.
PHASED_VARIANTS = ("compute", "stock", "lane")
# The table's variant column.
VARIANT_WIDTH = max(len(variant) for variant in TIMED_VARIANTS)
# The aims the summary measures against (the issue's): at the headline point, the overlap's exposed communication
# at most this fraction of stock's, and its step at most this fraction of stock's.
AIM_EXPOSED_FRACTION = 0.30
AIM_STEP_RATIO = 0.80
# Steps traced per rule at the traced point: the split's parts are medians over them. Five: one step's exposure is
# not a figure to read (twins at x1 of dispatch-first, 10 timed steps: p20-p80 333-429 ms about a median of 391),
# and each rule's steps add about 8 s to a run.
TRACED_STEPS = 5
