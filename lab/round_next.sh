#!/usr/bin/env bash
# One device call (~550 s) for the candidates waiting since 2026-12-07 (lab/candidates/), from
# the repository root; each step under its own limit, logs in $OUT:
#   1. _tree/: a copy of this tree with mods-unmasked.patch applied; _all/: with it,
#      softcap-lg2 and dropout-shared-philox (the package and its tests: not overlays);
#   2. (only when named: "pre") precompile main and _tree; otherwise each kernel compiles when
#      first called (compare.py keeps compilation out of its timings);
#   3. the model-option and dropout GPU tests on _all (every candidate at once);
#   4. compare.py's mods- cases on each of MODS_SIDES (default "main all"; "tree" too, with
#      STEPS naming it, to tell softcap-lg2's share: dropout-shared-philox leaves calls without
#      dropout alone);
#   5. compare.py's dropout- cases on main and _all (mods-unmasked leaves dropout calls alone);
#   6. ("kvsplit") kv-split-barriers' forward GPU tests (KV_TESTS) through its overlay;
#   6b. ("sweep") the D128 forward (SWEEP_DIMS), two geometries (SWEEP_ONLY), on main and
#      through each of SWEEP_CANDIDATES' overlays (default warp-release fwd-pingpong; one
#      missing is passed over; "tree", "all", "tests", "mods", "dropout", "kvsplit", "fused"
#      name candidates landed or dropped on 2026-12-07 and fail now);
#   7. ("fused") lab/fused_bwd_ab.py through the fused-unordered-probe overlay;
#   8. ("ncu") lab/ncu_stalls.sh (TABLE only): where the table's forward, dQ and dK/dV wait (at
#      the shapes of NCU_SHAPES: D128 by default; "2,4096,8,256" for D256).
# STEPS picks among "tree all pre tests mods dropout kvsplit sweep fused ncu" (default "sweep":
# the 2026-12-07 call ran "all tests mods dropout kvsplit"; the staged four land through
# lab/round_land.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ferro_kcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$CUPY_CACHE_DIR"
R=$PWD; start=$SECONDS
stamp() { echo "-- $1 at $((SECONDS - start)) s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS=" ${STEPS:-sweep} "
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
    -n 8 -k "softcap or alibi or sinks or dropout" tests/test_cuda_model_options.py \
    tests/test_fused_backward_plan.py tests/test_cuda_half.py tests/test_cuda_backward.py \
    tests/test_cuda_attention.py \
    > "$OUT/tests-all.txt" 2>&1)
  stamp "tests (_all) rc=$? (124: cut)"
  grep -E "^E |^FAILED|passed|failed" "$OUT/tests-all.txt" | head -6
fi
if [[ $STEPS == *" mods "* ]]; then
  for side in ${MODS_SIDES:-main all}; do
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
# The tests that launch the wgmma forward (its README): many tiles a block, warpgroup key ranges,
# persistent blocks, the mask in the data dtype, every width, paged and varlen.
KV_DEFAULT_TESTS="tests/test_cuda_half.py::test_half_forward_warpgroup_key_ranges
  tests/test_cuda_half.py::test_half_forward_many_tiles_per_block
  tests/test_cuda_half.py::test_persistent_forward_on_concurrent_streams_and_repeated
  tests/test_cuda_half.py::test_half_forward_kv_lens_many_tiles_per_block
  tests/test_cuda_half.py::test_half_forward_mask_in_the_data_dtype
  tests/test_cuda_wgmma_dims.py tests/test_cuda_paged_prefill.py tests/test_cuda_varlen.py"
if [[ $STEPS == *" kvsplit "* ]]; then  # kv-split-barriers: its forward tests
  KV=$(bash lab/candidates/overlay.sh kv-split-barriers) || KV=""
  [ -n "$KV" ] || { echo "kv-split-barriers: no overlay, step skipped"; STEPS=${STEPS/ kvsplit / }; }
fi
if [[ $STEPS == *" kvsplit "* ]]; then
  FERROCUPY_KERNEL_OVERLAY=$KV PYTHONPATH=$R timeout "${KV_TESTS_S:-120}" python3 -m pytest -q -x \
    -p no:cacheprovider -n 8 ${KV_TESTS:-$KV_DEFAULT_TESTS} > "$OUT/tests-kvsplit.txt" 2>&1
  stamp "kvsplit tests rc=$?"; grep -E "^E |^FAILED|passed|failed" "$OUT/tests-kvsplit.txt" | head -6
fi
if [[ $STEPS == *" sweep "* ]]; then  # the D128 forward, two geometries: main, then each overlay
  for c in main ${SWEEP_CANDIDATES:-warp-release fwd-pingpong}; do
    ov=""; [ $c != main ] && { ov=$(bash lab/candidates/overlay.sh $c) || continue; }
    FERROCUPY_KERNEL_OVERLAY=$ov PYTHONPATH=$R timeout "${SWEEP_S:-80}" python3 lab/tile_sweep.py \
      --ops forward --wgmma-only --dims ${SWEEP_DIMS:-128} --no-peers \
      --only "${SWEEP_ONLY:-w8 m1 n128 s2,w12 m1 n64}" > "$OUT/sweep-$c.txt" 2>&1
    stamp "sweep $c rc=$?"; grep -E "^forward" "$OUT/sweep-$c.txt"
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
