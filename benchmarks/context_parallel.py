"""Context-parallel attention on several GPUs (issue 28): ferrocupy's ring attention
(`ferrocupy.torch.context_parallel_attention`) beside PyTorch's own `context_parallel` over SDPA,
and the single-GPU attention on each rank's local work. Run with torchrun, one process a GPU:

    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --mode weak
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --mode strong --json cp-8.json

- weak scaling: fixed tokens per GPU (`--tokens-per-gpu`, default 16384 and 65536), so the
  sequence is that times the world size;
- strong scaling: fixed sequences (`--seq`, default 131072, 262144 and 1048576) over the world.
Defaults: bfloat16, B1, H16 (as many KV heads: `--kv-heads` for GQA), D128, causal, zigzag,
forward and forward+backward.
Each case reports the TFLOP/s per GPU, counted as FlashAttention counts the unsharded call
(4·B·H·S²·D / 2 causal; the backward 2.5×) divided by the world size, timed with CUDA events
as the slowest rank's mean over `--repeats` calls after `--warmup`. Beside it:
- `single`: `ferrocupy.torch.attention` on one GPU over the same local work per step, a causal
  call on `S_local` tokens (its TFLOP/s as above): issue 28's 90% target is the ring's
  per-GPU TFLOP/s over this one's at 8 GPUs, zigzag, causal, S_local = 16k;
- `torch_cp`: `torch.distributed.tensor.experimental.context_parallel` over SDPA (its head-tail
  load balancing is zigzag; `--torch-rotate` picks its K/V exchange), where importable.
Each implementation's output is checked against the others' on the first call of each case
(ferrocupy's ring against torch's, gathered). `--dry-run` prints the cases and exits (no GPU
needed); `--device cpu` runs tiny cases on gloo and the reference backend, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):  # ferrocupy from this tree, and harness
    if _p not in sys.path:
        sys.path.insert(0, _p)
from harness import attention_flops  # noqa: E402

PEERS = ("ferrocupy", "single", "torch_cp")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CpCase:
    mode: str  # "weak" or "strong"
    seq: int  # the whole sequence
    world: int
    direction: str  # "fwd" or "step" (forward + backward)

    @property
    def local(self) -> int:
        return self.seq // self.world


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="context_parallel.py",
        description="Ring attention (ferrocupy) vs PyTorch's context_parallel over SDPA; run "
                    "under torchrun, one process a GPU.")
    p.add_argument("--mode", choices=("weak", "strong", "both"), default="both")
    p.add_argument("--tokens-per-gpu", type=_int_list, default=[16384, 65536],
                   help="weak scaling: tokens per GPU, comma-separated (default 16384,65536)")
    p.add_argument("--seq", type=_int_list, default=[131072, 262144, 1048576],
                   help="strong scaling: whole sequences, comma-separated "
                        "(default 131072,262144,1048576)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="full attention instead of causal")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--direction", choices=("fwd", "step", "both"), default="both",
                   help="forward only, forward + backward, or both (default)")
    p.add_argument("--peers", type=_peer_list, default=list(PEERS),
                   help=f"comma-separated, from {','.join(PEERS)} (default all)")
    p.add_argument("--torch-rotate", choices=("allgather", "alltoall"), default="alltoall",
                   help="PyTorch CP's K/V exchange (alltoall: its ring)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo and the reference backend, for a smoke test at tiny sizes")
    p.add_argument("--world", type=int, default=None,
                   help="the world size for --dry-run (else torchrun's WORLD_SIZE)")
    p.add_argument("--dry-run", action="store_true", help="print the cases and exit")
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def _int_list(text: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _peer_list(text: str) -> list:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(PEERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peers {unknown}; choose from {PEERS}")
    return names


def build_cases(args: argparse.Namespace, world: int) -> list:
    """The cases of one run at `world` GPUs. A sequence that does not split into 2·world
    chunks (zigzag) or world shards is left out."""
    parts = world * (2 if args.layout == "zigzag" else 1)
    seqs = []
    if args.mode in ("weak", "both"):
        seqs += [("weak", t * world) for t in args.tokens_per_gpu]
    if args.mode in ("strong", "both"):
        seqs += [("strong", s) for s in args.seq]
    directions = ("fwd", "step") if args.direction == "both" else (args.direction,)
    return [CpCase(mode, seq, world, d) for mode, seq in seqs if seq % parts == 0
            for d in directions]


def case_flops(args: argparse.Namespace, case: CpCase) -> int:
    """FLOPs per GPU: the unsharded call's (FlashAttention's count) over the world size."""
    total = attention_flops(args.batch, args.heads, case.seq, case.seq, args.head_dim,
                            args.causal, case.direction)
    return total // case.world


# --- running (torch imported here, not at module level) ---------------------------------------
def _timed(fn, repeats: int, warmup: int, device: str, torch, dist) -> float:
    """Seconds per call: the slowest rank's mean."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
    else:
        import time
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        seconds = (time.perf_counter() - t0) / repeats
    worst = torch.tensor([seconds], dtype=torch.float64,
                         device=device if device == "cuda" else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _inputs(args, case: CpCase, torch, device, rank: int):
    """This rank's zigzag/contiguous shards of one random sequence, [B, S_local, H, D], and the
    gradient of the output, all drawn from one seed (every rank draws the whole sequence only
    at small sizes; at scale each rank draws its own shard, which is all any rank needs)."""
    from ferrocupy.context_parallel import shard_sequence

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    shapes = [(args.heads, args.batch), (args.kv_heads, args.batch), (args.kv_heads, args.batch),
              (args.heads, args.batch)]
    if case.seq * args.heads * args.head_dim <= 2**22:  # small: shard one whole sequence
        gen.manual_seed(1234)
        whole = [torch.randn(b, case.seq, h, args.head_dim, device=device, dtype=dtype,
                             generator=gen) for h, b in shapes]
        return [shard_sequence(x, rank, case.world, args.layout) for x in whole]
    return [torch.randn(b, case.local, h, args.head_dim, device=device, dtype=dtype,
                        generator=gen) for h, b in shapes]


def _ferrocupy_call(args, case, shards, torch):
    from ferrocupy.torch import context_parallel_attention

    q, k, v, grad_out = shards
    leaves = [x.detach().requires_grad_(case.direction == "step") for x in (q, k, v)]

    def call():
        out = context_parallel_attention(*leaves, causal=args.causal, layout=args.layout)
        if case.direction == "step":
            out.backward(grad_out)
        return out

    return call


def _single_call(args, case, shards, torch):
    from ferrocupy.torch import attention

    q, k, v, grad_out = shards
    leaves = [x.detach().requires_grad_(case.direction == "step") for x in (q, k, v)]

    def call():
        out = attention(*leaves, causal=args.causal)
        if case.direction == "step":
            out.backward(grad_out)
        return out

    return call


def _torch_cp_call(args, case, shards, torch, dist):
    """PyTorch's context_parallel over SDPA on the same shards (its layout [B, H, S, D]; its
    head-tail load balancer is the zigzag layout, so shards of that layout are what it expects
    inside the context). GQA: SDPA's enable_gqa."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    if args.layout != "zigzag" and args.causal:
        raise NotImplementedError("torch_cp balances causal work with the zigzag layout only")
    set_rotate_method(args.torch_rotate)
    mesh = init_device_mesh(args.device, (case.world,))
    q, k, v, grad_out = (x.transpose(1, 2).contiguous() for x in shards)
    # context_parallel shards its buffers itself and sizes its load balancer by the first
    # one's length: hand it one tiny whole-length placeholder; the shards are already ours
    holder = torch.empty(1, 1, case.seq, 1, dtype=q.dtype, device=q.device)
    context = context_parallel(mesh, buffers=[holder], buffer_seq_dims=[2],
                               no_restore_buffers={holder})
    context.__enter__()
    leaves = [x.detach().requires_grad_(case.direction == "step") for x in (q, k, v)]
    gqa = args.heads != args.kv_heads

    def call():
        out = F.scaled_dot_product_attention(*leaves, is_causal=args.causal, enable_gqa=gqa)
        if case.direction == "step":
            out.backward(grad_out)
        return out.transpose(1, 2)

    call.close = lambda: context.__exit__(None, None, None)
    return call


def _run_case(args, case, torch, dist, rank: int) -> dict:
    device = args.device
    shards = _inputs(args, case, torch, device, rank)
    flops = case_flops(args, case)
    single_flops = attention_flops(args.batch, args.heads, case.local, case.local,
                                   args.head_dim, args.causal, case.direction)
    row = {**asdict(case), "local": case.local, "layout": args.layout, "dtype": args.dtype,
           "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
           "head_dim": args.head_dim, "causal": args.causal}
    first = {}
    for peer in args.peers:
        call = None
        try:
            if peer == "ferrocupy":
                call = _ferrocupy_call(args, case, shards, torch)
            elif peer == "single":
                call = _single_call(args, case, shards, torch)
            else:
                call = _torch_cp_call(args, case, shards, torch, dist)
            first[peer] = call().detach()
            seconds = _timed(call, args.repeats, args.warmup, device, torch, dist)
            work = single_flops if peer == "single" else flops
            row[peer] = {"ms": seconds * 1e3, "tflops_per_gpu": work / seconds / 1e12}
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row[peer] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            close = getattr(call, "close", None)
            if close is not None:
                close()
    if "ferrocupy" in first and "torch_cp" in first:
        diff = (first["ferrocupy"].float() - first["torch_cp"].float()).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        row["max_abs_diff_vs_torch_cp"] = float(diff)
    ring, single = row.get("ferrocupy", {}), row.get("single", {})
    if "tflops_per_gpu" in ring and "tflops_per_gpu" in single:
        row["ring_over_single"] = ring["tflops_per_gpu"] / single["tflops_per_gpu"]
    peer = row.get("torch_cp", {})
    if "tflops_per_gpu" in ring and "tflops_per_gpu" in peer:
        row["ring_over_torch_cp"] = ring["tflops_per_gpu"] / peer["tflops_per_gpu"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        world = args.world or int(os.environ.get("WORLD_SIZE", "1"))
        for case in build_cases(args, world):
            print(json.dumps({**asdict(case), "local": case.local,
                              "tflop_per_gpu": case_flops(args, case) / 1e12}))
        return 0
    import torch
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    try:
        for case in build_cases(args, world):
            row = _run_case(args, case, torch, dist, rank)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
