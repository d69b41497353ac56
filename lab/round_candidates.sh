#!/usr/bin/env bash
# One device call for the kernel candidates in lab/candidates/ (run from the repository root;
# each overlay built from its patch by lab/candidates/overlay.sh):
#   1. the kernel cache filled for main and each candidate overlay (every dtype: its tests);
#   2. compare.py's mods cases (softcap, ALiBi, sinks, plain) on main, then on $MODS_OVERLAY
#      (a candidate name; skipped without one);
#   3. each candidate's GPU tests through its overlay (lab/triage_hang.sh, in parallel);
#   4. decode_splits_ab.py --quick; an ncu SpeedOfLight of every backward kernel at D256.
# STEPS (default "mods tests ab ncu") picks steps, TEST_CANDIDATES (overlay folders; default every one built above) the tests. Logs in $OUT (packed past 7 files).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
STEPS=${STEPS:-mods tests ab ncu}
start=$SECONDS
at() { echo "[$((SECONDS - start)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
DECODE=$(bash lab/candidates/overlay.sh decode-splits)
SOFTCAP=${MODS_OVERLAY:+$(bash lab/candidates/overlay.sh "$MODS_OVERLAY")}
python3 -m ferrocupy.cuda.precompile 2>&1 | tail -1
for c in ${TEST_CANDIDATES:-$SOFTCAP $DECODE}; do
  FERROCUPY_KERNEL_OVERLAY=$c python3 -m ferrocupy.cuda.precompile 2>&1 | tail -1
done
at precompiled
if [[ $STEPS == *mods* ]]; then
  python3 benchmarks/compare.py --dtype bf16 --cases mods- > "$OUT/mods-main.txt" 2>&1
  [ -n "$SOFTCAP" ] && FERROCUPY_KERNEL_OVERLAY=$SOFTCAP python3 benchmarks/compare.py \
    --dtype bf16 --cases mods- > "$OUT/mods-$MODS_OVERLAY.txt" 2>&1
  at mods; grep -E "mods-" "$OUT"/mods-*.txt | head -40
fi
if [[ $STEPS == *tests* ]]; then
  for c in ${TEST_CANDIDATES:-$SOFTCAP $DECODE}; do
    case $c in
      $SOFTCAP) files="tests/test_cuda_model_options.py tests/test_cuda_varlen.py" ;;
      $DECODE) files="tests/test_cuda_decode.py tests/test_cuda_paged.py" ;;
    esac
    name=$(basename $c)
    mkdir -p "$OUT/t-$name"
    FERROCUPY_KERNEL_OVERLAY=$c OUT="$OUT/t-$name" SKIP_PRECOMPILE=1 SKIP_SANITIZE=1 \
      TOTAL_S=${TESTS_S:-140} ALONE_S=20 bash lab/triage_hang.sh $files > "$OUT/tests-$name.txt" 2>&1
    at "tests $name"; grep -E "tests ended|FAILED|HUNG" "$OUT/tests-$name.txt" | head -20
  done
fi
if [[ $STEPS == *ab* ]]; then
  timeout 120 python3 lab/decode_splits_ab.py --quick > "$OUT/decode-splits-ab.txt" 2>&1
  at ab; tail -15 "$OUT/decode-splits-ab.txt"
fi
if [[ $STEPS == *ncu* ]]; then
  FERRO_SHAPE=2,4096,8,256 timeout 150 ncu --clock-control none --section SpeedOfLight \
    -k regex:flash_bwd python3 lab/profile_once.py > "$OUT/ncu-d256-bwd.txt" 2>&1
  at ncu; grep -E "flash_bwd|Duration|Compute \(SM\) Throughput|Memory Throughput" \
    "$OUT/ncu-d256-bwd.txt" | head -30
fi
at done
if [ "$(ls "$OUT" | wc -l)" -gt 7 ]; then
  ( cd "$OUT" && ls | grep -v -x -e gpu.txt -e all.tgz > /tmp/packed.txt
    tar czf all.tgz -T /tmp/packed.txt && xargs rm -rf < /tmp/packed.txt )
fi
