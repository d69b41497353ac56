"""Shared pieces of the benchmarks, used by compare.py and the pytest-benchmark suite alike: the
case list, FLOP and byte counts, tolerances, the CUDA-event timer, the device ceilings and device
information. `peers.py` holds the implementations timed side by side (ferrocupy, torch SDPA,
eager RoPE) and the float64 check; `report.py` turns results into the table, JSON and plot.

Issue 25's option gate holds each option case to >= GATE25_OPTION of the TFLOP/s of its plain
call: the same call (same shape, dtype, direction) without the option, ferrocupy against itself in
one run, both counted over the keys they see (`Case.plain_call` names the pair). bfloat16, D128:
- window: B1 S16384 H32/8, causal, window 4096, beside window 0 (`WINDOW_SHAPE`).
- dropout p=0.1, forward and backward: B4 S4096 H16 D128 causal (the bias case's shape, causal
  as the window case), beside p=0. Only ferrocupy: no peer draws ferrocupy's Philox mask, so no
  peer's answer could be checked; ferrocupy's is checked against the float64 reference with the
  exact mask (SPEC "Dropout") on the sampled heads, so a wrong mask or scale fails the check.
- kv_lens, forward: a chunk of 1024 queries into a KV cache of capacity 4096 holding 3072 keys in
  every sequence (B16 H16, causal, bottom-right: causal_offset = Sk - Sq as SPEC's decode step),
  beside the full cache without kv_lens. The cache slots past kv_lens hold NaN, so an answer that
  read them fails the check. Only ferrocupy (SDPA and FlexAttention have no causal_offset).
- GQA, forward and backward: the grid's GQA case (B4 S4096 H32/8 D128 causal) beside the same
  call with as many KV heads as query heads (H32/32): the same FLOPs and the same query work, so
  the ratio is what sharing K/V across a group costs or saves.
The additive bias [1, H, S, S] is gated against SDPA with the same bias (forward); its backward
(ferrocupy given the forward's lse, SDPA through autograd with the same attn_mask) is reported,
not gated.

Issue 26's gate (bfloat16, `issue26_cases`; ferrocupy's own calls beside each other unless said):
- head_dim 256 ("attn-...-d256-..."), forward and backward (given lse), S 4096 and 16384, causal
  and not, H8 (hidden 2048), B = 16384 / S: >= GATE26_D256 of torch's default SDPA.
- varlen ("varlen-..."): VARLEN_LENGTHS, 8 packed sequences of 16384 tokens (cu_seqlens), H16
  D128, forward and backward, causal and not, >= GATE26_VARLEN of the TFLOP/s of the dense call
  at their mean length (B8 S2048, "-dense"), the varlen call counted over its real work (the sum
  of its sequences' FLOPs). The dense call also runs torch's default SDPA, for reference.
- paged decode ("paged-..."): the decode shapes (DECODE_SHAPES, one query row), the cache as
  pages of 16 and of 256 keys (block_table: each sequence's blocks a random permutation of the
  pool), every sequence full (kv_lens), beside the same keys contiguous with kv_lens ("-page0"):
  paged time <= GATE26_PAGED x contiguous time. Both sides are timed as the kernels' launches
  alone (as lab/paged_decode_ab.py): ferrocupy's front door reads every index tensor (kv_lens,
  block_table, cu_seqlens) to the host before launching, a host round trip per call that is
  not the kernels' (and is a tenth of a small decode); the first call, the one checked, goes
  through the front door with every check. The varlen cases are timed the same way.
- softcap (MODS_SOFTCAP), ALiBi (the usual slopes 2^(-8 (h + 1) / H)) and attention sinks
  (MODS_SINKS), forward and backward (the sinks' backward writes grad_sinks too; its value is
  not checked: it sums over every batch entry, while the check samples heads), each alone
  beside the same call without it ("mods-...-plain"), B4 S4096 H16 D128 causal (MODS_SHAPE):
  >= GATE26_MODS of the plain call's TFLOP/s. The values are chosen so that an option left out
  moves the answer well past the check's tolerance.

Nothing here imports CuPy or PyTorch at module level: the pure parts (cases, counting, the timing
logic with injected events) run and are tested on a machine without a GPU.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass, field, replace

DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKENS, HIDDEN = 16384, 2048                      # batch * seq and heads * head_dim of the grid
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQS = (1024, 4096)
FLOOR = dict(batch=4, seq=4096, heads=16, head_dim=128)   # issue 3's float32 floor shape
FLOOR_ROPE_SHAPE = (8, 8192, 32, 128)                     # 1 GiB of float32
ROPE_SHAPE = (16, 4096, 32, 128)
FLOOR_ATTN_RATIO = 0.5       # ferrocupy >= half of torch SDPA `efficient` (float32)
FLOOR_ROPE_PCT = 60.0        # RoPE >= 60% of device-to-device copy bandwidth
# Issue 27's gate: every out-of-place RoPE form (what ferrocupy.torch.rope runs: read x once,
# write out once) at >= 85% of the device-to-device copy bandwidth measured in the same run.
GATE_ROPE_PCT = 85.0
ROPE_FORMS = ("full", "partial", "interleaved", "positions")  # partial: rotary_dim = D/2
# Issue 25's gate, ferrocupy against torch's default SDPA (no sdpa_kernel context) in one run:
# the half-precision grid at these head dims and lengths (causal and not), forward each case >=
# 1.0x and geometric mean >= 1.1x, backward (given lse) >= 0.9x and >= 1.0x; the training step
# >= 1.0x; the additive bias (forward) >= 1.25x SDPA with the same bias; each option case
# (window, dropout, kv_lens, GQA) >= 0.9x its plain call's TFLOP/s, both counted over visible
# keys (see the module docstring). The grid's GQA cases run in every dtype; those in
# GATE25_GQA_DTYPES have a plain call beside them (issue25_cases) and are gated.
GATE25_DTYPES, GATE25_DIMS, GATE25_SEQS = ("bfloat16", "float16"), (64, 128), (1024, 4096, 16384)
GATE25_FWD, GATE25_BWD = (1.0, 1.1), (0.9, 1.0)            # (each case, geometric mean)
GATE25_TRAIN, GATE25_BIAS, GATE25_OPTION = 1.0, 1.25, 0.9
GATE25_GQA_DTYPES = ("bfloat16",)
# Issue 25's cases (bfloat16): training steps (B, S, H, Hkv, D), all causal; the additive bias
# [1, H, S, S] (B, S, H, D), not causal, forward and backward; the option cases beside their plain
# calls: the sliding window (B, S, H, Hkv, D, window), dropout (B, S, H, D), kv_lens (B, Sq, Sk,
# H, D, kv_lens), all causal; GQA is the grid's GQA_SHAPE beside H KV heads.
TRAIN_SHAPES = ((4, 4096, 16, 16, 128), (2, 8192, 32, 8, 128), (8, 2048, 16, 4, 64))
BIAS_SHAPE = (4, 4096, 16, 128)
WINDOW_SHAPE = (1, 16384, 32, 8, 128, 4096)
DROPOUT_SHAPE, DROPOUT_P, DROPOUT_SEED = (4, 4096, 16, 128), 0.1, 1234
KVLENS_SHAPE = (16, 1024, 4096, 16, 128, 3072)
GQA_SHAPE = (4, 4096, 32, 8, 128)                  # the grid's GQA case (B, S, H, Hkv, D), causal
# Issue 26's gate (see the module docstring): head_dim 256 against torch's default SDPA, varlen
# against the dense call at the mean length (TFLOP/s over real work), paged decode's time against
# contiguous decode's, softcap / ALiBi / sinks against the plain call (TFLOP/s).
GATE26_D256, GATE26_VARLEN, GATE26_PAGED, GATE26_MODS = 1.1, 0.9, 1.05, 0.9
D256_SEQS = (4096, 16384)
# 8 packed sequences of 16384 tokens, mean 2048, ragged as documents are (not tile multiples)
VARLEN_LENGTHS = (500, 4096, 1000, 3100, 1536, 2560, 771, 2821)
VARLEN_HEADS, VARLEN_DIM = 16, 128
PAGE_SIZES = (16, 256)
MODS = ("softcap", "alibi", "sinks")
MODS_SHAPE = (4, 4096, 16, 128)                    # (B, S, H, D), causal
MODS_SOFTCAP = 2.0                                 # scores ~N(0, 1): the cap bends them
MODS_SINKS = (2.0, 6.0)                            # sinks[h] spread evenly over this range
ISSUE26_SUITES = ("d256", "varlen", "paged", "mods")
# The field each option suite sets (its type's zero: its plain call); GQA's plain call has
# kv_heads = heads.
OPTION_FIELDS = {"window": "window", "dropout": "dropout", "kvlens": "kv_len",
                 "varlen": "seqlens", "paged": "page_size", "mods": "mod"}

# Relative error ||impl - ref|| / ||ref|| against a float64 reference, per dtype: (forward,
# backward). These guard against timing a wrong answer; precision itself is the tests' business.
# bf16/fp16 are issue 5's bars; float32 is looser than issue 3's test bars (1e-5 / 1e-4) because
# the benchmark sizes reach 16k keys, but still tight enough to flag a TF32 slip.
ATTN_TOL = {"float32": (1e-4, 1e-3), "bfloat16": (2e-2, 5e-2), "float16": (5e-3, 1e-2)}
# RoPE angles reach 8191 rad, so one ulp of difference in a float32 inverse frequency (powf
# differs by an ulp across libraries) moves an output by up to ~5e-4 relative.
ROPE_TOL = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 5e-3}


@dataclass(frozen=True)
class Case:
    """One benchmark case; attention shapes as ferrocupy's: q [B, Sq, H, D], k/v [B, Sk, Hkv, D]."""

    kind: str                  # "attn" (grid and GQA), "decode" or "rope"
    dtype: str
    batch: int = 1
    seq_q: int = 0
    seq_k: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    causal: bool = False
    causal_offset: int = 0
    direction: str = "fwd"     # "fwd", "bwd" or "step" (a training step: forward + backward)
    shape: tuple = ()          # RoPE: the tensor's [B, S, H, D]
    rope: str = ""             # RoPE: "" the seed's call (in place), else a ROPE_FORMS entry
    suite: str = "grid"        # "grid", "gqa", "decode", "rope"; issue 25's "train", "bias",
    #                            "window", "dropout", "kvlens" (the bias case: an additive
    #                            [1, H, Sq, Sk] mask)
    floor: bool = False        # one of issue 3's performance-floor cases
    window: int = 0            # attention: key j visible iff |i + causal_offset - j| < window
    dropout: float = 0.0       # attention: dropout_prob (seed DROPOUT_SEED)
    kv_len: int = 0            # attention: kv_lens of every batch entry (0: no kv_lens)
    seqlens: tuple = ()        # varlen: the packed sequences' lengths (batch of them, summing
    #                            to batch * seq_q); () the dense call
    page_size: int = 0         # paged decode: keys per page (0: a contiguous cache)
    mod: str = ""              # one of MODS ("" the plain call)

    @property
    def id(self) -> str:
        if self.kind == "rope":
            form = f"-{self.rope}" if self.rope else ""
            return f"rope-{self.dtype}-{'x'.join(map(str, self.shape))}{form}"
        if self.suite == "paged":
            return (f"paged-{self.dtype}-b{self.batch}-h{self.heads}kv{self.kv_heads}"
                    f"-d{self.head_dim}-sk{self.seq_k}-page{self.page_size}")
        if self.kind == "decode":
            return (f"decode-{self.dtype}-b{self.batch}-h{self.heads}kv{self.kv_heads}"
                    f"-d{self.head_dim}-sk{self.seq_k}" + (f"-q{self.seq_q}" if self.seq_q > 1 else ""))
        mask = "causal" if self.causal else "noncausal"
        if self.suite in ("train", "bias", "window", "dropout", "kvlens", "varlen", "mods"):
            # direction "step": forward + backward, timed as one; the option last (0: plain)
            heads = f"h{self.heads}" + (f"kv{self.kv_heads}" if self.suite != "bias" else "")
            seq = f"s{self.seq_q}" + (f"-sk{self.seq_k}" if self.seq_k != self.seq_q else "")
            last = {"window": f"-w{self.window}", "dropout": f"-p{self.dropout:g}",
                    "kvlens": f"-kvlen{self.kv_len}",
                    "varlen": "-mixed" if self.seqlens else "-dense",
                    "mods": f"-{self.mod or 'plain'}"}.get(self.suite, "")
            return (f"{self.suite}-{self.direction}-{self.dtype}-b{self.batch}-{heads}"
                    f"-d{self.head_dim}-{seq}-{mask}{last}")
        heads = f"-h{self.heads}kv{self.kv_heads}" if self.suite == "gqa" else ""
        return (f"{'gqa' if self.suite == 'gqa' else 'attn'}-{self.direction}-{self.dtype}"
                f"{heads}-d{self.head_dim}-s{self.seq_q}-{mask}")

    @property
    def plain_call(self) -> "Case | None":
        """Issue 25's and 26's option gates: this case without its option (window 0, dropout
        0, no kv_lens, GQA's kv_heads = heads; issue 26's dense call, contiguous cache, no
        softcap/ALiBi/sinks; the same shape), whose ferrocupy throughput this case is held to.
        None for a plain call, any other case, and GQA outside GATE25_GQA_DTYPES."""
        if self.suite == "gqa":
            gated = self.kv_heads != self.heads and self.dtype in GATE25_GQA_DTYPES
            return replace(self, kv_heads=self.heads) if gated else None
        name = OPTION_FIELDS.get(self.suite)
        value = getattr(self, name) if name else None
        return replace(self, **{name: type(value)()}) if value else None

    @property
    def issue26(self) -> bool:
        """One of issue 26's cases (a gated one or a plain call beside one)."""
        return self.suite in ISSUE26_SUITES

    @property
    def gate(self) -> bool:
        """One of issue 27's RoPE gate cases (>= GATE_ROPE_PCT of copy bandwidth)."""
        return self.kind == "rope" and bool(self.rope)

    @property
    def rotary_dim(self) -> int:
        """RoPE: the rotated width (half the head under the partial form)."""
        return self.shape[-1] // 2 if self.rope == "partial" else self.shape[-1]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def unit(self) -> str:
        return "TFLOP/s" if self.kind == "attn" else "GB/s"

    @property
    def flops(self) -> int:
        if self.kind == "rope":
            return 0
        if self.seqlens:                        # the real work: each sequence's own
            return sum(attention_flops(1, self.heads, n, n, self.head_dim, self.causal,
                                       self.direction) for n in self.seqlens)
        if self.suite in ("window", "kvlens"):  # the option and its plain call alike: the
            keys = self.kv_len or self.seq_k      # visible pairs (kv_lens: rows sit kv_len -
            shift = keys - self.seq_k             # seq_k positions earlier)
            pairs = visible_pairs(self.seq_q, keys, self.causal, self.window,
                                  self.causal_offset + shift)
            return attention_flops(self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim,
                                   self.causal, self.direction, pairs)
        return attention_flops(self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim,
                               self.causal and self.causal_offset == 0, self.direction)

    @property
    def bytes(self) -> int:
        """Decode: bytes of K and V; RoPE: bytes read + written (every element read once and
        written once, in place or out of place); attention: its inputs + outputs (+ the bias)."""
        if self.kind == "rope":
            return 2 * math.prod(self.shape) * self.itemsize
        kv = 2 * self.batch * self.seq_k * self.kv_heads * self.head_dim * self.itemsize
        if self.kind == "decode":
            return kv
        qo = 2 * self.batch * self.seq_q * self.heads * self.head_dim * self.itemsize
        bias = self.heads * self.seq_q * self.seq_k * self.itemsize if self.suite == "bias" else 0
        return (qo + kv) * (1 if self.direction == "fwd" else 2) + bias

    def throughput(self, ms: float) -> float:
        """TFLOP/s for attention, GB/s for decode and RoPE, at `ms` per call."""
        if not ms or ms <= 0:
            return float("nan")
        work = self.flops / 1e12 if self.unit == "TFLOP/s" else self.bytes / 1e9
        return work / (ms * 1e-3)

    @property
    def tolerance(self) -> float:
        if self.kind == "rope":
            return ROPE_TOL[self.dtype]
        return ATTN_TOL[self.dtype][self.direction != "fwd"]


