#!/usr/bin/env bash
# A candidate's kernel overlay folder, built from its patch against the package's sources:
#   dir=$(bash lab/candidates/overlay.sh decode-splits [DIR])   # DIR default /tmp/ferro-overlay-NAME
#   FERROCUPY_KERNEL_OVERLAY=$dir python3 -m pytest tests/test_cuda_decode.py ...
# Each candidate keeps only lab/candidates/NAME/NAME.patch (a unified diff of ferrocupy/cuda/
# files, `a/` and `b/` prefixes): the files it touches are copied from ferrocupy/cuda/ into DIR
# and patched there, so the overlay follows main's other changes and the lab holds no copies.
# Fails (and says which hunk) where main moved under the patch.
# A candidate built on another one names it in lab/candidates/NAME/BASE (candidate names, applied
# first, in order): its patch is then a diff against main with those applied.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
name=${1:?usage: overlay.sh NAME [DIR]}
dir=${2:-/tmp/ferro-overlay-$name}
rm -rf "$dir"; mkdir -p "$dir"
base=$root/lab/candidates/$name/BASE
for c in $( [ -f "$base" ] && cat "$base") $name; do
  patch_file=$root/lab/candidates/$c/$c.patch
  for f in $(sed -n 's|^+++ b/ferrocupy/cuda/||p' "$patch_file"); do
    [ -f "$dir/$f" ] || cp "$root/ferrocupy/cuda/$f" "$dir/$f"
  done
  (cd "$dir" && patch -s -p3 < "$patch_file") >&2
done
echo "$dir"
