#!/usr/bin/env bash
# One device call (~590 s) for the candidates staged on 2026-12-08, from the repository root, each
# step under its own limit, logs in $OUT:
#   1. fused-walk-down through its overlay: lab/fused_bwd_ab.py --quick on the bf16 backward grid
#      (D64 / D128, S 1024 / 4096 / 16384, causal and not): fused against the two-kernel backward
#      and sdpa-default (WALK_S);
#   2. the plain wgmma forward (tile_sweep.py, d64 and d128, the table's geometries) on main and
#      through each of SWEEP_CANDIDATES' overlays (default fwd-nofence-probe fwd-loader-fence
#      softmax-lazy-rescale; SWEEP_S each);
#   3. lab/ncu_stalls.sh on main's table kernels (D128 S4096), with the SASS hot spots, for what is
#      left of END_S (reports packed into ncu.tgz).
set -o pipefail
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"; s=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
G=attn-bwd-bfloat16-d64-s1024-,attn-bwd-bfloat16-d128-s1024-,attn-bwd-bfloat16-d64-s4096-
G=$G,attn-bwd-bfloat16-d128-s4096-,attn-bwd-bfloat16-d64-s16384-,attn-bwd-bfloat16-d128-s16384-
FERROCUPY_KERNEL_OVERLAY=$(bash lab/candidates/overlay.sh fused-walk-down) timeout "${WALK_S:-240}" \
  python3 lab/fused_bwd_ab.py --quick --cases "$G" > "$OUT/walk.txt" 2>&1
echo "-- walk rc=$? at $((SECONDS - s)) s"; grep -v "^\[" "$OUT/walk.txt" | cut -c1-100
for c in main ${SWEEP_CANDIDATES:-fwd-nofence-probe fwd-loader-fence softmax-lazy-rescale}; do
  ov=""; [ "$c" != main ] && { ov=$(bash lab/candidates/overlay.sh "$c") || continue; }
  FERROCUPY_KERNEL_OVERLAY=$ov timeout "${SWEEP_S:-55}" python3 lab/tile_sweep.py --ops forward \
    --wgmma-only --dims 64,128 --no-peers --only "w12 m1 n128,w12 m1 n64" \
    > "$OUT/sweep-$c.txt" 2>&1
  echo "-- sweep $c rc=$? at $((SECONDS - s)) s"; grep -E "^forward" "$OUT/sweep-$c.txt"
done
left=$(( ${END_S:-585} - (SECONDS - s) ))
if [ "$left" -gt 40 ]; then
  TABLE=1 GEOMETRIES="" NCU_S=$left SASS_TOP=30 OUT=$OUT bash lab/ncu_stalls.sh 2>&1 \
    | cut -c1-170 | tail -150
fi
echo "-- done at $((SECONDS - s)) s"
(cd "$OUT" && ls *.ncu-rep >/dev/null 2>&1 && tar czf ncu.tgz *.ncu-rep *.log && rm -f *.ncu-rep *.log)
ls "$OUT"