def attention_flops(batch, heads, seq_q, seq_k, head_dim, causal, direction="fwd",
                    pairs=None) -> int:
    """FlashAttention's convention: 4*B*H*Sq*Sk*D forward, half for causal, 2.5x for backward,
    3.5x for a training step (forward + backward). Given `pairs` (the visible (query, key)
    pairs of a head, `visible_pairs`), 4*B*H*D per pair instead."""
    if pairs is not None:
        f = 4 * batch * heads * head_dim * pairs
    else:
        f = 4 * batch * heads * seq_q * seq_k * head_dim
        f = f // 2 if causal else f
    return {"fwd": f, "bwd": f * 5 // 2, "step": f * 7 // 2}[direction]


def visible_pairs(seq_q, seq_k, causal, window=0, causal_offset=0) -> int:
    """(query, key) pairs visible under ferrocupy's rule: query i at position p = i + offset sees
    key j iff (not causal or j <= p) and (window == 0 or |p - j| < window), 0 <= j < seq_k."""
    total = 0
    for i in range(seq_q):
        p = i + causal_offset
        lo, hi = 0, seq_k - 1
        if causal:
            hi = min(hi, p)
        if window:
            lo, hi = max(lo, p - window + 1), min(hi, p + window - 1)
        total += max(0, hi - lo + 1)
    return total


DECODE_SHAPES = ((16, 32768), (1, 131072), (64, 2048))  # (batch, keys); H32 Hkv8 D128, Sq 1


def build_cases(dtypes=("float32",), quick: bool = False) -> list[Case]:
    """The cases for `dtypes`; `quick` keeps the floor, D128 S in {1k, 4k}, decode and RoPE
    (every RoPE case: the seed's in place, and issue 27's out-of-place forms)."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype(s) {unknown}; choose from {', '.join(DTYPES)}")
    cases = []
    for dt in dtypes:
        for d in ((128,) if quick else (64, 128)):
            for direction in ("fwd", "bwd"):
                for causal in (False, True):
                    for s in (QUICK_SEQS if quick else SEQS):
                        floor = (dt == "float32" and d == FLOOR["head_dim"] and s == FLOOR["seq"]
                                 and TOKENS // s == FLOOR["batch"])
                        cases.append(Case("attn", dt, TOKENS // s, s, s, HIDDEN // d,
                                          HIDDEN // d, d, causal, direction=direction,
                                          floor=floor))
        if not quick:
            b, s, h, kv, d = GQA_SHAPE
            for direction in ("fwd", "bwd"):
                cases.append(Case("attn", dt, b, s, s, h, kv, d, True, direction=direction,
                                  suite="gqa"))
        for batch, keys in DECODE_SHAPES[:1] if quick else DECODE_SHAPES:  # 1 GiB of f32 K+V
            cases.append(Case("decode", dt, batch, 1, keys, 32, 8, 128, True, keys - 1,
                              suite="decode"))
        if not quick:  # 4 query rows a head (16 a KV group), every key visible to each
            cases.append(Case("decode", dt, 16, 4, 32768, 32, 8, 128, True, 32767,
                              suite="decode"))
        if not quick and dt == "bfloat16":
            cases.extend(issue25_cases(dt))
            cases.extend(issue26_cases(dt))
        cases.append(Case("rope", dt, shape=ROPE_SHAPE, suite="rope"))
        cases.extend(Case("rope", dt, shape=ROPE_SHAPE, suite="rope", rope=form)
                     for form in ROPE_FORMS)
        if dt == "float32":
            cases.append(Case("rope", dt, shape=FLOOR_ROPE_SHAPE, suite="rope", floor=True))
    return cases


def issue25_cases(dt: str) -> list[Case]:
    """The training steps, the additive bias (forward, backward), and each option case beside its
    plain call: the window, dropout (forward, backward), kv_lens, and the plain calls of the
    grid's GQA cases (which build_cases lists with the grid)."""
    cases = [Case("attn", dt, b, s, s, h, kv, d, True, direction="step", suite="train")
             for b, s, h, kv, d in TRAIN_SHAPES]
    b, s, h, d = BIAS_SHAPE
    cases.extend(Case("attn", dt, b, s, s, h, h, d, False, direction=direction, suite="bias")
                 for direction in ("fwd", "bwd"))
    b, s, h, kv, d, w = WINDOW_SHAPE
    cases.extend(Case("attn", dt, b, s, s, h, kv, d, True, suite="window", window=win)
                 for win in (w, 0))
    b, s, h, d = DROPOUT_SHAPE
    cases.extend(Case("attn", dt, b, s, s, h, h, d, True, direction=direction, suite="dropout",
                      dropout=p) for direction in ("fwd", "bwd") for p in (DROPOUT_P, 0.0))
    b, sq, sk, h, d, n = KVLENS_SHAPE
    cases.extend(Case("attn", dt, b, sq, sk, h, h, d, True, sk - sq, suite="kvlens", kv_len=kv)
                 for kv in (n, 0))
    b, s, h, _, d = GQA_SHAPE
    cases.extend(Case("attn", dt, b, s, s, h, h, d, True, direction=direction, suite="gqa")
                 for direction in ("fwd", "bwd"))
    return cases


def issue26_cases(dt: str) -> list[Case]:
    """head_dim 256 against SDPA; varlen beside the dense call at its mean length; paged decode
    beside contiguous decode; softcap, ALiBi and sinks beside the plain call (see the module
    docstring)."""
    d = 256
    cases = [Case("attn", dt, TOKENS // s, s, s, HIDDEN // d, HIDDEN // d, d, causal,
                  direction=direction, suite="d256")
             for direction in ("fwd", "bwd") for causal in (False, True) for s in D256_SEQS]
    n, h, d = len(VARLEN_LENGTHS), VARLEN_HEADS, VARLEN_DIM
    mean = sum(VARLEN_LENGTHS) // n
    cases.extend(Case("attn", dt, n, mean, mean, h, h, d, causal, direction=direction,
                      suite="varlen", seqlens=lens)
                 for direction in ("fwd", "bwd") for causal in (True, False)
                 for lens in (VARLEN_LENGTHS, ()))
    cases.extend(Case("decode", dt, batch, 1, keys, 32, 8, 128, True, keys - 1, suite="paged",
                      kv_len=keys, page_size=page)
                 for batch, keys in DECODE_SHAPES for page in PAGE_SIZES + (0,))
    b, s, h, d = MODS_SHAPE
    cases.extend(Case("attn", dt, b, s, s, h, h, d, True, direction=direction, suite="mods",
                      mod=mod) for direction in ("fwd", "bwd") for mod in MODS + ("",))
    return cases


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slopes for `heads` heads (a power of two): 2^(-8 (h + 1) / heads)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def sink_logits(heads: int) -> list[float]:
    """The sinks' logits: MODS_SINKS's range spread evenly over the heads."""
    lo, hi = MODS_SINKS
    return [lo + (hi - lo) * h / max(1, heads - 1) for h in range(heads)]


def filter_cases(cases, patterns) -> list[Case]:
    """Cases whose id contains any of the comma-separated substrings (all cases when empty)."""
    pats = [p.strip() for p in (patterns or "").split(",") if p.strip()]
    return [c for c in cases if not pats or any(p in c.id for p in pats)]


def parse_dtypes(text) -> list[str]:
    names = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
             "f16": "float16", "half": "float16"}
    out = [names.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()]
    bad = [d for d in out if d not in DTYPES]
    if bad:
        raise ValueError(f"unknown dtype(s) {bad}; choose from {', '.join(DTYPES)}")
    return list(dict.fromkeys(out))


