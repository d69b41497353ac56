#!/usr/bin/env bash
# Where the attention kernels' warps wait, in one device call (~40 s a profile), from the
# repository root, through lab/profile_once.py (one forward and one backward given lse,
# FERRO_SHAPE, default B4 S4096 H16 D128 bf16) and lab/ncu_stalls.py's table:
#   - the table's own kernels (forward, dQ, dK/dV) unless TABLE=0, at each shape of NCU_SHAPES
#     (say "4,4096,16,128 2,4096,8,256" for D256 too);
#   - the plain wgmma forward at each "warps,mt,step,stages" of GEOMETRIES (default the refuted
#     8,1,128,2; empty: none), FERRO_FWD_GEOMETRY.
# Reports and tables land in $OUT (*.ncu-rep, stalls.txt); NCU_S bounds each ncu run.
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
profile() {  # name, kernel regex, kernels to profile, then environment assignments (if any)
  local name=$1 regex=$2 count=$3; shift 3
  env "$@" timeout "${NCU_S:-120}" ncu --set full --import-source no -k "regex:$regex" \
    -c "$count" -f -o "$OUT/$name" python3 lab/profile_once.py > "$OUT/$name.log" 2>&1
  echo "-- $name rc=$?"
  python3 lab/ncu_stalls.py --sass "${SASS_TOP:-40}" "$OUT/$name.ncu-rep" 2>&1 | tee -a "$OUT/stalls.txt"
}
if [ "${TABLE:-1}" = 1 ]; then  # each shape of NCU_SHAPES ("B,S,H,D ..."; default FERRO_SHAPE's)
  for shape in ${NCU_SHAPES:-${FERRO_SHAPE:-4,4096,16,128}}; do
    profile "table_${shape//,/_}" "flash_(fwd|bwd)" 3 FERRO_SHAPE=$shape
  done
fi
for g in ${GEOMETRIES-8,1,128,2}; do
  profile "fwd_${g//,/_}" flash_fwd 1 FERRO_FWD_GEOMETRY=$g
done
