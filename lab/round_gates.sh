#!/usr/bin/env bash
# One device call (~570 s) from the repository root (or on _tree/, as round_suite.sh; chain it
# within 30 s of a round_suite.sh call so the kernel cache in /tmp/ferro_kcache is still there): issue 25's gate
# cases of benchmarks/compare.py (and issue 26's), the A/B scripts (fused backward, paged decode, padded
# wgmma head_dims), then compute-sanitizer memcheck and racecheck on lab/sanitize_run.py's small
# run of every kernel family (bfloat16 and float32 only, FERRO_SANITIZE, to fit the call).
# Each step has its own time limit; everything lands in $OUT.
#   GATE_S (compare.py, default 300), DTYPES (default bfloat16), CASES (its --cases), AB_S (each A/B script, 60),
#   SAN_S (each sanitizer tool, 80), SAN (FERRO_SANITIZE, default "bfloat16;float32"),
#   STEPS (which of "gate ab san" to run, default all three).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
start=$SECONDS
stamp() { echo "-- $1 at $((SECONDS - start)) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "kernel cache: $(ls "$CUPY_CACHE_DIR" | wc -l) files"
[ -d _tree ] && cd _tree; export PYTHONPATH=$PWD
STEPS=" ${STEPS:-gate ab san} "
if [[ $STEPS == *" gate "* ]]; then
timeout "${GATE_S:-300}" python3 benchmarks/compare.py --dtype "${DTYPES:-bfloat16}" \
  --cases "${CASES:-s1024-,s4096-,s16384-,train-,bias-,window-,dropout-,kvlens-,gqa-,d256-,varlen-,paged-,mods-}" \
  --json "$OUT/gate.json" > "$OUT/gate.txt" 2>&1
stamp "gate rc=$?"; grep -E "PASS|FAIL|gate|geomean|wrong|refused" "$OUT/gate.txt" | cut -c1-160 | tail -60
fi
[[ $STEPS == *" ab "* ]] && for ab in fused_bwd_ab paged_decode_ab wgmma_dims_ab; do
  [ -f "lab/$ab.py" ] || continue
  timeout "${AB_S:-60}" python3 "lab/$ab.py" --quick > "$OUT/$ab.txt" 2>&1
  stamp "$ab rc=$?"; tail -14 "$OUT/$ab.txt" | cut -c1-160
done
[[ $STEPS == *" san "* ]] && OUT=$OUT bash lab/sanitize.sh
stamp "round done"
