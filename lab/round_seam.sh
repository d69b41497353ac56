#!/usr/bin/env bash
# One device call for issue 25 step (a)+(b-backward) and issue 27's last figures, ~10 minutes:
# the GPU suite on the candidate tree (_seam/: main + lab/seam patches + the sm_90 masked/dropout
# backward), kernel speed A/B main vs candidate (ab/, lab/ab_trees.sh prepare), the backward with
# a mask / dropout in both trees, the RoPE gate in every dtype, host cost per call against the
# tree before issue 27 (_old/) beside torch SDPA. Here: see lab/round_27.sh for _old; _seam is
# `git archive <candidate> | tar -x -C _seam`; carry ["_old", "_seam", "ab"].
set -o pipefail
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}; OUT=/tmp/round; mkdir -p "$OUT" "$FINAL"  # all logs -> $FINAL/round.tgz
trap 'tar czf "$FINAL/round.tgz" -C "$OUT" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(cd _seam && PYTHONPATH=. FERRO_FAILURE_LOG="$OUT/failures.txt" timeout "${SUITE_S:-270}" \
  python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_cuda_*.py tests/test_layouts.py \
  tests/test_model_options.py tests/test_transformers_backend.py 2>&1 | tee "$OUT/suite.txt" | tail -4)
head -c 2000 "$OUT/failures.txt" 2>/dev/null
A=${A:-main} B=${B:-sm90-options}
DTYPES=bf16,fp32 timeout 200 bash lab/ab_trees.sh run "${CASES:-s4096-,gqa-}" "$A" "$B" 2>&1 | tee "$OUT/ab.txt"
for t in "$A" "$B"; do echo "== $t"; PYTHONPATH=ab/$t timeout 45 python3 lab/bwd_options.py; done 2>&1 | tee "$OUT/bwd_options.txt"
PYTHONPATH=. timeout 60 python3 benchmarks/compare.py --cases rope --json "$OUT/rope.json" 2>&1 | tail -20 | tee "$OUT/rope.txt"
PYTHONPATH=. timeout 70 python3 lab/call_cost_ab.py _old 2>&1 | tee "$OUT/cost_ab.txt"
