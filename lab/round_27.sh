#!/usr/bin/env bash
# Issue 27's device round: host cost per call against the tree before it (_old/, in one process),
# the GPU tests of the front door and RoPE, the RoPE bandwidth gate, compute-sanitizer on RoPE.
# Before the call, here: echo /_old/ >> .git/info/exclude; mkdir -p _old && git archive 40c43ca |
# tar -x -C _old; then run it with carry=["_old"]. SUITE= picks other test files (the whole GPU
# suite: tests/test_cuda_*.py tests/test_layouts.py, about 6 minutes on 15 workers).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -d _old ] && timeout 240 python3 lab/call_cost_ab.py _old 2>&1 | tee "$OUT/cost_ab.txt"
FERRO_FAILURE_LOG="$OUT/failures.txt" timeout "${SUITE_S:-200}" python3 -m pytest -q -n 15 -p no:cacheprovider \
  ${SUITE:-tests/test_cuda_plans.py tests/test_cuda_rope.py tests/test_cuda_torch_rope.py tests/test_cuda_torch.py tests/test_cuda_attention.py tests/test_cuda_backward.py} \
  2>&1 | tee "$OUT/gpu_suite.txt" | tail -4
head -c 3000 "$OUT/failures.txt" 2>/dev/null
timeout 150 python3 benchmarks/compare.py --cases rope --json "$OUT/rope.json" 2>&1 | tee "$OUT/rope.txt" | tail -28
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool python3 lab/sanitize_rope.py 2>&1 | tail -3 | tee -a "$OUT/sanitize.txt"
done
