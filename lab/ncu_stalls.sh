#!/usr/bin/env bash
# Stall reasons of the plain wgmma forward at several geometries, in one device call (~40 s a
# geometry), from the repository root: for each "warps,mt,step,stages" in GEOMETRIES (default
# today's 12,1,64,3 and the refuted 8,1,128,2 at D128), ncu --set full on lab/profile_once.py's
# forward (FERRO_SHAPE, default B4 S4096 H16 D128), then lab/ncu_stalls.py's table. Reports and
# tables land in $OUT (fwd_<geometry>.ncu-rep, stalls.txt).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
for g in ${GEOMETRIES:-12,1,64,3 8,1,128,2}; do
  rep="$OUT/fwd_${g//,/_}"
  FERRO_FWD_GEOMETRY=$g timeout "${NCU_S:-120}" ncu --set full --import-source no \
    -k regex:flash_fwd -c 1 -f -o "$rep" python3 lab/profile_once.py > "$rep.log" 2>&1
  echo "-- $g rc=$?"
  python3 lab/ncu_stalls.py "$rep.ncu-rep" 2>&1 | tee -a "$OUT/stalls.txt"
done
