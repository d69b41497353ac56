#!/usr/bin/env bash
# The GPU suite's test files in the tree at the current directory, one line: every
# tests/test_cuda_*.py (a stack's new GPU files included as they appear) and the other files with
# GPU tests. Arguments: files to leave out (a round that ran them already).
#     FILES=$(bash lab/gpu_suite.sh tests/test_cuda_rope.py)
files=""
for f in tests/test_cuda_*.py tests/test_layouts.py tests/test_model_options.py \
         tests/test_transformers_backend.py tests/test_context_parallel.py; do
  [ -f "$f" ] || continue
  for skip in "$@"; do [ "$f" = "$skip" ] && continue 2; done
  files="$files $f"
done
echo $files
