"""A small run of every kernel variant family, for `compute-sanitizer` (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 lab/sanitize_run.py
    compute-sanitizer --tool racecheck python3 lab/sanitize_run.py

Each dtype runs the forward (with lse, a mask, dropout), the backward with and without lse, at a
head_dim that takes 16-byte copies, one that takes 4-byte copies and (half) an odd one that
takes element-wise copies, with GQA, causal + offset and a window; the same calls on transposed
(strided) views; at head_dim 64 and 128 in half precision, forwards with more query tiles than
SMs (the persistent kernel's loop); softcap, ALiBi and sinks (forward, backward with
grad_sinks, decode); a negative offset and a window of two sides (forward, backward, decode);
a paged cache in decode and prefill and KV-cache appends (contiguous and paged, rotated);
varlen (packed sequences) forward, backward and decode; then RoPE. Prints one line per call;
the sanitizer's summary says whether anything was found.
"""

from __future__ import annotations

import os

import numpy as np

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy.dtypes import ATTENTION_DTYPES


def main() -> None:
    eng = ComputeEngine("cuda", quiet=True)
    rng = np.random.default_rng(0)
    B, Sq, Sk, H, Hkv = 1, 70, 90, 4, 2
    # FERRO_SANITIZE=bfloat16:64,128 runs only those dtypes (and head_dims): a quicker round.
    only = dict(part.split(":") if ":" in part else (part, "")
                for part in os.environ.get("FERRO_SANITIZE", "").split(";") if part)
    # FERRO_SANITIZE_DECODE=1 runs the decode calls alone (a quick round on those kernels).
    decode_only = bool(os.environ.get("FERRO_SANITIZE_DECODE"))
    for dtype in ATTENTION_DTYPES:
        if only and np.dtype(dtype).name not in only:
            continue
        dims = (64, 128, 56, 6, 7) if dtype != np.float32 else (64, 7)
        if only.get(np.dtype(dtype).name):
            dims = tuple(int(x) for x in only[np.dtype(dtype).name].split(","))
        for d in dims:
            def put(shape, scale=1.0):
                a = (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)
                return UnifiedTensor.from_numpy(a, device="cuda")
            q, k, v = put((B, Sq, H, d)), put((B, Sk, Hkv, d)), put((B, Sk, Hkv, d))
            go = put((B, Sq, H, d))
            mask = UnifiedTensor.from_numpy(rng.standard_normal((B, 1, Sq, Sk)).astype(dtype),
                                            device="cuda")
            out = UnifiedTensor.empty(q.shape, dtype, device="cuda")
            lse = UnifiedTensor.empty((B, H, Sq), np.float32, device="cuda")
            opts = AttentionOptions(causal=True, causal_offset=20, window=40, dropout_prob=0.2,
                                    seed=3)
            grads = [UnifiedTensor.empty(x.shape, dtype, device="cuda") for x in (q, k, v)]
            if not decode_only:
                eng.flash_attention_v2_with(q, k, v, out, opts, mask, lse=lse)
                eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, opts, mask, lse=lse)
                eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, opts, mask)
                eng.flash_attention_v2_with(q, k, v, out)  # no options: the tile fast paths
                eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, lse=None)
            # The decode kernels: one row per head, GQA 2, a long cache with per-sequence lengths.
            qd = put((2, 1, H, d))
            kd, vd = put((2, 700, Hkv, d)), put((2, 700, Hkv, d))
            lens = UnifiedTensor.from_numpy(np.array([700, 333], np.int32), device="cuda")
            outd = UnifiedTensor.empty(qd.shape, dtype, device="cuda")
            lsed = UnifiedTensor.empty((2, H, 1), np.float32, device="cuda")
            eng.flash_attention_v2_with(qd, kd, vd, outd, AttentionOptions(
                causal=True, causal_offset=699, dropout_prob=0.1, seed=2), lse=lsed, kv_lens=lens)
            # ... with a mask and a window that starts inside a split (a split's first key odd).
            maskd = UnifiedTensor.from_numpy(rng.standard_normal((2, 1, 1, 700)).astype(dtype),
                                             device="cuda")
            eng.flash_attention_v2_with(qd, kd, vd, outd, AttentionOptions(
                window=301, causal_offset=600), maskd, lse=lsed)
            # ... with 5 query rows a head (10 a KV group: the tensor-core decode kernel in half
            # precision at 16-byte rows), every option at once.
            qm = put((2, 5, H, d))
            outm = UnifiedTensor.empty(qm.shape, dtype, device="cuda")
            maskm = UnifiedTensor.from_numpy(rng.standard_normal((2, 1, 5, 700)).astype(dtype),
                                             device="cuda")
            eng.flash_attention_v2_with(qm, kd, vd, outm, AttentionOptions(
                causal=True, causal_offset=695, window=301, dropout_prob=0.1, seed=5), maskm,
                lse=UnifiedTensor.empty((2, H, 5), np.float32, device="cuda"), kv_lens=lens)
            # Decode at compare.py's head counts (8 KV heads) and 16, 2 rows a head: keys split
            # many ways with per-sequence lengths and dropout; a mask and a window starting
            # mid-split.
            for hkv in (8, 16):
                qb = put((2, 2, 2 * hkv, d))
                kb, vb = put((2, 3000, hkv, d)), put((2, 3000, hkv, d))
                lensb = UnifiedTensor.from_numpy(np.array([3000, 1111], np.int32), device="cuda")
                outb = UnifiedTensor.empty(qb.shape, dtype, device="cuda")
                lseb = UnifiedTensor.empty((2, 2 * hkv, 2), np.float32, device="cuda")
                eng.flash_attention_v2_with(qb, kb, vb, outb, AttentionOptions(
                    causal=True, causal_offset=2998, dropout_prob=0.1, seed=6), lse=lseb,
                    kv_lens=lensb)
                maskb = UnifiedTensor.from_numpy(
                    rng.standard_normal((2, 1, 2, 3000)).astype(dtype), device="cuda")
                eng.flash_attention_v2_with(qb, kb, vb, outb, AttentionOptions(
                    causal=True, causal_offset=2998, window=1001), maskb, lse=lseb)
            # Strided layouts: every tensor a transposed view of SDPA's [B, H, S, D] (the decode
            # cache too), so a wrong stride reads or writes past an allocation.
            def sdpa(x):
                a = UnifiedTensor.from_numpy(np.ascontiguousarray(
                    x.to_numpy().transpose(0, 2, 1, 3)), device="cuda")
                return UnifiedTensor(a.buffer().transpose(0, 2, 1, 3))
            qt, kt, vt, got, outt = (sdpa(x) for x in (q, k, v, go, out))
            gradst = [sdpa(x) for x in grads]
            if not decode_only:
                eng.flash_attention_v2_with(qt, kt, vt, outt, opts, mask, lse=lse)
                eng.flash_attention_v2_backward_with(qt, kt, vt, outt, got, *gradst, opts, mask,
                                                     lse=lse)
            eng.flash_attention_v2_with(sdpa(qd), sdpa(kd), sdpa(vd), sdpa(outd), AttentionOptions(
                causal=True, causal_offset=699), lse=lsed, kv_lens=lens)
            if d in (64, 128) and dtype != np.float32 and not decode_only:
                # More query tiles than SMs (the persistent wgmma forward's blocks claim several
                # from the stream's tile counter): per-sequence lengths, then a mask and dropout;
                # then causal (the short tile first) with a window, and its backward.
                qp, kp, vp = put((3, 200, 60, d)), put((3, 260, 20, d)), put((3, 260, 20, d))
                outp = UnifiedTensor.empty(qp.shape, dtype, device="cuda")
                lp = UnifiedTensor.from_numpy(np.array([260, 100, 0], np.int32), device="cuda")
                eng.flash_attention_v2_with(qp, kp, vp, outp, kv_lens=lp)
                eng.flash_attention_v2_with(qp, kp, vp, outp, AttentionOptions(
                    dropout_prob=0.1, seed=4), UnifiedTensor.from_numpy(
                        rng.standard_normal((3, 1, 200, 260)).astype(dtype), device="cuda"))
                causal = AttentionOptions(causal=True, causal_offset=60, window=90)
                lsep = UnifiedTensor.empty((3, 60, 200), np.float32, device="cuda")
                eng.flash_attention_v2_with(qp, kp, vp, outp, causal, lse=lsep)
                # The backward given lse, no mask or dropout: the wgmma dQ and dK/dV kernels.
                gop = put(qp.shape)
                gradsp = [UnifiedTensor.empty(x.shape, dtype, device="cuda") for x in (qp, kp, vp)]
                eng.flash_attention_v2_backward_with(qp, kp, vp, outp, gop, *gradsp, causal,
                                                     lse=lsep)
            # Softcap, ALiBi ([B, H]) and sinks (with grad_sinks): the variants built with them
            # (the general wgmma ones at 64 and 128 in half precision), forward, the backward
            # with and without lse (then the sinks' kernel), and the decode kernels.
            def per_head(shape, lo, hi):
                return UnifiedTensor.from_numpy(rng.uniform(lo, hi, shape).astype(np.float32),
                                                device="cuda")
            sinks, gsinks = per_head((H,), -2, 2), UnifiedTensor.empty((H,), np.float32,
                                                                      device="cuda")
            mods = AttentionOptions(causal=True, causal_offset=20, window=40, softcap=5.0,
                                    dropout_prob=0.2, seed=3)
            named = dict(alibi_slopes=per_head((B, H), 0, 0.5), sinks=sinks)
            if not decode_only:
                eng.flash_attention_v2_with(q, k, v, out, mods, mask, lse=lse, **named)
                for given in (lse, None):
                    eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, mods, mask,
                                                         lse=given, grad_sinks=gsinks, **named)
            eng.flash_attention_v2_with(qm, kd, vd, outm, AttentionOptions(
                causal=True, causal_offset=695, softcap=5.0), maskm,
                lse=UnifiedTensor.empty((2, H, 5), np.float32, device="cuda"), kv_lens=lens,
                alibi_slopes=per_head((2, H), 0, 0.5), sinks=sinks)
            eng.flash_attention_v2_with(qd, kd, vd, outd, AttentionOptions(
                causal=True, causal_offset=699), lse=lsed, kv_lens=lens,
                alibi_slopes=per_head((H,), 0, 0.5), sinks=sinks)
            # Issue 26's visibility: a negative offset (the first rows dead) with a window of two
            # sides, forward and backward with and without lse; decode with a window whose
            # right side ends the keys read, and with a negative offset (every row dead).
            sides = AttentionOptions(causal_offset=-30, window_left=7, window_right=3,
                                     dropout_prob=0.2, seed=4)
            if not decode_only:
                eng.flash_attention_v2_with(q, k, v, out, sides, mask, lse=lse)
                for given in (lse, None):
                    eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, sides, mask,
                                                         lse=given)
            for dec in (AttentionOptions(causal_offset=300, window_left=90, window_right=40),
                        AttentionOptions(causal=True, causal_offset=-1, window_left=0)):
                eng.flash_attention_v2_with(qd, kd, vd, outd, dec, lse=lsed, kv_lens=lens)
            # A paged cache (pages of 16 and of 48, blocks in reverse order, one spare) in decode;
            # then appends of 3 keys into it and into the contiguous cache (rotated when d is
            # even: rotate-half and interleaved, partial rotary_dim), with 1 and 5 query rows.
            for page in (16, 48):
                blocks = -(-672 // page) * 2
                kp, vp = put((blocks + 1, page, Hkv, d)), put((blocks + 1, page, Hkv, d))
                table = UnifiedTensor.from_numpy(
                    np.arange(blocks, dtype=np.int32)[::-1].reshape(2, -1).copy(), device="cuda")
                lens_p = UnifiedTensor.from_numpy(np.array([672, 333], np.int32), device="cuda")
                cap = table.shape[1] * page
                eng.flash_attention_v2_with(qd, kp, vp, outd, AttentionOptions(
                    causal=True, causal_offset=cap - 1), lse=lsed, kv_lens=lens_p,
                    block_table=table)
                if not decode_only:  # and in prefill (80 rows a KV group: the paged forward)
                    qp = put((2, 40, H, d))
                    eng.flash_attention_v2_with(
                        qp, kp, vp, UnifiedTensor.empty(qp.shape, dtype, device="cuda"),
                        AttentionOptions(causal=True, causal_offset=cap - 40), kv_lens=lens_p,
                        block_table=table)
                for qa, cache_k, cache_v, tb in ((qd, kp, vp, table), (qm, kd, vd, None)):
                    rd = (d // 2) & ~1
                    rot = {} if rd < 2 else dict(
                        rotary_cos=UnifiedTensor.from_numpy(np.cos(rng.uniform(0, 6, (
                            cap + 8, rd // 2))).astype(np.float32), device="cuda"),
                        rotary_sin=UnifiedTensor.from_numpy(np.sin(rng.uniform(0, 6, (
                            cap + 8, rd // 2))).astype(np.float32), device="cuda"))
                    seqlens = UnifiedTensor.from_numpy(np.array([600, 0], np.int32),
                                                       device="cuda")
                    outa = UnifiedTensor.empty(qa.shape, dtype, device="cuda")
                    eng.attention_with_kvcache(
                        qa, cache_k, cache_v, outa, AttentionOptions(causal=True),
                        cache_seqlens=seqlens, k_new=put((2, 3, Hkv, d)),
                        v_new=put((2, 3, Hkv, d)), block_table=tb,
                        rotary_interleaved=page == 48, **rot)
            # Varlen: packed sequences (an empty one, one of a single row, ones longer than a
            # tile; the frame wider than every sequence) forward and backward with every
            # option, and a packed decode step (0-2 rows a sequence) on the decode kernels.
            for lens_q, lens_k, extra in (([130, 0, 1, 200], [150, 40, 0, 260], 7),
                                          ([2, 0, 1], [1500, 40, 0], 0)):
                cu = [UnifiedTensor.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(
                    np.int32), device="cuda") for n in (lens_q, lens_k)]
                qv, gov = put((sum(lens_q), H, d)), put((sum(lens_q), H, d))
                kv, vv = put((sum(lens_k), Hkv, d)), put((sum(lens_k), Hkv, d))
                outv = UnifiedTensor.empty(qv.shape, dtype, device="cuda")
                lsev = UnifiedTensor.empty((H, sum(lens_q)), np.float32, device="cuda")
                sinks = UnifiedTensor.from_numpy(rng.standard_normal(H).astype(np.float32),
                                                 device="cuda")
                named = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], sinks=sinks,
                             max_seqlen_q=max(lens_q) + extra, max_seqlen_k=max(lens_k) + extra)
                vopts = AttentionOptions(causal=True, window_left=50, softcap=3.0,
                                         dropout_prob=0.1, seed=9)
                eng.flash_attention_v2_with(qv, kv, vv, outv, vopts, lse=lsev, **named)
                if max(lens_q) > 2 and not decode_only:
                    gv = [UnifiedTensor.empty(x.shape, dtype, device="cuda") for x in (qv, kv, vv)]
                    gs = UnifiedTensor.empty((H,), np.float32, device="cuda")
                    for given in (lsev, None):
                        eng.flash_attention_v2_backward_with(qv, kv, vv, outv, gov, *gv, vopts,
                                                             lse=given, grad_sinks=gs, **named)
            if d % 2 == 0 and not decode_only:
                eng.rope(q, d, 3)
            import cupy

            cupy.cuda.Device().synchronize()
            print(f"{np.dtype(dtype)} d={d}: ok", flush=True)


if __name__ == "__main__":
    main()
