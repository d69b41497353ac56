#!/usr/bin/env bash
# (session 11's third call) the static-cache generate failure: graph breaks and a compiled probe
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ferro_kcache
cd _stack && export PYTHONPATH=.
start=$SECONDS
timeout 150 python3 lab/cudagraph_probe.py > $OUT/cudagraph_probe.txt 2>&1
echo "probe rc=$? at $((SECONDS-start)) s"; grep -E "^OK|^FAIL" $OUT/cudagraph_probe.txt
TORCH_LOGS="graph_breaks,recompiles" timeout 120 python3 -m pytest -x -q -p no:cacheprovider --tb=short \
  "tests/test_transformers_backend.py::test_greedy_generation_matches_sdpa[llama-none-static-cuda]" \
  > $OUT/greedy_breaks.txt 2>&1
echo "greedy rc=$? at $((SECONDS-start)) s"; grep -iE "graph break|Graph Break Reason|passed|failed|^E " $OUT/greedy_breaks.txt | cut -c1-300 | head -30
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_half.py -k unaligned 2>&1 | tail -2
