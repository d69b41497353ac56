#!/usr/bin/env bash
# A session's first device call, from the repository root with carry ["_seam", "_old"]: issue 27's
# figures on this tree -- host cost per call against the tree before issue 27 (_old/, git archive
# 40c43ca) beside torch SDPA, the RoPE bandwidth gate in every dtype, the RoPE and front-door GPU
# tests (and issue 28's one-GPU NCCL run), memcheck on every RoPE variant -- then the seam's hang triage (lab/triage_hang.sh) on the
# candidate tree $TREE (default _seam/: main + lab/seam patches; or main + every lab/ stack, whose
# later GPU test files are then added last) for the rest of the call. The host cost runs
# first, on an idle host. Logs under $OUT; the triage's summary names what it left unrun.
# END_S: the call's length (default 570 s).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 110 python3 lab/call_cost_ab.py _old 2>&1 | tee "$OUT/cost_ab.txt"
echo "cost done at $((SECONDS - start)) s"
timeout 110 python3 benchmarks/compare.py --cases rope --json "$OUT/rope.json" 2>&1 \
  | tee "$OUT/rope.txt" | tail -30
echo "rope done at $((SECONDS - start)) s"
tm=$(( ${END_S:-570} - (SECONDS - start) - 10 )); [ "$tm" -gt 200 ] && tm=200
[ "$tm" -gt 15 ] && ( timeout "$tm" compute-sanitizer --tool memcheck python3 lab/sanitize_rope.py \
    2>&1 | tail -4 > "$OUT/sanitize_rope.txt" ) &
t27=$(( ${END_S:-570} - (SECONDS - start) - 5 )); [ "$t27" -gt "${T27_S:-110}" ] && t27=${T27_S:-110}
[ "$t27" -gt 20 ] && FERRO_FAILURE_LOG="$OUT/failures27.txt" timeout "$t27" python3 -m pytest -q -n 15 \
  -p no:cacheprovider tests/test_cuda_rope.py tests/test_cuda_torch_rope.py tests/test_cuda_plans.py \
  tests/test_context_parallel.py \
  2>&1 | tee "$OUT/suite27.txt" | tail -3
head -c 2000 "$OUT/failures27.txt" 2>/dev/null; echo "issue 27 tests done at $((SECONDS - start)) s"
left=$(( ${END_S:-570} - (SECONDS - start) ))
TREE=${TREE:-_seam}
if [ "$left" -gt 60 ] && [ -d "$TREE" ]; then
  cd "$TREE" && export PYTHONPATH=$PWD
  # the GPU suite but the files this round ran above
  FILES=${FILES:-$(bash ../lab/gpu_suite.sh tests/test_cuda_rope.py tests/test_cuda_torch_rope.py \
                   tests/test_cuda_plans.py)}
  SKIP_PRECOMPILE=${SKIP_PRECOMPILE:-1} TOTAL_S=$left bash lab/triage_hang.sh $FILES 2>&1 | tail -45
  cd ..
fi
wait
echo "== memcheck on RoPE"; cat "$OUT/sanitize_rope.txt"
echo "round done at $((SECONDS - start)) s"