# --- timing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    warmup_ms: float = 25.0     # device time spent warming up (at least `min_warmup` calls)
    target_ms: float = 150.0    # device time of the timed repetitions
    min_reps: int = 5
    max_reps: int = 100
    min_warmup: int = 2
    # Then at least this much device time of back-to-back calls, untimed, before the timed ones.
    # A device that has been idle (the CPU checking the answer against float64) ran compare.py's
    # first implementation of a case 15-20% slower for its first 15-40 ms of back-to-back calls,
    # then at full speed (per-call times in results-decode-*-first-h100.json, H100, 2026-12-06:
    # fp16 B16 825 -> 696 us after 18 calls, float32 B16 1674 -> 1419 after 9, bf16 B1 218 -> 189
    # after 62), while the peers timed after it ran at full speed from their first call: the
    # first implementation was timed partly in the slow state.
    settle_ms: float = 100.0


QUICK = Settings(warmup_ms=20.0, target_ms=100.0, min_reps=5, max_reps=50)
FULL = Settings()


def plan_reps(est_ms: float, s: Settings) -> int:
    if not est_ms or est_ms <= 0 or not math.isfinite(est_ms):
        return s.max_reps
    return max(s.min_reps, min(s.max_reps, math.ceil(s.target_ms / est_ms)))


