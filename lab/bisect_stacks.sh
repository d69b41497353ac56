#!/usr/bin/env bash
# Which kernel stack makes a GPU test fail: a copy of this tree (main), then each stack of
# lab/README's order applied in turn with `git apply` (no git repository needed), the test run N
# times after each. One device call, from the repository root:
#   TEST="tests/test_cuda_half.py::test_half_unaligned_views" N=3 bash lab/bisect_stacks.sh
# STACKS (default: every stack in order) and FROM (the first stack to test after; main itself is
# tested first unless FROM is set) narrow it. $OUT/bisect.txt: one line a tree, its passes of N.
set -u
TEST=${TEST:?name the test(s)}; N=${N:-3}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STACKS=${STACKS:-"seam model-options visibility fused-bwd head-dim-256 paged-append varlen wgmma-dims ci-compile bench-26 suite-size review-fixes paged-prefill softmax-bits"}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONUNBUFFERED=1
W=/tmp/bisect_tree; rm -rf "$W"; mkdir -p "$W"
tar -c --exclude=./_stack --exclude=./_old --exclude=./_kcache --exclude=./.git . | tar -x -C "$W"
cd "$W" || exit 1
find . -name __pycache__ -prune -exec rm -rf {} +
run() {  # $1: the tree's name
  local pass=0 i
  for i in $(seq "$N"); do
    PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider $TEST > "$OUT/bisect-$1-$i.log" 2>&1 \
      && pass=$((pass + 1))
  done
  echo "$1: $pass of $N passed ($(tail -1 "$OUT/bisect-$1-$N.log"))" | tee -a "$OUT/bisect.txt"
}
started=${FROM:+no}
[ -z "${FROM:-}" ] && run main
for s in $STACKS; do
  git apply lab/"$s"/*.patch 2>"$OUT/apply-$s.err" || { echo "$s: does not apply" | tee -a "$OUT/bisect.txt"; break; }
  [ "$started" = no ] && { [ "$s" = "$FROM" ] && started=yes || continue; }
  run "$s"
done
