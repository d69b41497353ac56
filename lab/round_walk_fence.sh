#!/usr/bin/env bash
# One device call (~590 s) after fused-walk-down landed (2026-12-08), from the repository root,
# each step under its own limit, logs in $OUT:
#   1. the GPU suite on this tree (lab/round_suite.sh, SUITE_S; 0: none) with the fused backward
#      switched on (FERROCUPY_FUSED_BACKWARD=$SUITE_FUSED, default 1: the run that lets
#      configs.FUSED_BACKWARD_DEFAULT turn it on);
#   2. the plain wgmma forward (tile_sweep.py, d64 and d128, the table's geometries) on main and
#      through each of SWEEP_CANDIDATES' overlays (default fwd-nofence-probe fwd-loader-fence
#      softmax-lazy-rescale; SWEEP_S each);
#   3. lab/fused_bwd_ab.py --no-peers on the option cases (GQA, dropout, softcap / ALiBi / sinks):
#      fused against the two-kernel backward (OPTIONS_S);
#   4. lab/ncu_stalls.sh on main's table kernels (D128 S4096), with the SASS hot spots, for what is
#      left of END_S (reports packed into ncu.tgz).
set -o pipefail
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"; s=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SUITE_S:-430}" -gt 0 ]; then
  FERROCUPY_FUSED_BACKWARD=${SUITE_FUSED:-1} END_S=${SUITE_S:-430} OUT=$OUT \
    bash lab/round_suite.sh 2>&1 | tail -30
  echo "-- suite at $((SECONDS - s)) s"
fi
for c in main ${SWEEP_CANDIDATES:-fwd-nofence-probe fwd-loader-fence softmax-lazy-rescale}; do
  ov=""; [ "$c" != main ] && { ov=$(bash lab/candidates/overlay.sh "$c") || continue; }
  FERROCUPY_KERNEL_OVERLAY=$ov timeout "${SWEEP_S:-55}" python3 lab/tile_sweep.py --ops forward \
    --wgmma-only --dims 64,128 --no-peers --only "w12 m1 n128,w12 m1 n64" \
    > "$OUT/sweep-$c.txt" 2>&1
  echo "-- sweep $c rc=$? at $((SECONDS - s)) s"; grep -E "^forward" "$OUT/sweep-$c.txt"
done
timeout "${OPTIONS_S:-90}" python3 lab/fused_bwd_ab.py --quick --no-peers \
  --cases gqa-bwd-bfloat16,dropout-bwd,mods-bwd > "$OUT/options.txt" 2>&1
echo "-- options rc=$? at $((SECONDS - s)) s"; grep -v "^\[" "$OUT/options.txt" | cut -c1-100
left=$(( ${END_S:-585} - (SECONDS - s) ))
if [ "$left" -gt 40 ]; then
  TABLE=1 GEOMETRIES="" NCU_S=$left SASS_TOP=30 OUT=$OUT bash lab/ncu_stalls.sh 2>&1 \
    | cut -c1-170 | tail -150
fi
echo "-- done at $((SECONDS - s)) s"
# (at most 8 files come back: the summary, the stall table and one archive of the rest)
(cd "$OUT" && ls | grep -v -x -e summary.txt -e ended.txt -e stalls.txt -e gpu.txt > /tmp/rest.txt
 tar czf rest.tgz -T /tmp/rest.txt && xargs rm -rf < /tmp/rest.txt)
ls "$OUT"