def rotation_sets(working_set_bytes: int, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate among so that consecutive calls do not hit in L2: enough
    that their total is at least 3x L2, one when one set already is."""
    if working_set_bytes <= 0 or l2_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / working_set_bytes)))


@dataclass
class Timing:
    median_ms: float
    times_ms: list = field(default_factory=list)
    warmup_calls: int = 0
    settle_calls: int = 0  # back-to-back calls after the warm-up, untimed (`settle`)

    @property
    def reps(self) -> int:
        return len(self.times_ms)


class CupyEvents:
    """The device-event backend of the timers: CUDA events through CuPy."""

    def record(self, stream):
        import cupy

        ev = cupy.cuda.Event()
        ev.record(stream)
        return ev

    def synchronize(self, ev) -> None:
        ev.synchronize()

    def elapsed_ms(self, a, b) -> float:
        import cupy

        return float(cupy.cuda.get_elapsed_time(a, b))


def time_calls(call, stream, settings: Settings, events=None) -> Timing:
    """Median device time of `call()`: warm-up (first call's compilation stays out), calls back
    to back until the device runs at full speed (`settle`), then back-to-back repetitions, each
    between its own pair of events on `stream`, no host synchronisation until the last. `call`
    rotates its own input sets."""
    ev = events or CupyEvents()
    n, spent, est = 0, 0.0, float("nan")
    while n < settings.min_warmup or (spent < settings.warmup_ms and n < 1000):
        a = ev.record(stream)
        call()
        b = ev.record(stream)
        ev.synchronize(b)
        est = ev.elapsed_ms(a, b)
        spent += est
        n += 1
    settle_calls = settle(call, stream, settings, ev, est)
    pairs = []
    for _ in range(plan_reps(est, settings)):
        a = ev.record(stream)
        call()
        pairs.append((a, ev.record(stream)))
    ev.synchronize(pairs[-1][1])
    times = [ev.elapsed_ms(a, b) for a, b in pairs]
    return Timing(statistics.median(times), times, n, settle_calls)


def settle(call, stream, settings: Settings, ev, est_ms: float) -> int:
    """Back-to-back batches of calls (untimed: their times are discarded) for at least
    `settings.settle_ms` of device time, and on while a batch's median is still more than 1%
    under the previous batch's (the device still speeding up), up to 4x that. Returns the calls
    made."""
    if settings.settle_ms <= 0:
        return 0
    per = max(1e-3, est_ms if math.isfinite(est_ms) else 1.0)
    batch = max(3, math.ceil(settings.settle_ms / 4 / per))
    spent, calls, prev = 0.0, 0, float("inf")
    while spent < 4 * settings.settle_ms:
        pairs = []
        for _ in range(batch):
            a = ev.record(stream)
            call()
            pairs.append((a, ev.record(stream)))
        ev.synchronize(pairs[-1][1])
        times = [ev.elapsed_ms(a, b) for a, b in pairs]
        spent += sum(times)
        calls += batch
        med = statistics.median(times)
        if spent >= settings.settle_ms and med >= prev * 0.99:
            break
        prev = min(prev, med)
    return calls


class GpuClock:
    """A pytest-benchmark timer that reads device time: each call records an event on `stream`,
    waits for it, and returns the seconds of device time since the first call, so that
    `end - start` around a call is the device time between its two events."""

    __name__ = "cuda_event_clock"

    def __init__(self, events=None):
        self.events = events
        self.stream = None
        self._last, self._total = None, 0.0

    def __call__(self) -> float:
        ev = self.events or CupyEvents()
        e = ev.record(self.stream)
        ev.synchronize(e)
        if self._last is not None:
            self._total += ev.elapsed_ms(self._last, e) / 1e3
        self._last = e
        return self._total


GPU_CLOCK = GpuClock()


# --- device ---------------------------------------------------------------------------------------
def gpu_status() -> tuple[bool, str]:
    """(usable, why not): CuPy importable and at least one CUDA device visible."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA device usable ({type(e).__name__}: {e})"
    return (n > 0, "" if n > 0 else "CuPy sees no CUDA device")


def suite_skip_reason():
    """Why the pytest-benchmark suite cannot run here, or None when it can."""
    ok, why = gpu_status()
    if not ok:
        return f"no GPU to benchmark on: {why}; GPU benchmarks skipped"
    try:
        import pytest_benchmark  # noqa: F401
    except ImportError:
        return "pytest-benchmark is not installed (pip install pytest-benchmark)"
    return None


def case_by_id(case_id: str) -> Case:
    """Any case of the full set, every dtype, by its id."""
    if not _BY_ID:
        _BY_ID.update((c.id, c) for c in build_cases(DTYPES))
    return _BY_ID[case_id]


_BY_ID: dict = {}


def torch_cuda():
    """PyTorch when it imports and sees the GPU, else None."""
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def torch_stream_for_cupy(torch):
    """PyTorch's current stream as a CuPy stream, for recording events where torch launches."""
    import warnings

    import cupy

    ts = torch.cuda.current_stream()
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(ts, "__cuda_stream__"):
        try:
            return cupy.cuda.Stream.from_external(ts)
        except Exception:
            pass
    with warnings.catch_warnings():      # deprecated in CuPy 14, still there
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ts.cuda_stream)


def l2_bytes() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])


