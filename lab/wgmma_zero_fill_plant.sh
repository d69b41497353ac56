#!/usr/bin/env bash
# Planted bug (GPU): ferro_wgmma.cuh's load_tile_sw128 without the zero fill past the head_dim
# (chunks at columns >= D copied from the row's memory, the next head's elements, instead of
# zeros), built through the kernel overlay, the package unchanged. tests/test_cuda_wgmma_dims.py
# must fail on it (the forward's out and the gradients take the extra columns' products); this
# script exits 0 when they do, 1 when the tests pass with the bug in place (a test that cannot
# fail). Run from the repository root on an H100/H200:
#     bash lab/wgmma_zero_fill_plant.sh
set -u
plant=$(mktemp -d)
trap 'rm -rf "$plant"' EXIT
cp ferrocupy/cuda/ferro_wgmma.cuh "$plant/"
sed -i 's/const bool ok = row >= 0 \&\& row < n_rows \&\& 8 \* c < D;/const bool ok = row >= 0 \&\& row < n_rows;  \/\/ PLANTED: no zero fill past D/' \
    "$plant/ferro_wgmma.cuh"
if ! grep -q "PLANTED" "$plant/ferro_wgmma.cuh"; then
    echo "the plant did not apply (load_tile_sw128 changed?)" >&2
    exit 2
fi
for dims in d8 d40 d80 d96; do  # (a process each: a read past an allocation may end one)
    if FERROCUPY_KERNEL_OVERLAY="$plant" python3 -m pytest -q \
            "tests/test_cuda_wgmma_dims.py::test_half_rule_on_the_wgmma_kernels[plain-lse-$dims-bf16]"; then
        echo "PLANT NOT CAUGHT at $dims: the tests passed without the zero fill" >&2
        exit 1
    fi
    echo "plant caught at $dims"
done
exit 0
