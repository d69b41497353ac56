#!/usr/bin/env bash
# A session's second device call (~590 s), after lab/round_open.sh on the same warm machine
# (carry ["_seam"]): issue 25's gate cases of benchmarks/compare.py on the candidate tree, the
# padded-wgmma probe (lab/pad_probe.py), then the GPU test files the first call left unrun plus
# those outside the triage's list (model coverage, flash_attn, context parallel), 15 workers.
# FILES= overrides the test files.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$SECONDS
cd _seam || exit 2
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${GATE_S:-300}" python3 benchmarks/compare.py --dtype bfloat16,float16 \
  --cases "${CASES:-s1024-,s4096-,s16384-,train-,bias-,window-,dropout-,kvlens-,gqa-}" \
  --json "$OUT/gate.json" > "$OUT/gate.txt" 2>&1
echo "gate rc=$? at $((SECONDS - start)) s"; tail -45 "$OUT/gate.txt" | cut -c1-150
timeout 90 python3 lab/pad_probe.py 2>&1 | tee "$OUT/pad_probe.txt" | cut -c1-90
echo "pad probe done at $((SECONDS - start)) s"
left=$(( ${END_S:-585} - (SECONDS - start) ))
FERRO_FAILURE_LOG="$OUT/failures.txt" timeout "$left" python3 -m pytest -q -n 15 -p no:cacheprovider \
  ${FILES:-tests/test_cuda_flash_attn.py tests/test_context_parallel.py tests/test_varlen.py \
    tests/test_paged_kv.py tests/test_kvcache_append.py tests/test_cuda_rope.py \
    tests/test_cuda_torch_rope.py tests/test_model_options.py} 2>&1 | tee "$OUT/suite.txt" | tail -6
head -c 3000 "$OUT/failures.txt" 2>/dev/null
echo "round done at $((SECONDS - start)) s"
