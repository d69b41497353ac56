#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on lab/sanitize_run.py's small run of the kernel
# families named by FERRO_SANITIZE (SAN, default "bfloat16;float32"), each tool under SAN_S
# seconds (default 80); logs $OUT/sanitize_<tool>.txt, summary lines printed. Sourced or run
# from the repository root by round_gates.sh and round_probe.sh.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s0=$SECONDS
for tool in memcheck racecheck; do
  FERRO_SANITIZE=${SAN:-"bfloat16;float32"} timeout "${SAN_S:-80}" compute-sanitizer \
    --tool $tool --print-limit 20 python3 lab/sanitize_run.py > "$OUT/sanitize_$tool.txt" 2>&1
  echo "-- $tool rc=$? (124: cut by its limit) after $((SECONDS - s0)) s"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" "$OUT/sanitize_$tool.txt" | head -8
done
