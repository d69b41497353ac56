#!/usr/bin/env bash
# One device call that names the GPU test that hangs (if one does), in about 9 minutes on an H100:
#   1. every kernel variant compiled once, in parallel (ferrocupy.cuda.precompile);
#   2. compute-sanitizer synccheck, then racecheck, on one small call of each kernel the seam
#      changed (lab/hang_suspects.py; each call printed before and after it runs), in the
#      background, each under a time limit: a call that starts and never ends is a hang;
#   3. lab/triage_hang.py: the GPU suite in work units, each its own pytest process, 15 at a
#      time, the most suspect first; a test running past TEST_S ends its process with its
#      threads' stacks and is reported HUNG; then each HUNG test alone, twice (a hung kernel can
#      stall the whole GPU, so tests beside the culprit may time out too: only the culprit hangs
#      alone).
# Run it from the root of the tree to test. Everything lands in $OUT: summary.txt (HUNG tests
# with their stacks, failures, what was left unrun), sanitize.txt, triage_logs.tgz (every
# unit's log, progress and stack file; the GPU monitor). Knobs: TOTAL_S (whole script, default
# 560), TEST_S (per test, 100), PARALLEL (15), UNIT (tests a process, 24), SKIP_PRECOMPILE=1,
# SKIP_SANITIZE=1, ROPE=1 (add the RoPE files, last); arguments: test files to run instead of
# the default suite (e.g. the ones left unrun by a first call).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=/tmp/triage
rm -rf "$W"; mkdir -p "$OUT" "$W"
TOTAL_S=${TOTAL_S:-560}
start=$SECONDS
left() { echo $((TOTAL_S - (SECONDS - start))); }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import cupy, torch, pytest; print(cupy.__version__, torch.__version__, pytest.__version__)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$W/gpu.txt"

if [ -z "${SKIP_PRECOMPILE:-}" ]; then
  timeout "${PRECOMPILE_S:-150}" python3 -m ferrocupy.cuda.precompile > "$W/precompile.log" 2>&1
  echo "precompile rc=$? $(tail -1 "$W/precompile.log") at $((SECONDS - start)) s"
fi

san_pid=
if [ -z "${SKIP_SANITIZE:-}" ]; then
  ( for tool in synccheck racecheck; do
      echo "== $tool"
      timeout "${SANITIZE_S:-150}" compute-sanitizer --tool $tool --print-limit 20 \
        python3 lab/hang_suspects.py 2>&1 | grep -vE "^\s*$" | tail -60
      echo "== $tool exit ${PIPESTATUS[0]} (124: timed out: the last 'start' without 'ok' hangs)"
    done ) > "$W/sanitize.txt" 2>&1 &
  san_pid=$!
fi

alone=${ALONE_S:-120}
budget=$(( $(left) - alone - 25 ))
python3 lab/triage_hang.py --out "$W" --budget "$budget" --alone-budget "$alone" \
  --parallel "${PARALLEL:-15}" --test-timeout "${TEST_S:-100}" --unit-size "${UNIT:-24}" \
  ${ROPE:+--rope} "$@" 2>&1 | tee "$W/triage.txt"

if [ -n "$san_pid" ]; then
  # (the sanitizer runs had the whole triage to finish; they get what is left, and whatever
  # still runs when this script returns is ended with the call)
  for _ in $(seq 1 $(( $(left) > 15 ? $(left) - 15 : 1 ))); do
    kill -0 "$san_pid" 2>/dev/null || break; sleep 1
  done
  kill -0 "$san_pid" 2>/dev/null && echo "(sanitizers still running: cut here)" >> "$W/sanitize.txt"
  echo "== sanitizers"; cat "$W/sanitize.txt"
  cp "$W/sanitize.txt" "$OUT/"
fi
cp "$W/summary.txt" "$W/durations.txt" "$W/durations_by_function.txt" "$OUT/" 2>/dev/null
tar czf "$OUT/triage_logs.tgz" -C /tmp triage
echo "done in $((SECONDS - start)) s"
