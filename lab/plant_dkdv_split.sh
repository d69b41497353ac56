#!/usr/bin/env bash
# Planted bug: the wgmma dK/dV at head_dim 256 with both warpgroups on columns 0-127 (col_bytes
# 0: the second warpgroup's dK and dV products read the first half of Q and dO), through the
# kernel overlay. tests/test_cuda_wgmma_dims.py's above-128 cases must fail (-x: the first
# failure ends it). Output: the pytest tail; "PLANT CAUGHT" when a test failed.
set -uo pipefail
d=$(mktemp -d)
sed 's|const u32 col_bytes = (u32)(col0 / 64) \* BQ \* 128;|const u32 col_bytes = 0;|' \
  ferrocupy/cuda/flash_bwd_dkdv_wgmma.cu > "$d/flash_bwd_dkdv_wgmma.cu"
if cmp -s "$d/flash_bwd_dkdv_wgmma.cu" ferrocupy/cuda/flash_bwd_dkdv_wgmma.cu; then
  echo "the plant did not apply"; exit 2
fi
FERROCUPY_KERNEL_OVERLAY=$d PYTHONPATH=$PWD timeout "${PLANT_S:-200}" python3 -m pytest -q -x \
  -p no:cacheprovider tests/test_cuda_wgmma_dims.py -k "above_128 and d256" > "$d/log" 2>&1
rc=$?
grep -E "^E |^FAILED|passed|failed" "$d/log" | head -12  # (the failing check: numbers, not a build)
[ "$rc" -eq 1 ] && echo "PLANT CAUGHT" || echo "PLANT NOT CAUGHT (pytest rc $rc)"