def _version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def device_info() -> dict:
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": name, "compute_capability": f"{props['major']}.{props['minor']}",
            "sms": props["multiProcessorCount"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "l2_mb": round(props["l2CacheSize"] / 1e6, 1), "l2_bytes": int(props["l2CacheSize"]),
            "driver": _driver_version() or f"CUDA {_version(rt.driverGetVersion())} (driver API)",
            "cuda_runtime": _version(rt.runtimeGetVersion()), "cupy": cupy.__version__,
            "cupy_tf32": os.environ.get("CUPY_TF32", "unset"), "python": platform.python_version(),
            "torch": None, "torch_cuda": None, "cudnn": None, "ferrocupy": _git_revision()}
    torch = torch_cuda()
    if torch is not None:
        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(),
                    torch_matmul_precision=torch.get_float32_matmul_precision())
    return info


def _driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except Exception:
        return None


def _git_revision():
    """`git describe` of this checkout, or FERRO_REVISION where the caller knows better (a copy of
    the working tree whose .git is another commit's, as on a lent device)."""
    if os.environ.get("FERRO_REVISION"):
        return os.environ["FERRO_REVISION"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return rev or None
    except Exception:
        return None


# --- ceilings -------------------------------------------------------------------------------------
def measure_ceilings(dtypes, settings: Settings, events=None) -> dict:
    """Device-to-device copy bandwidth (bytes read + written, 1 GiB) and a large matrix product
    per dtype through cuBLAS (CuPy; PyTorch for bfloat16 where CuPy has no bfloat16)."""
    import cupy

    out = {"copy_gbps": None, "copy": {}, "matmul_tflops": {}, "matmul": {}}
    n = 1 << 28                                   # float32 elements: 1 GiB
    src = cupy.random.default_rng(7).standard_normal(n, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream()
    rt = cupy.cuda.runtime

    def memcpy():
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, stream.ptr)

    for name, fn in (("cudaMemcpyAsync", memcpy), ("copy kernel", lambda: cupy.copyto(dst, src))):
        t = time_calls(fn, stream, settings, events)
        out["copy"][name] = 2 * src.nbytes / (t.median_ms * 1e-3) / 1e9
    out["copy_gbps"] = max(out["copy"].values())
    src = dst = None                              # hand the 2 GiB back before the matmuls
    for dt in dtypes:
        try:
            tflops, via = _matmul_tflops(dt, settings, events)
        except Exception as e:  # reported, not fatal: the ratios to peers still stand
            out["matmul"][dt] = f"not measured: {type(e).__name__}: {e}"
            continue
        out["matmul_tflops"][dt] = tflops
        note = via
        if dt == "float32":
            note += (" (TF32 on: CUPY_TF32=1)" if os.environ.get("CUPY_TF32") == "1"
                     else " (plain FP32, CUPY_TF32 unset/0)")
        out["matmul"][dt] = note
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def _matmul_tflops(dtype: str, settings: Settings, events=None) -> tuple[float, str]:
    import cupy

    n = 8192
    rng = cupy.random.default_rng(11)
    a32, b32 = (rng.standard_normal((n, n), dtype=cupy.float32) for _ in range(2))
    dt = _cupy_dtype(dtype)
    try:
        if dt is None:
            raise TypeError(f"this CuPy has no {dtype}")
        a, b = a32.astype(dt), b32.astype(dt)
        c = cupy.empty_like(a)
        t = time_calls(lambda: cupy.matmul(a, b, out=c), cupy.cuda.get_current_stream(),
                       settings, events)
        via = f"cupy.matmul {n}x{n}x{n}"
    except Exception as e:       # bfloat16 without CuPy support: through PyTorch's cuBLAS
        torch = torch_cuda()
        if torch is None:
            raise RuntimeError(f"CuPy matmul failed for {dtype} ({e}); no PyTorch") from None
        a, b = (torch.from_dlpack(x).to(getattr(torch, dtype)) for x in (a32, b32))
        c = torch.empty_like(a)
        t = time_calls(lambda: torch.matmul(a, b, out=c), torch_stream_for_cupy(torch), settings,
                       events)
        via = f"torch.matmul {n}x{n}x{n}"
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12, via


def _cupy_dtype(name: str):
    """The CuPy dtype for `name`, or None where this CuPy cannot hold it (bfloat16 needs
    CuPy >= 14 with ml_dtypes installed)."""
    import numpy as np

    if name != "bfloat16":
        return np.dtype(name)
    try:
        import cupy
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
        cupy.ones(2, dtype=cupy.float32).astype(dt).astype(cupy.float32)
        return dt
    except Exception:
        return None
