#!/usr/bin/env bash
# A decode round in one device call: compare.py's decode cases, the streams design's geometries
# at those shapes (lab/decode_sweep.py --small), the decode GPU tests (with the torch interop
# suite), and compute-sanitizer on the decode calls of lab/sanitize_run.py. Logs under $OUT; each
# stage has its own time limit so the call ends.
# Usage (on the device): bash lab/decode_round.sh   (SKIP_TESTS=1, SKIP_SWEEP=1, SKIP_SAN=1;
# SAN_DECODE_ONLY= (set, empty) sanitizes every kernel of lab/sanitize_run.py, not its decode
# calls alone; TORCH_TESTS= (set, empty) leaves the torch suite out). A fresh machine compiles
# every kernel it meets first: allow a few minutes for the test stage.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${COMPARE_TIMEOUT:-150}" python3 benchmarks/compare.py --cases decode \
    --dtype "${DTYPES:-bfloat16,float16,float32}" --json "$OUT/results-decode.json" \
    > "$OUT/compare.txt" 2>&1
if [ -z "${SKIP_SWEEP:-}" ]; then
    timeout 120 python3 lab/decode_sweep.py --small --dtypes bfloat16,float32 > "$OUT/sweep.txt" 2>&1
fi
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/test_cuda_decode.py ${TORCH_TESTS-tests/test_cuda_torch.py} \
        -q -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 | tee "$OUT/decode_tests.log" \
        | grep -E "passed|failed|Error" | tail -4
    timeout 100 python3 -m pytest tests/test_cuda_reach.py tests/test_layouts.py -k decode -q \
        -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 | tee "$OUT/decode_tests2.log" \
        | grep -E "passed|failed|Error" | tail -4
fi
if [ -z "${SKIP_SAN:-}" ]; then
    for tool in memcheck racecheck; do
        FERRO_SANITIZE_DECODE=${SAN_DECODE_ONLY-1} \
        FERRO_SANITIZE="${SAN_DTYPES:-bfloat16:128;float32:64}" timeout 120 compute-sanitizer \
            --tool $tool python3 lab/sanitize_run.py > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
    done
fi
grep -E "FAILED|Error" "$OUT/decode_tests.log" | head -8
tail -40 "$OUT/sweep.txt" 2>/dev/null
grep -E "^decode|ferro/peer|vs flash" "$OUT/compare.txt" | tail -24
