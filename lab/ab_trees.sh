#!/usr/bin/env bash
# A/B of commits on the device, one compare.py run per tree in one device call (the device gets
# the working tree without .git, so earlier commits travel as untracked copies under ab/).
#   here:       bash lab/ab_trees.sh prepare SHA...      # ab/SHA/{ferrocupy,benchmarks}; not committed
#   on device:  bash lab/ab_trees.sh run CASES SHA... .  # "." = the working tree
# Prints each tree's "case, ms, vs flash, vs cudnn" rows; full outputs go to $OUT/ab_NAME.{txt,json}.
# DTYPES (default bf16,fp16) picks the dtypes. Remove ab/ when done (rm -rf ab).
set -uo pipefail
cmd=$1; shift
if [ "$cmd" = prepare ]; then
  for c in "$@"; do mkdir -p ab/$c && git archive "$c" ferrocupy benchmarks | tar -x -C ab/$c; done
  exit 0
fi
cases=$1; shift
for t in "$@"; do
  if [ "$t" = . ]; then d=$PWD n=tree; else d=$PWD/ab/$t n=$t; fi
  echo "== $t"
  (cd "$d" && FERRO_REVISION=$([ "$t" = . ] && echo "${FERRO_REVISION:-tree}" || echo "$n") PYTHONPATH=$d \
     python3 benchmarks/compare.py --dtype "${DTYPES:-bf16,fp16}" --cases "$cases" --json "$OUT/ab_$n.json" > "$OUT/ab_$n.txt" 2>&1)
  grep -E "^(attn|gqa|decode)-" "$OUT/ab_$n.txt" | awk '{print $1, $2, $9, $10}'
done
