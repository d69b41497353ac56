#!/usr/bin/env bash
# One device call (~500 s) for the candidates waiting since 2026-12-07 (lab/candidates/), from
# the repository root; each step under its own limit, logs in $OUT:
#   1. _tree/: a copy of this tree with mods-unmasked.patch applied; _all/: with it,
#      softcap-lg2 and dropout-shared-philox (the package and its tests: not overlays);
#   2. (only when named: "pre") precompile main and _tree; otherwise each kernel compiles when
#      first called (compare.py keeps compilation out of its timings);
#   3. the model-option and dropout GPU tests on _all (every candidate at once);
#   4. compare.py's mods- cases: main, _tree, _all (softcap-lg2's share: _all against _tree;
#      dropout-shared-philox leaves calls without dropout alone);
#   5. compare.py's dropout- cases on main and _all (mods-unmasked leaves dropout calls alone);
#   6. ("fused": not in the default STEPS) lab/fused_bwd_ab.py through the
#      fused-unordered-probe overlay (what the dQ order costs);
#   7. lab/ncu_stalls.sh (TABLE only): where the table's forward, dQ and dK/dV wait (at the
#      shapes of NCU_SHAPES: D128 by default; "2,4096,8,256" for D256).
# STEPS picks among "tree all pre tests mods dropout fused ncu" (default: all but pre and fused).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
R=$PWD; start=$SECONDS
stamp() { echo "-- $1 at $((SECONDS - start)) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS=" ${STEPS:-tree all tests mods dropout ncu} "
for t in tree all; do  # _tree: mods-unmasked; _all: it, softcap-lg2 and dropout-shared-philox
  [[ $STEPS == *" $t "* ]] || continue
  rm -rf _$t && mkdir _$t
  tar --exclude=./_tree --exclude=./_all --exclude=./.git -cf - . | tar -x -C _$t
  pats=mods-unmasked; [ $t = all ] && pats="mods-unmasked softcap-lg2 dropout-shared-philox"
  for pt in $pats; do (cd _$t && patch -s -p1 < lab/candidates/$pt/$pt.patch) || echo "patch $pt failed"; done
  stamp "$t built"
done
if [[ $STEPS == *" pre "* ]]; then
  PYTHONPATH=$R timeout "${PRE_S:-110}" python3 -m ferrocupy.cuda.precompile 2>&1 | tail -1
  (cd _tree && PYTHONPATH=$R/_tree timeout "${PRE_S:-110}" python3 -m ferrocupy.cuda.precompile \
    2>&1 | tail -1)
  stamp pre
fi
if [[ $STEPS == *" tests "* ]]; then  # every candidate at once on _all
  (cd _all && PYTHONPATH=$R/_all timeout "${TESTS_S:-170}" python3 -m pytest -q -x -p no:cacheprovider \
    -n 4 -k "softcap or alibi or sinks or dropout" tests/test_cuda_model_options.py \
    tests/test_fused_backward_plan.py tests/test_cuda_half.py tests/test_cuda_backward.py \
    tests/test_cuda_attention.py \
    > "$OUT/tests-all.txt" 2>&1)
  stamp "tests (_all) rc=$? (124: cut)"
  grep -E "^E |^FAILED|passed|failed" "$OUT/tests-all.txt" | head -6
fi
if [[ $STEPS == *" mods "* ]]; then
  for side in main tree all; do
    dir=$R; ov=""
    [ $side != main ] && dir=$R/_$side
    (cd "$dir" && FERROCUPY_KERNEL_OVERLAY=$ov PYTHONPATH=$dir timeout "${MODS_S:-50}" \
      python3 benchmarks/compare.py --dtype bfloat16 --cases mods- > "$OUT/mods-$side.txt" 2>&1)
    stamp "mods $side rc=$?"; grep -E "^mods-|need >=" "$OUT/mods-$side.txt" | cut -c1-120
  done
fi
if [[ $STEPS == *" dropout "* ]]; then  # dropout-shared-philox (on _all): the dropout- cases
  for side in main all; do
    dir=$R; [ $side = all ] && dir=$R/_all
    (cd "$dir" && PYTHONPATH=$dir timeout "${MODS_S:-50}" python3 benchmarks/compare.py \
      --dtype bfloat16 --cases dropout- > "$OUT/dropout-$side.txt" 2>&1)
    stamp "dropout $side rc=$?"; grep -E "^dropout-" "$OUT/dropout-$side.txt" | cut -c1-110
  done
fi
if [[ $STEPS == *" fused "* ]]; then  # the fused backward's order probe (its README)
  FERROCUPY_KERNEL_OVERLAY=$(bash lab/candidates/overlay.sh fused-unordered-probe) PYTHONPATH=$R \
    timeout "${FUSED_S:-70}" python3 lab/fused_bwd_ab.py --quick > "$OUT/fused-unordered.txt" 2>&1
  stamp "fused-unordered rc=$?"; cut -c1-100 "$OUT/fused-unordered.txt" | tail -30
fi
if [[ $STEPS == *" ncu "* ]]; then
  TABLE=1 GEOMETRIES="" NCU_S=${NCU_S:-90} OUT=$OUT PYTHONPATH=$R bash lab/ncu_stalls.sh 2>&1 \
    | cut -c1-140 | tail -60
fi
stamp "round done"
if [ "$(ls "$OUT" | wc -l)" -gt 7 ]; then
  ( cd "$OUT" && ls | grep -v -x -e gpu.txt -e all.tgz > /tmp/packed.txt
    tar czf all.tgz -T /tmp/packed.txt && xargs rm -rf < /tmp/packed.txt )
fi
