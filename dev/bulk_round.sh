#!/usr/bin/env bash
# Issue 9's round for the bulk decode kernel in one device call: a smoke test (stops the round
# if it hangs), compare.py's decode cases in all three dtypes (the gate), the decode GPU tests,
# and compute-sanitizer memcheck / racecheck on dev/sanitize_run.py's decode calls alone.
# Logs under $OUT; each stage has its own time limit so the call ends.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
pyt="python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning"
timeout 75 $pyt tests/test_cuda_decode.py -x \
    -k "auto and (bf16 and kv8-d128-cache or f32 and kv16)" > "$OUT/smoke.log" 2>&1
rc=$?
echo "smoke: rc $rc, $(tail -1 "$OUT/smoke.log")"
if [ $rc -eq 124 ]; then grep -E "Error|assert" "$OUT/smoke.log" | head; exit 1; fi
timeout "${COMPARE_TIMEOUT:-150}" python3 benchmarks/compare.py --cases decode \
    --dtype "${DTYPES:-bfloat16,float16,float32}" --json "$OUT/results-decode.json" \
    > "$OUT/compare.txt" 2>&1
echo "compare: rc $?"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TEST_TIMEOUT:-180}" $pyt tests/test_cuda_decode.py tests/test_cuda_reach.py \
        tests/test_layouts.py -k "${TEST_K:-decode}" > "$OUT/decode_tests.log" 2>&1
    echo "tests: rc $?, $(tail -1 "$OUT/decode_tests.log")"
    grep -E "^FAILED|Error" "$OUT/decode_tests.log" | head -6
fi
if [ -z "${SKIP_SAN:-}" ]; then
    for tool in memcheck racecheck; do
        FERRO_SANITIZE_DECODE=1 FERRO_SANITIZE="${SAN_DTYPES:-bfloat16:128;float32:64}" \
            timeout "${SAN_TIMEOUT:-60}" compute-sanitizer --tool $tool python3 dev/sanitize_run.py \
            > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool: rc $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
    done
fi
grep -E "^decode|vs flash|ceilings|^GPU" "$OUT/compare.txt" | cut -c1-170 | tail -20
