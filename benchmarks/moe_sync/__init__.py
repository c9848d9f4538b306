"""A synchronous MoE all_to_all (Megatron-core's and DeepSpeed's ``_AllToAll``): priority alone, and the lane.

Megatron-core and DeepSpeed write their expert all_to_all as an autograd Function whose backward runs the
gradient's all_to_all synchronously, inside its node. On 2 ranks as 2 hosts on the shaped link
(``harness.hosts.run_on_two_hosts``), an expert-parallel layer (tokens dispatched to one expert per rank at a fixed
capacity, combined back) beside a dense path, for each library:

  compute    stock's backward of the same layer with the all_to_all replaced by the identity (no communication)
  stock      the backward on PyTorch's engine: dense path first, then the all_to_all
  torch_ext  torch_ext with the _AllToAll undeclared, as a new user gets it: stock's order on its engine
  priority   torch_ext with the _AllToAll registered as a launch (torch_ext.register_collective_backward): the
             all_to_all first, still blocking the engine
  lane       torch_ext with torch_ext.run_in_lane(_AllToAll): the all_to_all dispatched first to its group's
             lane, the dense path run beside it
  checked    the lane with the collective order check on (torch_ext.check_collective_order): its cost

T_comm is how long stock's backward waits for the all_to_all in the same layer with no dense path, the median of 15
steps (``harness.calibration.calibrate_t_comm`` says why not the all_to_all timed alone). The dense path's backward
is swept over multiples of T_comm (--ratios). At each point, per repetition, each rank's backward thread's blocked
time is measured (``harness.timing.timed_blocking``: waiting for the all_to_all inside the node, or for the lane's
result where the expert's backward needs it); exposed communication = the slowest rank's backward minus the longest
time any rank spent unblocked in it (``harness.exposure.exposed_past_the_slowest_rank``: a rank's wait for the other
to arrive is not communication), and overlap efficiency = 1 - exposed / T_comm. Beside it, the backward's excess
over the communication-free ``compute`` variant (``over_compute_ms``): what the communication costs the step in all,
the gap of two noisy times, and from it the efficiency by step time, 1 - that / T_comm (``step_efficiency``). Each
point reports the ratio it measured, the ``compute`` variant's backward over T_comm, and its ideal is min(1, that).
A quick run times one library and leaves out ``torch_ext`` and ``priority`` (QUICK_LEFT_OUT). Reported per library
and ratio: backward and step time (forward, backward and an SGD step) as medians of the slower rank, and the
efficiency. Before timing, one backward of each engine variant must give torch.equal gradients to stock's.

    python -m benchmarks.moe_sync [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...] [--out CSV]
"""

WORLD_SIZE = 2
# Tokens each rank sends each expert, and their width: 2048 x 256 floats = 2 MiB to the other rank.
CAPACITY = 2048
DIM = 256
# The dense path reads this many of the tokens: one of its layers' backward is then ~3.2 ms here, a tenth of
# T_comm (~36 ms), fine enough a step for the sweep (all 4096 rows made a layer ~19 ms, the points 0.5 apart).
DENSE_ROWS = 1024
MAX_DENSE_LAYERS = 64
ENGINE_VARIANTS = ("stock", "torch_ext", "priority", "lane", "checked")
TIMED_VARIANTS = ("compute", *ENGINE_VARIANTS)
# Left out of a quick run's timing (their bits are still checked): torch_ext's engine without the lane, and with
# priority alone. Neither can hide the transfer (the node waits inside its collective either way): both read -0.08
# to 0.03 at every point of an Intel Xeon's quick run, like stock, and they were a third of its 148 s. A full run
# times them.
QUICK_LEFT_OUT = ("torch_ext", "priority")
