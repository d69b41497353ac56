#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on lab/sanitize_run.py's small run of the kernel
# families named by FERRO_SANITIZE (SAN, default "bfloat16;float32"), each tool under SAN_S
# seconds (default 80); logs $OUT/sanitize_<tool>.txt, summary lines printed. Sourced or run
# from the repository root by round_gates.sh and round_probe.sh. FUSED=1: the same run with the
# fused backward switched on (FERROCUPY_FUSED_BACKWARD=1: every backward it serves, half
# precision at head_dim 64 and 128 given lse, takes the fused kernels; default SAN then
# "bfloat16:64,128"), logs $OUT/sanitize_fused_<tool>.txt.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s0=$SECONDS
tag=""; san=${SAN:-"bfloat16;float32"}
if [ "${FUSED:-0}" = 1 ]; then
  export FERROCUPY_FUSED_BACKWARD=1; tag=fused_; san=${SAN:-"bfloat16:64,128"}
fi
for tool in memcheck racecheck; do
  FERRO_SANITIZE=$san timeout "${SAN_S:-80}" compute-sanitizer \
    --tool $tool --print-limit 20 python3 lab/sanitize_run.py > "$OUT/sanitize_$tag$tool.txt" 2>&1
  echo "-- $tag$tool rc=$? (124: cut by its limit) after $((SECONDS - s0)) s"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" "$OUT/sanitize_$tag$tool.txt" | head -8
done
