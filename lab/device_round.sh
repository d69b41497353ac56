#!/usr/bin/env bash
# One device round: precompile, the GPU test suite, compute-sanitizer on a small run of every
# kernel, the host cost per call. Logs under $OUT. Usage (on the device):
#   bash lab/device_round.sh [pytest args...]
# The whole suite takes longer than one 600 s device call: SUITE_PART (below) picks a third of
# it; SUITE_ONLY=1 stops after the suite; SKIP_SUITE=1 runs only the sanitizers and the call
# cost; SWEEP=1 adds lab/tile_sweep.py.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m ferrocupy.cuda.precompile 2>&1 | tee "$OUT/precompile.log"
# SUITE_PART=1|2|3 runs a third of the suite's files (each part fits one device call):
#   1: the half-precision suite; 2: the float32 forward and backward; 3: the rest.
case "${SUITE_PART:-}" in
    1) files="tests/test_cuda_half.py" ;;
    2) files="tests/test_cuda_attention.py tests/test_cuda_backward.py" ;;
    3) files="tests/test_cuda_decode.py tests/test_cuda_rope.py tests/test_cuda_torch.py tests/test_cuda_wgmma.py tests/test_cuda_reach.py tests/test_layouts.py" ;;
    *) files="tests/test_cuda_*.py tests/test_layouts.py" ;;
esac
[ -n "${SKIP_SUITE:-}" ] || timeout ${PYTEST_TIMEOUT:-480} python3 -m pytest $files -q -p no:cacheprovider -W ignore::RuntimeWarning \
    "$@" 2>&1 | tee "$OUT/gpu_tests${SUITE_PART:-}.log" | grep -E "passed|failed|error" | tail -3
[ -n "${SUITE_ONLY:-}" ] && exit 0
for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool python3 lab/sanitize_run.py > "$OUT/sanitize_$tool.log" 2>&1
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Error|error' "$OUT/sanitize_$tool.log" | tail -2)"
done
python3 lab/call_cost.py > "$OUT/call_cost.txt" 2>&1; tail -8 "$OUT/call_cost.txt"
if [ -n "${SWEEP:-}" ]; then
    timeout 150 python3 lab/tile_sweep.py --dtype bfloat16 > "$OUT/sweep.txt" 2>&1
    tail -90 "$OUT/sweep.txt"
fi
