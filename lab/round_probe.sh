#!/usr/bin/env bash
# One device call (~560 s) from the repository root: the measurements that decide the next kernel
# change, each under its own time limit, logs in $OUT:
#   1. the table's kernels precompiled into /tmp/ferro_kcache (kept while the machine stays warm);
#   2. lab/fused_bwd_ab.py (the fused backward against the two-kernel one, cuDNN, SDPA default);
#   3. lab/tile_sweep.py over the wgmma forward geometries at SWEEP_DIMS, S SWEEP_SEQ;
#   4. compute-sanitizer memcheck and racecheck on FERRO_SANITIZE's calls (SAN);
#   5. lab/plant_dkdv_split.sh (a planted bug in the head_dim-256 dK/dV must fail its tests);
#   7. the GPU tests matching TESTS_K (default "mask") in TEST_FILES, under TESTS_S;
#   6. compare.py's cases matching AB_CASES on this tree and with the kernel files in BASE (a
#      folder of the tree, default _ab_base/, as a kernel overlay: the files a change touched, as
#      they were), base, tree, base, tree.
#   8. (only when named) lab/ncu_stalls.sh: stall reasons of the table's forward, dQ and dK/dV and of
#      the wgmma forward at GEOMETRIES.
# STEPS picks among "pre fused sweep san plant ab tests ncu" (default all but ncu).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
start=$SECONDS
stamp() { echo "-- $1 at $((SECONDS - start)) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS=" ${STEPS:-pre fused sweep san plant ab tests} "
if [[ $STEPS == *" pre "* ]]; then
  timeout "${PRE_S:-150}" python3 -m ferrocupy.cuda.precompile > "$OUT/precompile.log" 2>&1
  stamp "precompile rc=$? $(tail -1 "$OUT/precompile.log")"
fi
if [[ $STEPS == *" fused "* ]]; then
  timeout "${FUSED_S:-150}" python3 lab/fused_bwd_ab.py --quick > "$OUT/fused_bwd_ab.txt" 2>&1
  stamp "fused_bwd_ab rc=$?"; cut -c1-160 "$OUT/fused_bwd_ab.txt" | tail -30
fi
if [[ $STEPS == *" sweep "* ]]; then
  timeout "${SWEEP_S:-170}" python3 lab/tile_sweep.py --ops forward --wgmma-only \
    --dims "${SWEEP_DIMS:-128,64}" --seq "${SWEEP_SEQ:-4096}" > "$OUT/tile_sweep.txt" 2>&1
  stamp "tile_sweep rc=$?"; cut -c1-160 "$OUT/tile_sweep.txt" | tail -30
fi
if [[ $STEPS == *" san "* ]]; then
  SAN=${SAN:-"bfloat16:128,256"} SAN_S=${SAN_S:-70} OUT=$OUT bash lab/sanitize.sh
fi
if [[ $STEPS == *" ncu "* ]]; then  # not in the default STEPS
  NCU_S=${NCU_S:-120} OUT=$OUT bash lab/ncu_stalls.sh 2>&1 | cut -c1-160 | tail -60
fi
if [[ $STEPS == *" plant "* ]]; then
  PLANT_S=${PLANT_S:-90} bash lab/plant_dkdv_split.sh > "$OUT/plant.txt" 2>&1
  stamp "plant"; tail -14 "$OUT/plant.txt" | cut -c1-200
fi
if [[ $STEPS == *" ab "* ]]; then
  base=$PWD/${BASE:-_ab_base}; ls "$base"
  for side in ${AB_SIDES:-base tree base tree}; do
    ov=""; [ $side = base ] && ov=$base
    FERROCUPY_KERNEL_OVERLAY=$ov timeout "${AB_S:-100}" python3 benchmarks/compare.py \
      --dtype bfloat16 --cases "${AB_CASES:-bias-}" > "$OUT/ab_$side.txt" 2>&1
    stamp "ab $side rc=$?"; grep -E "TFLOP|ms" "$OUT/ab_$side.txt" | cut -c1-170 | tail -12
    cat "$OUT/ab_$side.txt" >> "$OUT/ab_all.txt"; rm "$OUT/ab_$side.txt"
  done
fi
if [[ $STEPS == *" tests "* ]]; then
  timeout "${TESTS_S:-120}" python3 -m pytest -q -x -p no:cacheprovider -k "${TESTS_K:-mask}" \
    ${TEST_FILES:-tests/test_cuda_half.py tests/test_cuda_attention.py} > "$OUT/tests.txt" 2>&1
  stamp "tests rc=$? (124: cut by its limit)"; grep -E "^E |^FAILED|passed|failed" "$OUT/tests.txt" | head -12
fi
stamp "round done"
