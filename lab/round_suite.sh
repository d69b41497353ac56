#!/usr/bin/env bash
# The GPU suite across device calls, from the repository root (or, with carry ["_tree"], of a
# tree archived into _tree/: another commit, an A/B candidate):
#   1. the kernel cache in /tmp/ferro_kcache (kept on the machine between calls while it stays
#      warm: CUPY_CACHE_DIR), filled first (PRECOMPILE=all|select|none, below);
#   2. lab/triage_hang.sh over the suite (lab/gpu_suite.sh: every GPU test file) for the rest of
#      the call, skipping the tests listed in $SKIP (an earlier call's ended.txt, put in the tree).
# END_S: the call's length (default 570 s). $OUT gets summary.txt, ended.txt, the unit logs.
# FIRST (patterns run first) and BREADTH (first the first N cases of every test function: a call
# cut short has touched every function)
# reach lab/triage_hang.py through the environment.
set -o pipefail
# (the kernel cache lives outside the tree: the device mirrors the tree and drops what it lacks)
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "kernel cache: $(ls "$CUPY_CACHE_DIR" | wc -l) files"
[ -d _tree ] && cd _tree; export PYTHONPATH=$PWD
# PRECOMPILE: "all" (every variant this GPU runs: lab/precompile_all.py, ~1260 kernels), the
# default "select" (what configs.select picks: ferrocupy.cuda.precompile), or "none"
# (a cache left by an earlier call on this machine: nothing to precompile unless asked)
[ -z "${PRECOMPILE:-}" ] && [ "$(ls "$CUPY_CACHE_DIR" | wc -l)" -ge 400 ] && PRECOMPILE=none
rc=skipped
case "${PRECOMPILE:-select}" in
  all) timeout "${PRECOMPILE_S:-240}" python3 lab/precompile_all.py > "$OUT/precompile.log" 2>&1
       rc=$? ;;
  select) timeout "${PRECOMPILE_S:-240}" python3 -m ferrocupy.cuda.precompile \
            > "$OUT/precompile.log" 2>&1; rc=$? ;;
esac
echo "precompile (${PRECOMPILE:-select}) rc=$rc $(tail -1 "$OUT/precompile.log" 2>/dev/null)" \
  "at $((SECONDS - start)) s"
FILES=${FILES:-$(bash lab/gpu_suite.sh)}  # every GPU test file the tree has
left=$(( ${END_S:-570} - (SECONDS - start) ))
export OUT
SKIP_PRECOMPILE=1 SKIP_SANITIZE=${SKIP_SANITIZE:-1} TOTAL_S=$left ALONE_S=${ALONE_S:-60} \
  bash lab/triage_hang.sh ${SKIP:+--skip $SKIP} $FILES 2>&1 | tail -60
cp /tmp/triage/ended.txt "$OUT/" 2>/dev/null
echo "kernel cache: $(ls "$CUPY_CACHE_DIR" | wc -l) files; round done at $((SECONDS - start)) s"
# (a call brings back at most 8 files from $OUT: past 7, all but summary.txt and ended.txt go
# into one all.tgz)
if [ "$(ls "$OUT" | wc -l)" -gt 7 ]; then
  ( cd "$OUT" && ls | grep -v -x -e summary.txt -e ended.txt -e all.tgz > /tmp/packed.txt
    tar czf all.tgz -T /tmp/packed.txt && xargs rm -rf < /tmp/packed.txt )
fi
