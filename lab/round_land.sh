#!/usr/bin/env bash
# The staged candidates' landing check, from the repository root, one device call per CALL:
#   _tree/ = this tree with every patch of CANDIDATES applied (names of lab/candidates/ folders,
#   in order; none by default: the six staged on 2026-12-07 have landed), built on the device at
#   the call's start (1 s), then
#   CALL=suite (default): the whole GPU suite on _tree (lab/round_suite.sh: precompile, then every
#           GPU test file; END_S bounds it, default 560 s). A call cut short names what it left
#           in ended.txt: give it back as SKIP to the next call.
#   CALL=ab:    compute-sanitizer memcheck and racecheck on _tree (lab/sanitize.sh), then
#           compare.py's CASES on main (or on _base: AB_BASE's candidates) and on _tree (default the cases the candidates move:
#           mods-, dropout- and the forward at D64, D128 and D256, S4096).
#   CALL=fused: lab/fused_bwd_ab.py --quick on _tree (the fused backward against the two-kernel
#           one), then its GPU
#           tests (tests/test_cuda_fused_backward.py, tests/test_cuda_wgmma.py) for FUSED_TESTS_S.
# Landing, once both calls pass: `git apply` each patch on main, commit, delete the candidate
# folders (git keeps them), and give CI's compile pass its ~70 minutes (ferro_score.cuh moves).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
R=$PWD; start=$SECONDS
CANDIDATES=${CANDIDATES:-}
build() {  # folder, candidates: a copy of this tree with their patches applied in order
  rm -rf "$1" && mkdir "$1"
  tar --exclude=./_tree --exclude=./_base --exclude=./_all --exclude=./.git -cf - . | tar -x -C "$1"
  for c in $2; do
    (cd "$1" && patch -s -p1 < "lab/candidates/$c/$c.patch") || { echo "patch $c failed"; exit 1; }
  done
  echo "$1: $2 applied at $((SECONDS - start)) s"
}
build _tree "$CANDIDATES"
# AB_BASE (CALL=ab): candidates for the other side, _base, instead of main (to time one
# candidate against the stack it sits on)
[ -n "${AB_BASE:-}" ] && build _base "$AB_BASE"
case "${CALL:-suite}" in
  suite)
    END_S=${END_S:-560} OUT=$OUT bash lab/round_suite.sh ;;
  ab)
    (cd _tree && OUT=$OUT PYTHONPATH=$R/_tree SAN_S=${SAN_S:-70} bash lab/sanitize.sh)
    for side in main tree; do
      dir=$R; [ $side = tree ] && dir=$R/_tree; [ $side = main ] && [ -n "${AB_BASE:-}" ] && dir=$R/_base
      (cd "$dir" && PYTHONPATH=$dir timeout "${CASE_S:-150}" python3 benchmarks/compare.py \
        --dtype bfloat16 --cases "${CASES:-mods-,dropout-,attn-fwd-bfloat16-d128-s4096,attn-fwd-bfloat16-d64-s4096,attn-fwd-bfloat16-d256-s4096}" \
        > "$OUT/ab-$side.txt" 2>&1)
      echo "-- $side rc=$? at $((SECONDS - start)) s"
      grep -E "TFLOP/s" "$OUT/ab-$side.txt" | grep -v "^\[" | cut -c1-100
    done ;;
  fused)
    (cd _tree && PYTHONPATH=$R/_tree timeout "${FUSED_S:-150}" python3 lab/fused_bwd_ab.py --quick \
      > "$OUT/fused-ab.txt" 2>&1)
    echo "-- fused A/B rc=$? at $((SECONDS - start)) s"; cut -c1-110 "$OUT/fused-ab.txt" | tail -25
    (cd _tree && PYTHONPATH=$R/_tree timeout "${FUSED_TESTS_S:-240}" python3 -m pytest -q -x \
      -p no:cacheprovider -n 8 tests/test_cuda_fused_backward.py tests/test_cuda_wgmma.py \
      > "$OUT/fused-tests.txt" 2>&1)
    echo "-- fused tests rc=$? at $((SECONDS - start)) s"
    grep -E "^E |^FAILED|passed|failed" "$OUT/fused-tests.txt" | head -8 ;;
esac
echo "round done at $((SECONDS - start)) s"
