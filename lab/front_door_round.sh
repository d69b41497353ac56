#!/usr/bin/env bash
# One device round for the front door (issue 27): the new aliasing tests against the tree before
# it (_old/, carried: the cases, then the overlap property with many examples), host cost
# per call of both trees (alternating, two processes each), then the GPU suite on this tree.
# Logs under $OUT; each GPU-suite failure lands in $OUT/failures.txt as it happens.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
if [ -d _old ] && [ -z "${SKIP_OLD:-}" ]; then
  cp tests/aliasing.py tests/test_cuda_plans.py _old/tests/
  (cd _old && FERRO_ALIASING_EXAMPLES=${OLD_EXAMPLES:-40} timeout 200 python3 -m pytest -q -p no:cacheprovider \
     tests/test_cuda_plans.py -k "issue_case or overlapping" 2>&1) | tee "$OUT/old_aliasing.txt" | tail -30
fi
cost='from benchmarks.call_cost import measure, format_table; print(format_table(measure()))'
for t in ${COST_TREES:-_old . _old .}; do
  echo "== host cost: $t"; (cd "$t" && timeout 120 python3 -c "$cost" 2>&1) | tee -a "$OUT/call_cost.txt"
done
[ -n "${SKIP_SUITE:-}" ] && exit 0
FERRO_FAILURE_LOG="$OUT/failures.txt" timeout "${SUITE_S:-330}" python3 -m pytest -q -n "${WORKERS:-15}" \
  -p no:cacheprovider ${SUITE:-tests/test_cuda_*.py tests/test_layouts.py} 2>&1 | tee "$OUT/gpu_suite.txt" | tail -15
echo "== failures"; head -c 6000 "$OUT/failures.txt" 2>/dev/null
