#!/usr/bin/env bash
# One device call (~500 s) for the candidates waiting since 2026-12-07 (lab/candidates/), from
# the repository root; each step under its own limit, logs in $OUT:
#   1. _tree/: a copy of this tree with mods-unmasked.patch applied (the package and its tests:
#      not an overlay); SOFTCAP: softcap-lg2's overlay folder (on either tree);
#   2. (only when named: "pre") precompile main and _tree; otherwise each kernel compiles when
#      first called (compare.py keeps compilation out of its timings);
#   3. the model-option GPU tests on _tree, then on _tree with the softcap-lg2 overlay;
#   4. compare.py's mods- cases: main, _tree, _tree + softcap-lg2 (predictions in each README);
#   5. dropout-shared-philox: its dropout GPU tests, compare.py's dropout- cases on main and
#      through it ("dropout": not in the default STEPS, a second call's);
#   6. lab/fused_bwd_ab.py through the fused-unordered-probe overlay (what the dQ order costs);
#   7. lab/ncu_stalls.sh (TABLE only): where the table's forward, dQ and dK/dV wait (at the
#      shapes of NCU_SHAPES: D128 by default; "2,4096,8,256" for D256).
# STEPS picks among "tree pre tests mods dropout fused ncu" (default all but pre and dropout).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
R=$PWD; start=$SECONDS
stamp() { echo "-- $1 at $((SECONDS - start)) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS=" ${STEPS:-tree tests mods fused ncu} "
if [[ $STEPS == *" tree "* ]]; then
  rm -rf _tree && mkdir _tree
  tar --exclude=./_tree --exclude=./.git -cf - . | tar -x -C _tree
  (cd _tree && patch -s -p1 < lab/candidates/mods-unmasked/mods-unmasked.patch)
  stamp "tree rc=$?"
fi
SOFTCAP=$(bash lab/candidates/overlay.sh softcap-lg2)
if [[ $STEPS == *" pre "* ]]; then
  PYTHONPATH=$R timeout "${PRE_S:-110}" python3 -m ferrocupy.cuda.precompile 2>&1 | tail -1
  (cd _tree && PYTHONPATH=$R/_tree timeout "${PRE_S:-110}" python3 -m ferrocupy.cuda.precompile \
    2>&1 | tail -1)
  stamp pre
fi
if [[ $STEPS == *" tests "* ]]; then
  for ov in "" "$SOFTCAP"; do  # (through softcap-lg2, the softcap cases only)
    k="softcap or alibi or sinks"; [ -n "$ov" ] && k=softcap
    (cd _tree && FERROCUPY_KERNEL_OVERLAY=$ov PYTHONPATH=$R/_tree timeout "${TESTS_S:-110}" \
      python3 -m pytest -q -x -p no:cacheprovider -k "$k" \
      tests/test_cuda_model_options.py tests/test_fused_backward_plan.py \
      > "$OUT/tests${ov:+-lg2}.txt" 2>&1)
    stamp "tests ${ov:+(softcap-lg2) }rc=$? (124: cut)"
    grep -E "^E |^FAILED|passed|failed" "$OUT/tests${ov:+-lg2}.txt" | head -6
  done
fi
if [[ $STEPS == *" mods "* ]]; then
  for side in main tree lg2; do
    dir=$R; ov=""
    [ $side != main ] && dir=$R/_tree
    [ $side = lg2 ] && ov=$SOFTCAP
    (cd "$dir" && FERROCUPY_KERNEL_OVERLAY=$ov PYTHONPATH=$dir timeout "${MODS_S:-50}" \
      python3 benchmarks/compare.py --dtype bfloat16 --cases mods- > "$OUT/mods-$side.txt" 2>&1)
    stamp "mods $side rc=$?"; grep -E "^mods-|need >=" "$OUT/mods-$side.txt" | cut -c1-120
  done
fi
if [[ $STEPS == *" dropout "* ]]; then  # dropout-shared-philox: its tests, then dropout- cases
  DROP=$(bash lab/candidates/overlay.sh dropout-shared-philox)
  FERROCUPY_KERNEL_OVERLAY=$DROP PYTHONPATH=$R timeout "${DROP_TESTS_S:-100}" python3 -m pytest \
    -q -x -p no:cacheprovider -k dropout tests/test_cuda_half.py tests/test_cuda_backward.py \
    > "$OUT/tests-dropout.txt" 2>&1
  stamp "dropout tests rc=$?"; grep -E "^E |^FAILED|passed|failed" "$OUT/tests-dropout.txt" | head -6
  for ov in "" "$DROP"; do
    FERROCUPY_KERNEL_OVERLAY=$ov PYTHONPATH=$R timeout "${MODS_S:-50}" python3 \
      benchmarks/compare.py --dtype bfloat16 --cases dropout- > "$OUT/dropout${ov:+-shared}.txt" 2>&1
    stamp "dropout ${ov:+shared }rc=$?"
    grep -E "^dropout-" "$OUT/dropout${ov:+-shared}.txt" | cut -c1-110
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
