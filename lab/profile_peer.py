"""One torch SDPA decode step (bf16, Sq 1, H32 / KV heads 8, D128: compare.py's decode shapes) with
one backend forced, for ncu, to see the peer's kernels beside ours (lab/profile_once.py):

    FERRO_DECODE=1,131072 FERRO_PEER=cudnn ncu --clock-control none \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 lab/profile_peer.py
"""
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

b, sk = (int(x) for x in os.environ.get("FERRO_DECODE", "1,131072").split(","))
backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}[os.environ.get("FERRO_PEER", "cudnn")]
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, 32, 1, 128, device="cuda", generator=g).bfloat16()
k, v = (torch.randn(b, 8, sk, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
with sdpa_kernel(backend):
    for _ in range(2):  # the first call may plan (cudnn builds its graph)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
