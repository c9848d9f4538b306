"""A compiled MoE block: torch.compile's own overlap against torch_ext's, on the shaped link.

On 2 ranks as 2 hosts on the shaped link (``harness.hosts.run_on_two_hosts``), an expert-parallel block whose token
exchange is PyTorch's functional ``all_to_all_single_autograd`` (a router, the dispatch, an expert, the combine),
beside a dense path, run compiled and eager:

  stock               eager, PyTorch's engine
  torch_ext           eager, torch_ext's engine, the all_to_all declared to a lane
                      (``run_in_lane(torch.ops._c10d_functional.all_to_all_single)``)
  compiled            ``torch.compile(model)``, Inductor's defaults, PyTorch's engine: the backward is one node
  reordered           the same, its backward under compiled autograd (one graph, so that Inductor can move the
                      all_to_alls in it), forward and backward with the reorder passes Inductor's config
                      recommends (``reorder_for_compute_comm_overlap`` and ``REORDER_PASSES``)
  torch_ext_compiled  ``torch.compile(model, backend=torch_ext.compile_backend(), fullgraph=True)`` on torch_ext's
                      engine with the lane: the graph split at each all_to_all, the compute compiled by Inductor
  hand_compiled       torch_ext's engine with the lane, the dense path and the expert each compiled by hand
                      (``torch.compile(module)``), the all_to_alls eager: what a user could do without the backend
                      (a full run only)

and, for the efficiency by step time, each setup's compute-only backward (the all_to_all replaced by the identity):
``compute`` (eager) and ``compiled_compute`` (Inductor; the split backend hands a graph with no collective to
Inductor whole, so it is the compiled variants' compute-only step too).

T_comm, the sweep over dense/comm ratios and the efficiency (1 - exposed / T_comm, the exposed time read from the
ranks' blocked time) are moe_sync's (``harness``). Before timing, torch_ext's gradients must be ``torch.equal`` to
stock's: eager against eager, and torch_ext_compiled against PyTorch's engine on the same compiled model. A quick
run times every variant at the headline point only (x1).

    python -m benchmarks.compile_overlap [--quick] [--reps N] [--ratios 0.5,1,2] [--network ...] [--out CSV]
"""

WORLD_SIZE = 2
# moe_sync's sizes: 2048 tokens x 256 floats each way (2 MiB), the dense path on 1024 rows (~3 ms a layer here).
CAPACITY = 2048
DIM = 256
DENSE_ROWS = 1024
MAX_DENSE_LAYERS = 64
ENGINE_VARIANTS = ("stock", "torch_ext", "compiled", "reordered", "torch_ext_compiled", "hand_compiled")
COMPUTE_VARIANTS = ("compute", "compiled_compute")
TIMED_VARIANTS = (*COMPUTE_VARIANTS, *ENGINE_VARIANTS)
# Each variant's compute-only step, for its efficiency by step time.
COMPUTE_OF = {
    "stock": "compute",
    "torch_ext": "compute",
    "compiled": "compiled_compute",
    "reordered": "compiled_compute",
    "torch_ext_compiled": "compiled_compute",
    "hand_compiled": "compiled_compute",
}
# A quick run times every variant of the comparison at one point (QUICK_RATIOS), since each point compiles its
# setups anew; hand_compiled explains a figure (docs/benchmarks.md) rather than being one to beat, and costs two
# more compiles.
QUICK_LEFT_OUT = ("hand_compiled",)
