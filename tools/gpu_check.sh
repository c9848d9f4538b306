#!/usr/bin/env bash
# Everything that needs CUDA, in one run of under 8 minutes, with every result in one folder: for a session
# that is lent a machine with a GPU (CI has none, so these only skip there).
#
#   tools/gpu_check.sh [OUT_DIR]        # default: results/gpu_check-<UTC time>
#
# 1. the stream tests on CUDA (tests/test_accelerator_streams.py picks CUDA when there is one), both engines;
# 2. the Triton kernels compiled (tests/test_kernels.py's CUDA tests: no TRITON_INTERPRET);
# 3. benchmarks/kernels.py, python -m benchmarks.kernels (the Triton kernels against torch's foreach ops);
# 4. the accelerator collectives on NCCL (tests/distributed/test_accelerator_collectives.py picks NCCL when there
#    is a GPU): a lane, a deferred wait and overlap across microbatches, 2 ranks, each on GPU rank % count (NCCL
#    may refuse two ranks on one GPU; the log says so);
# 5. python -m torch_ext bench --quick on this machine's CPUs (the comparison against stock).
# Each step's output is in its own file; a failed step does not stop the others; the exit code is the number of
# failed steps. Assumes the README's install has run (the machine's own torch, if it has a CUDA build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
unset TRITON_INTERPRET

failed=0
step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "+ $name: $*" | tee -a "$OUT/steps.txt"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "  $name: exit $rc in $((SECONDS - start)) s; last line: $(tail -n 1 "$OUT/$name.txt")" | tee -a "$OUT/steps.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
    python -c "import triton; print('triton', triton.__version__)"
} >"$OUT/machine.txt" 2>&1

step streams 120 python -m pytest -v -p no:cacheprovider tests/test_accelerator_streams.py
step triton_compiled 120 python -m pytest -v -p no:cacheprovider tests/test_kernels.py -k cuda
step kernels_bench 90 python -m benchmarks.kernels --out "$OUT/kernels.csv"
step nccl_collectives 120 python -m pytest -v -p no:cacheprovider tests/distributed/test_accelerator_collectives.py
step bench_quick 240 python -m torch_ext bench --quick --out "$OUT/bench"

echo "$failed step(s) failed; results in $OUT" | tee -a "$OUT/steps.txt"
exit "$failed"
