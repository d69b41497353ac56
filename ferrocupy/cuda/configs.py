"""Every kernel variant the CUDA backend can launch, in one table: its source, tile geometry,
shared memory and arguments. The backend selects from it, the kernels receive its geometry as
defines (and static_assert the shared memory it computes), and the compile tests build every
entry, so a tile size lives here and nowhere else.

Geometry: a block has `warps` warps; each warp owns `16 * mt` rows (query rows, or keys for
dK/dV), so a block covers `block_rows = 16 * mt * warps` of them and steps through the other
sequence `step` at a time (BN keys, or BQ query rows for dK/dV). Head dims are padded to a
multiple of 16 (the mma k size); the table is keyed by that padded size.

Two instruction sets: `mma` (mma.sync, any GPU from sm_80) and `wgmma` (sm_90a's warpgroup
products, compiled with -arch=sm_90a, run only on compute capability 9.0 and only with 16-byte
rows). A wgmma variant serves the padded head_dims just below its own (`head_dim` is the
kernel's, zero-filled past the real one).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np

from ..dtypes import BFLOAT16, FLOAT16, FLOAT32

FORWARD, BACKWARD_DQ, BACKWARD_DKDV, ROPE = "forward", "backward_dq", "backward_dkdv", "rope"
DECODE = "decode"  # the forward of few rows against many keys: split-KV, then the splits merged
DECODE_ROWS = 16  # query rows of a KV group (heads / kv_heads * seq_q) the decode kernels take
DECODE_MAX_SPLITS = 256  # key splits per (batch, KV head): more only lengthen the merge
COMBINE_THREADS = 128  # the combine kernel's least block (one per output row; the tiles design)
HEAD_DIMS = tuple(range(16, 257, 16))  # padded head_dim of every attention variant
# The widest padded head_dim lab/tile_sweep.py measured; wider ones take FlashAttention-2's sm80
# tile shapes (flash_fwd_launch_template.h, flash_bwd_launch_template.h) until a sweep re-orders
# them, and on sm_90a the wgmma forward and dQ (dK/dV on mma.sync): `_wgmma`.
MEASURED_HEAD_DIM = 128
# Shared memory per block that some target GPU allows (sm_90's opt-in; sm_80 allows 163 KB,
# sm_86 / sm_89 99 KB): a candidate needing more is left out of the table.
MAX_SHARED_BYTES = 227 * 1024

ARGS = {
    FORWARD: ("q", "k", "v", "out", "mask", "lse", "kv_lens", "alibi_slopes", "sinks",
              "cu_seqlens_q", "cu_seqlens_k"),
    BACKWARD_DQ: ("q", "k", "v", "out", "grad_out", "grad_q", "mask", "stats", "lse",
                  "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k"),
    BACKWARD_DKDV: ("q", "k", "v", "grad_out", "grad_k", "grad_v", "mask", "stats",
                    "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k"),
    DECODE: ("q", "k", "v", "part_o", "part_ml", "tickets", "out", "lse", "mask", "kv_lens",
             "block_table", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "splits",
             "split_keys"),
}
# Every attention kernel takes, after its buffers, `vec`, `mask_kind`, the layout, the seed's
# struct and the AttnExtras struct (softcap; whether alibi_slopes is [batch, heads]).
# The backward's last launch where the call asks for grad_sinks: one block of SINKS_THREADS per
# head reads the dQ kernel's stats (stats, sinks, grad_sinks, cu_seqlens_q, the struct, the
# extras).
SINKS_SOURCE, SINKS_KERNEL, SINKS_THREADS = "flash_bwd_sinks.cu", "flash_bwd_sinks", 256
# The KV-cache append (append_kv.cu), launched before the attention of its plan: a thread per
# element it writes; with RoPE, the rotated q goes to the workspace's Q_ROTATED, which the
# attention launches then read as q.
APPEND_SOURCE, APPEND_KERNEL, APPEND_THREADS = "append_kv.cu", "append_kv", 256
Q_ROTATED = "q_rot"
APPEND_DTYPE_DEFINE = {FLOAT32: 0, FLOAT16: 1, BFLOAT16: 2}
# The backward not given the forward's lse, where the dQ kernel given one is a wgmma variant
# (which has no statistics pass of its own): the plan runs the forward first (dropout off: the
# lse does not depend on it), its lse into this float32 workspace [batch * heads * seq_q] and its
# O into grad_q (an output the dQ kernel writes over and no other argument shares: plan.py's
# checks), then the backward takes that lse as given.
LSE_PASS = "lse_pass"


def append_defines(dtype) -> dict:
    return {"FERRO_APPEND_DTYPE": APPEND_DTYPE_DEFINE[np.dtype(dtype)]}


# Decode's per-(batch, KV head) counters: the last block of a pair to finish merges its splits.
# They must be zero before a launch, and each launch leaves them so.
TICKETS = "tickets"
TILE_COUNTER = "tile_counter"  # a persistent kernel's claim counter (the backend's, per stream)
MMA, WGMMA = "mma", "wgmma"
# The decode kernels' three designs: `tensor` (half precision on tensor cores, sm_80+: a KV
# group's rows are one mma.sync operand's 16 rows, each warp streams its own tiles; 16-byte rows;
# the half-precision choice), and on the CUDA cores (any GPU, every dtype) `streams` (each warp
# streams its own tiles, no block-wide barrier in the key loop; 16-byte rows, at most 8 rows a
# group; float32's choice) and `tiles` (the block shares each tile; any row width, up to
# DECODE_ROWS rows).
TENSOR, STREAMS, TILES = "tensor", "streams", "tiles"
DECODE_DESIGNS = (TENSOR, STREAMS, TILES)
SM90A = (WGMMA,)  # built for sm_90a alone
WGMMA_STAGES = 3  # K/V buffers of the wgmma forwards
WGMMA_Q_BUFFERS = 2  # Q buffers of the wgmma forward (the next tile's Q loads during this one)


def wgmma_q_buffers(head_dim: int) -> int:
    """The wgmma forward's Q buffers at a kernel width (flash_fwd_wgmma.cu's Q_BUFS): one above
    128, where two would pass the shared memory a block has."""
    return 1 if head_dim > 128 else WGMMA_Q_BUFFERS
# (source, kernel) per (op, is_half, isa)
_SOURCES = {
    (FORWARD, False, MMA): ("flash_fwd.cu", "flash_attn_v2"),
    (BACKWARD_DQ, False, MMA): ("flash_bwd_dq.cu", "flash_attn_v2_bw_dq"),
    (BACKWARD_DKDV, False, MMA): ("flash_bwd_dkdv.cu", "flash_attn_v2_bw_dkdv"),
    (FORWARD, True, MMA): ("flash_fwd.cu", "flash_fwd_half"),
    (BACKWARD_DQ, True, MMA): ("flash_bwd_dq.cu", "flash_bwd_dq_half"),
    (BACKWARD_DKDV, True, MMA): ("flash_bwd_dkdv.cu", "flash_bwd_dkdv_half"),
    (FORWARD, True, WGMMA): ("flash_fwd_wgmma.cu", "flash_fwd_wgmma"),
    (BACKWARD_DQ, True, WGMMA): ("flash_bwd_dq_wgmma.cu", "flash_bwd_dq_wgmma"),
    (BACKWARD_DKDV, True, WGMMA): ("flash_bwd_dkdv_wgmma.cu", "flash_bwd_dkdv_wgmma"),
    (DECODE, False, TILES): ("flash_decode.cu", "flash_decode"),
    (DECODE, True, TILES): ("flash_decode.cu", "flash_decode"),
    (DECODE, True, TENSOR): ("flash_decode_mma.cu", "flash_decode_mma"),
    (DECODE, False, STREAMS): ("flash_decode_streams.cu", "flash_decode_streams"),
    (DECODE, True, STREAMS): ("flash_decode_streams.cu", "flash_decode_streams"),
}


@dataclass(frozen=True)
class Variant:
    op: str
    dtype: np.dtype
    head_dim: int  # padded
    warps: int
    mt: int  # 16-row m-tiles per warp
    step: int  # BN (keys per step) or, for dK/dV, BQ (query rows per step)
    isa: str = MMA
    stages: int = 0  # K/V buffers, for the kernels that take it as a define (0: the kernel's own)
    rows: int = 0  # decode: the most query rows of a KV group the block takes
    lane_dims: int = 0  # streams decode: head dims per lane (0: 16 for rows <= 4, else 8)
    # mask, dropout, softcap, ALiBi and sinks compiled out: only for calls with none of them
    # (FERRO_PLAIN); for dQ, also only for calls that pass the forward's lse (the kernel has no
    # statistics pass)
    plain: bool = False
    # softcap, ALiBi and sinks compiled in (FERRO_MODS): the only variants that serve calls with
    # them. The mma.sync and decode kernels come twice, without (first: what other calls take,
    # their registers untouched) and with; the wgmma ones' general variant has them.
    mods: bool = False
    # dK/dV: column ranges of dK and dV, each a block of its own (FERRO_DKDV_PARTS): one range's
    # two accumulators, not all DP columns', live in a thread's registers
    parts: int = 1
    # packed sequences (varlen: FERRO_VARLEN) compiled in: the only builds that serve a varlen
    # call, and never taken by another. A per-block sequence length where the others read the
    # kernel parameter costs registers across the key loop (the mma.sync forward: 164 -> 189 at
    # bf16 d128, spills in others), so every table entry also comes as a varlen copy
    # (with_varlen), made by select, not listed in the table.
    varlen: bool = False
    # a paged KV cache (FERRO_PAGED: K/V rows through `block_table`, ferro_pages.cuh) compiled in:
    # the forward's builds that serve a paged prefill, never taken by another call (so the plain
    # builds' parameters, code and registers stay theirs). Like varlen, every forward entry
    # comes as a paged copy (with_paged), made by select, not listed in the table. The decode
    # kernels take a paged cache at run time.
    paged: bool = False
    # the additive mask and dropout compiled out of a `mods` build (FERRO_UNMASKED): the wgmma
    # kernels' variant for a call with softcap, ALiBi or sinks and neither of them. The general
    # build's mask and dropout code held registers across the key loop (ptxas, bf16 d128: the
    # forward spilled 12 bytes, dK/dV 96; unmasked, none).
    unmasked: bool = False

    @property
    def half(self) -> bool:
        return self.dtype != FLOAT32

    @property
    def source(self) -> str:
        return _SOURCES[(self.op, self.half, self.isa)][0]

    @property
    def kernel(self) -> str:
        return _SOURCES[(self.op, self.half, self.isa)][1]

    @property
    def arch(self) -> str | None:
        """The one architecture the variant is built for (None: CuPy's default, the device's)."""
        return "90a" if self.isa in SM90A else None

    @property
    def options(self) -> tuple:
        return (f"-arch=sm_{self.arch}",) if self.arch else ()

    def runs_on(self, capability: int, copy_bytes: int) -> bool:
        """Whether the variant can run on a GPU of compute `capability` (e.g. 90) with copies of
        `copy_bytes` per row chunk (the backend's `_copy_width` in bytes)."""
        if self.isa in SM90A:
            return capability == 90 and copy_bytes == 16
        if self.isa == TENSOR:
            return capability >= 80 and copy_bytes == 16
        if self.isa == STREAMS:
            return copy_bytes == 16
        return True

    @property
    def args(self) -> tuple:
        """Buffer names in the kernel's parameter order; then `vec`, `mask_kind`, the struct. A
        persistent kernel also takes `tile_counter` (a uint32 at 0 before the launch, which the
        launch leaves at 0: its blocks claim their query tiles from it). A paged build takes
        `block_table` after the forward's buffers."""
        return (ARGS[self.op] + (("block_table",) if self.paged else ())
                + ((TILE_COUNTER,) if self.persistent else ()))

    @property
    def threads(self) -> int:
        """`warps` compute; the warp-specialized wgmma kernel adds a loading warpgroup."""
        return 32 * self.warps + (128 if self.isa == WGMMA else 0)

    @property
    def split_columns(self) -> bool:
        """The wgmma dK/dV kernel at width 256: its two computing warpgroups share one 64-key tile
        and each hold half of dK's and dV's columns (flash_bwd_dkdv_wgmma.cu's SPLIT)."""
        return self.isa == WGMMA and self.per_kv_head and self.head_dim > MEASURED_HEAD_DIM

    @property
    def block_rows(self) -> int:
        """Query rows (keys for dK/dV) a block covers."""
        return 16 * self.mt * self.warps // (2 if self.split_columns else 1)

    @property
    def combine_kernel(self) -> str:
        """The decode variant's second kernel (same source and defines)."""
        return "flash_decode_combine"

    @property
    def key_lanes(self) -> int:
        """Streams decode: lanes per key, each holding `lane_dims` dims of every row (its O and Q
        in registers), rounded up to a power of two (a few lanes idle at head_dim 48, 80, 96,
        112)."""
        elem = self.dtype.itemsize
        chunks_per_lane = max(1, (self.lane_dims or (16 if self.rows <= 4 else 8)) * elem // 16)
        need = -(-(self.head_dim * elem // 16) // chunks_per_lane)
        return 1 << (need - 1).bit_length()

    @property
    def kv_swizzled(self) -> bool:
        """The tensor-core decode kernel's K/V tiles are swizzled (unpadded rows, ferro_mma_f16.cuh
        `swz_at`) where a row is whole 128-byte lines, and padded like Q otherwise."""
        return self.isa == TENSOR and self.head_dim % 64 == 0

    @property
    def per_kv_head(self) -> bool:
        """One block row per (batch, KV head) rather than per (batch, head)."""
        return self.op in (BACKWARD_DKDV, BACKWARD_FUSED)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block: row-major tiles with a padded pitch (4 floats or 8
        halves: conflict-free fragment loads), as each kernel lays them out."""
        elem = self.dtype.itemsize
        if self.isa == STREAMS:  # per warp, a ring of K and V tiles; reused to merge the warps
            return max(2 * self.stages * self.step * self.head_dim * elem,
                       4 * self.warps * self.rows * (self.head_dim + 2))
        if self.isa == TENSOR:  # Q (pitch + 8); per warp a ring of K and V tiles, reused to merge
            pitch = self.head_dim + 8
            kv_pitch = self.head_dim if self.kv_swizzled else pitch
            return (elem * DECODE_ROWS * pitch
                    + max(2 * self.stages * self.step * kv_pitch * elem,
                          4 * self.warps * DECODE_ROWS * (self.head_dim + 2)))
        if self.op == DECODE:  # K, V x stages (16-byte pad per row); Q, P and row state f32
            rows = DECODE_ROWS
            return (2 * self.stages * self.step * (self.head_dim + 16 // elem) * elem
                    + 4 * (rows * self.head_dim + rows * (self.step + 1) + 3 * rows))
        if self.isa in SM90A and self.op != FORWARD:
            # dQ: its Q and dO, stages x (K, V); dK/dV: its K and V, stages x (Q, dO, 8 B of
            # [Delta, LSE] a row); swizzled, unpadded; 1 KB to align the base
            stats = 8 * self.stages * self.step if self.per_kv_head else 0
            return (elem * (2 * self.block_rows + 2 * self.stages * self.step) * self.head_dim
                    + stats + 1024 + fused_ds_bytes(self))
        if self.isa in SM90A:  # Q buffers, the (K, V) ring, swizzled, unpadded; 1 KB to align
            return (elem * (wgmma_q_buffers(self.head_dim) * self.block_rows
                            + 2 * (self.stages or WGMMA_STAGES) * self.step)
                    * self.head_dim + 1024)
        pitch = self.head_dim + (4 if elem == 4 else 8)
        m, n = self.block_rows, self.step
        rows = {FORWARD: m + 2 * n, BACKWARD_DQ: 2 * m + 2 * n, BACKWARD_DKDV: 2 * m + 2 * n}
        extra = 8 * n if (self.op == BACKWARD_DKDV and self.half) else 0  # [BQ][Delta, LSE]
        return elem * rows[self.op] * pitch + extra

    @property
    def defines(self) -> dict:
        d = {"FERRO_HEAD_DIM": self.head_dim, "FERRO_WARPS": self.warps, "FERRO_MT": self.mt,
             "FERRO_BN": self.step, "FERRO_SMEM_BYTES": self.shared_bytes}
        if self.half:
            d["FERRO_BF16"] = int(self.dtype == BFLOAT16)
        if self.isa == WGMMA:
            d["FERRO_STAGES"] = self.stages or WGMMA_STAGES
        if self.op == DECODE:
            d["FERRO_ROWS"] = self.rows
            d["FERRO_STAGES"] = self.stages
            d["FERRO_COMBINE_THREADS"] = self.combine_threads
        if self.isa == STREAMS:
            d["FERRO_KEY_LANES"] = self.key_lanes
        if self.isa == TENSOR:
            d["FERRO_KV_SWIZZLE"] = int(self.kv_swizzled)
        if self.plain:
            d["FERRO_PLAIN"] = 1
        if self.mods:
            d["FERRO_MODS"] = 1
        if self.unmasked:
            d["FERRO_UNMASKED"] = 1
        if self.parts > 1:
            d["FERRO_DKDV_PARTS"] = self.parts
        if self.split_columns:
            d["FERRO_DKDV_SPLIT"] = 1
        if self.varlen:
            d["FERRO_VARLEN"] = 1
        if self.paged:
            d["FERRO_PAGED"] = 1
        return d

    @property
    def combine_threads(self) -> int:
        """The decode combine kernel's block: a thread per column of O."""
        return max(COMBINE_THREADS, self.head_dim)

    @property
    def persistent(self) -> bool:
        """The kernel loops over its tiles, one block per SM (the wgmma forward)."""
        return self.isa == WGMMA and self.op == FORWARD

    def tiles(self, params) -> int:
        """Work items: row tiles x (batch, head), or x (batch, KV head) x column parts for
        dK/dV."""
        rows = int(params["seq_k"] if self.per_kv_head else params["seq_q"])
        heads = int(params["kv_heads"] if self.per_kv_head else params["heads"])
        return -(-rows // self.block_rows) * int(params["batch"]) * heads * self.parts

    def blocks(self, params, sm_count: int) -> int:
        """The grid: a block per tile, or for a persistent kernel at most one per SM. Its blocks
        claim tiles from the tile counter, the heaviest causal tiles first: causal tiles differ
        in cost, and blocks taking them in a fixed turn would finish unevenly (measurements in
        lab/TUNING.md)."""
        tiles = self.tiles(params)
        return min(tiles, sm_count) if self.persistent else tiles

    def describe(self) -> str:
        return (f"{self.op}/{self.dtype}/d{self.head_dim} ({self.isa}): {self.warps} warps x "
                f"{16 * self.mt} rows, step {self.step}"
                + (f", {self.stages} buffers" if self.stages else "")
                + (f", {self.rows} query rows" if self.rows else "")
                + (", no mask, dropout or model options" if self.plain else "")
                + (", softcap, ALiBi and sinks" if self.mods else "")
                + (", no mask or dropout" if self.unmasked else "")
                + (f", dK/dV in {self.parts} column ranges" if self.parts > 1 else "")
                + (", dK/dV's columns split between the warpgroups" if self.split_columns
                   else "")
                + (", packed sequences (varlen)" if self.varlen else "")
                + (", paged KV cache" if self.paged else "")
                + f", {self.shared_bytes} B shared")


def _wgmma(op: str, dtype: np.dtype, dp: int) -> list[Variant]:
    """The sm_90a variants, tried first where they run, at every padded head_dim up to
    MEASURED_HEAD_DIM: the kernels are built at a width kd of 64 (padded head_dims 16-64) or 128
    (80-128), the columns past the call's head_dim zero-filled as they load (load_tile_sw128,
    whole 16-byte chunks: wgmma runs only with 16-byte rows) and never stored, so one build
    serves every head_dim up to its width. A narrower build (kd 96: wgmma's N may be any
    multiple of 8) would skip a quarter of the products at 96, but the 128-byte swizzle lays
    tiles out in 64-column blocks, and 96 columns would take a half-used block or a second
    layout; it waits for a measurement (lab/wgmma_dims_ab.py) that says the padding costs.

    Forward: three computing warpgroups (192 query rows), the fastest in lab/tile_sweep.py;
    d64 takes 128 keys a tile, d128 64 (three warpgroups at 128 keys do not fit in shared
    memory). Each comes twice: first `plain` (no additive mask, no dropout, no softcap, ALiBi or
    sinks: the call most make), then with all of them, because their code holds registers across
    the key loop even when unused (ptxas spills at head_dim 64 with it, none without).

    Backward: two computing warpgroups (their accumulators take 64 registers a thread per
    head_dim-128 output: dQ, or dK and dV), tiles of 64 keys (dQ, 3 buffers) or 64 query rows
    (dK/dV, 2 buffers), `plain` first, then with the mask, dropout and model options. dQ needs
    the forward's lse (it has no statistics pass): for a call without it the backend runs the
    forward first (LSE_PASS).

    Above MEASURED_HEAD_DIM (untimed, no GPU yet: FlashAttention-3's hdim-256 forward is two
    computing warpgroups, 128 rows): the forward and dQ at widths 192 (padded 144-192) and 256,
    64 keys a tile in 2 buffers; the forward with one Q buffer (wgmma_q_buffers), dQ at 256 with
    one computing warpgroup (two would need a single K/V buffer). Their O / dQ take 96 or 128
    registers a thread; ptxas spills none (the general forward at 256 12 bytes, dQ 112).
    dK/dV above 128 is built at width 256 only (padded 144-256; split_columns): a block of 64
    keys whose two computing warpgroups each hold 128 columns of dK and dV (a warpgroup's whole
    dK and dV would take 256 registers a thread) and both form S^T and dP^T (1.5x the minimal
    products, as the mma.sync kernel's two column ranges); 192 would need 96-column halves,
    which split a 64-column swizzle block."""
    if dtype == FLOAT32:
        return []
    # flash_*_wgmma.cu's static_asserts: DP is 64, 128, 192 or 256 (dK/dV: 64, 128 or 256)
    kd = next(w for w in (64, 128, 192, 256) if dp <= w)
    if op == BACKWARD_DKDV and kd > MEASURED_HEAD_DIM:
        kd = 256
    if op == FORWARD and kd > MEASURED_HEAD_DIM:
        geometry = dict(warps=8, mt=1, step=64, stages=2)
    elif op == FORWARD:
        geometry = dict(warps=12, mt=1, step=128 if kd == 64 else 64)
    elif op == BACKWARD_DQ:
        geometry = dict(warps=4 if kd == 256 else 8, mt=1, step=64,
                        stages=2 if kd > MEASURED_HEAD_DIM else 3)
    elif op == BACKWARD_DKDV:
        geometry = dict(warps=8, mt=1, step=64, stages=2)
    else:
        return []
    # plain; the model options without mask and dropout (unmasked); everything
    return [Variant(op, dtype, kd, isa=WGMMA, plain=plain, mods=not plain, unmasked=unmasked,
                    **geometry)
            for plain, unmasked in ((True, False), (False, True), (False, False))]


def _geometry(op: str, dtype: np.dtype, dp: int) -> list[tuple[int, int, int]]:
    """(warps, mt, step) candidates for one (op, dtype, padded head_dim), best first; later ones
    need less shared memory, for GPUs with a smaller per-block limit.

    The half-precision choices are lab/tile_sweep.py's fastest (sum of causal and non-causal
    TFLOP/s at S 4096), measured at head_dim 64 and 128 and used for the padded head_dims up to
    64 and above 64 respectively: 32 query rows a warp in the forward (each K/V fragment feeds
    two m-tiles), with 32 keys a step at d128 (64 spills). lab/TUNING.md has the numbers.
    """
    if op == DECODE:  # tiles: 4 warps, 32 keys a tile (a key per lane in the softmax); 3 or 2 buffers
        return [(4, 1, 32, TILES, 3, DECODE_ROWS), (4, 1, 32, TILES, 2, DECODE_ROWS)]
    if dp > MEASURED_HEAD_DIM:
        return _wide_geometry(op, dtype, dp)
    if dtype == FLOAT32:
        return [{FORWARD: (4, 1, 64), BACKWARD_DQ: (4, 1, 32), BACKWARD_DKDV: (4, 1, 32)}[op]]
    small = dp <= 64
    if op == FORWARD:  # 32 query rows per warp: each K/V fragment feeds two m-tiles
        return [(4, 2, 64), (4, 1, 64)] if small else [(4, 2, 32), (4, 1, 64)]
    if op == BACKWARD_DQ:
        return [(4, 1, 64), (4, 1, 32)] if small else [(4, 2, 32), (4, 1, 32)]
    return [(4, 2, 32), (4, 1, 32)] if small else [(8, 1, 64), (4, 1, 32), (4, 1, 16)]


def _wide_geometry(op: str, dtype: np.dtype, dp: int) -> list[tuple[int, int, int]]:
    """(warps, mt, step) candidates above MEASURED_HEAD_DIM, not timed yet (no GPU): ordered by
    FlashAttention-2's sm80 choices (but one that spilled, below), then smaller tiles for
    less shared memory (the last fits sm_86's 99 KB at head_dim 256 in half precision, sm_80's
    163 KB in float32). A warp's accumulators are 16 * mt rows x dp columns, dp / 2 registers a
    thread per m-tile, so these take one m-tile a warp; registers and spills of each are in
    lab/results/head-dim-256-resources.md. A GPU sweep (lab/tile_sweep.py) re-orders them.

    Forward: 8 warps x 128 rows, 64 keys a step (FA2's from head_dim 192 up; its 4-warp 128 x 32
    at head_dim 160 is two m-tiles a warp here, which spilled 104 bytes), then FA2's 64 x 64
    fallback. The backward (FA2: 64 keys x 64 query rows, one kernel) is two kernels here: dQ
    steps 64 keys, dK/dV 64 query rows (in two column ranges: `dkdv_parts`). float32 (3xTF32,
    no FA2 counterpart) keeps 4 warps with fewer keys or query rows a step: its tiles take twice
    the bytes."""
    if dtype == FLOAT32:
        return [{FORWARD: (4, 1, 32), BACKWARD_DQ: (4, 1, 16), BACKWARD_DKDV: (4, 1, 16)}[op]] \
            + ([(4, 1, 16)] if op == FORWARD else [])
    if op == FORWARD:
        return [(8, 1, 64), (4, 1, 64), (4, 1, 32)]
    if op == BACKWARD_DQ:
        return [(4, 1, 64), (4, 1, 32)]
    return [(4, 1, 64), (4, 1, 32), (4, 1, 16)]


def dkdv_parts(op: str, dp: int) -> int:
    """dK/dV's column ranges: two above MEASURED_HEAD_DIM, where all dp columns of dK and dV
    (dp registers a thread at one m-tile a warp) spilled 620-1780 bytes a thread at head_dim
    256, and two ranges 0-72 (lab/results/head-dim-256-resources.md); the two blocks of a key
    tile each compute S and dP (1.5x the products of one block)."""
    return 2 if op == BACKWARD_DKDV and dp > MEASURED_HEAD_DIM else 1


DECODE_STAGE_BYTES = 8192  # at most this much K + V in one warp tile of the streams decode kernel
DECODE_IN_FLIGHT = 16384  # bytes each warp of it keeps in flight: (stages - 1) tiles


def _decode_streams(dtype: np.dtype, dp: int) -> list[Variant]:
    """The streams decode kernels for rows <= 4 and <= 8: a warp tile (`step` / warps keys) is C
    keys per lane group (C x rows <= 16 scores live in registers beside Q and O), at most
    DECODE_STAGE_BYTES; enough buffers per warp (at most 8) for DECODE_IN_FLIGHT bytes of copies
    in flight. Half precision at rows <= 4 takes 8 warps first (4 as the fallback for GPUs with
    less shared memory), float32 4 warps: lab/decode_sweep.py's fastest. The grid is a block per
    (batch, KV head, split): a block's warps share one key range, so each stream reads
    contiguous memory, and independent blocks overlap one's start-up with another's streaming;
    a warp per split, bulk copies and evenly balanced grids were slower (lab/TUNING.md)."""
    out = []
    for rows in (4, 8):
        kw = 32 // Variant(DECODE, dtype, dp, 4, 1, 0, STREAMS, 0, rows).key_lanes
        key_bytes = 2 * dp * dtype.itemsize  # K and V
        c = max(1, min(4, 16 // rows, DECODE_STAGE_BYTES // (kw * key_bytes)))
        stages = min(8, 1 + DECODE_IN_FLIGHT // (kw * c * key_bytes))
        for warps in ((8, 4) if dtype != FLOAT32 and rows <= 4 else (4,)):
            out.append(Variant(DECODE, dtype, dp, warps, 1, warps * kw * c, STREAMS, stages, rows))
    return out


def _decode_tensor(dtype: np.dtype, dp: int) -> list[Variant]:
    """The tensor-core decode kernel (half precision, any group of up to 16 rows), first in the
    table: each warp streams tiles of 16 keys through buffers of its own; 8 warps where each
    block has an SM to itself, with 3 buffers (2 where shared memory is short: sm_80's 163 KB a
    block), 4 warps with 3 (two blocks an SM) beyond (`select`'s `many_blocks`): more copies in
    flight a warp, as far as shared memory allows. Above MEASURED_HEAD_DIM also 4 warps with 2
    (sm_80 at head_dim 256); the table leaves out those past MAX_SHARED_BYTES.

    Why first, ahead of the streams kernel even at groups of up to 8 rows: decode is bound by
    copies, and the math must hide behind them. On the CUDA cores (the streams kernel) the math
    alone takes over half as long as the copies and overlaps them imperfectly; on tensor cores it
    takes a sixth. The K/V tiles are swizzled (ferro_mma_f16.cuh `swz_at`) rather than padded:
    padded rows keep ldmatrix conflict-free too but slow the copies. lab/TUNING.md has the
    measurements."""
    if dtype == FLOAT32:
        return []
    shapes = [(8, 3), (8, 2), (4, 3)] + ([(4, 2)] if dp > MEASURED_HEAD_DIM else [])
    return [Variant(DECODE, dtype, dp, warps, 1, warps * 16, TENSOR, stages, DECODE_ROWS)
            for warps, stages in shapes]


def _table() -> dict:
    """Per (op, dtype, padded head_dim): the wgmma variants, then the others (decode's designs,
    or mma.sync's geometries) as they are, then again built with softcap, ALiBi and sinks."""
    table = {}
    for op in (FORWARD, BACKWARD_DQ, BACKWARD_DKDV, DECODE):
        for dtype in (FLOAT32, FLOAT16, BFLOAT16):
            for dp in HEAD_DIMS:
                others = ((_decode_tensor(dtype, dp) + _decode_streams(dtype, dp)
                           if op == DECODE else [])
                          + [Variant(op, dtype, dp, *g[:3], *(g[3:] or (MMA,)),
                                     parts=dkdv_parts(op, dp))
                             for g in _geometry(op, dtype, dp)])
                others = [v for v in others if v.shared_bytes <= MAX_SHARED_BYTES]
                table[(op, dtype, dp)] = tuple(
                    _wgmma(op, dtype, dp) + others
                    + [dataclasses.replace(v, mods=True) for v in others])
    return table


# ---- the fused backward (flash_bwd_fused_wgmma.cu): beside the two-kernel one, taken wherever it
# serves the call when FUSED_BACKWARD is on. It measured faster at every shape of the bf16 grid
# (H100, 2026-12-08, lab/TUNING.md); FUSED_BACKWARD_DEFAULT turns it on once the GPU suite has
# run with it. FUSED_BACKWARD: the environment variable FUSED_BACKWARD_ENV ("1" on, "0" off), or
# a backend's `fused_backward` at run time (plans made before a change keep their kernels: the
# setter renews them). The dK/dV kernel's geometry, each computing warpgroup adding its
# dQ_part = dS K into a float32 dQ in a fixed order; a pre-kernel (Delta, LSE, zeroed workspace)
# and a post-kernel (grad_q) of FUSED_THREADS per (batch, head, query tile). Workspace beside the
# stats: dq_accum, float32 [batch * heads * q_tiles * step, head_dim] (each tile of step rows in
# the kernel's fragment order: ferro_dq_order.cuh); dq_semaphores, a uint32 per (batch, head,
# query tile) (float32-sized words).
BACKWARD_FUSED = "backward_fused"
FUSED_SOURCE = "flash_bwd_fused_wgmma.cu"
FUSED_PRE_KERNEL, FUSED_POST_KERNEL, FUSED_THREADS = "flash_bwd_fused_pre", "flash_bwd_fused_post", 128
FUSED_BACKWARD_ENV = "FERROCUPY_FUSED_BACKWARD"
FUSED_BACKWARD_DEFAULT = False  # the switch unset or "" (on once the GPU suite has run with it)


def fused_backward_wanted(environ=os.environ) -> bool:
    """The environment's switch: FUSED_BACKWARD_ENV "0" off, any other word on; unset or "":
    FUSED_BACKWARD_DEFAULT."""
    word = environ.get(FUSED_BACKWARD_ENV, "")
    return FUSED_BACKWARD_DEFAULT if word == "" else word != "0"


FUSED_BACKWARD = fused_backward_wanted()
ARGS[BACKWARD_FUSED] = ARGS[BACKWARD_DKDV] + ("dq_accum", "dq_semaphores")
_SOURCES[(BACKWARD_FUSED, True, WGMMA)] = (FUSED_SOURCE, "flash_bwd_fused_wgmma")
FUSED_PRE_ARGS = ("out", "grad_out", "lse", "stats", "dq_accum", "dq_semaphores", "cu_seqlens_q",
                  "cu_seqlens_k")
FUSED_POST_ARGS = ("dq_accum", "grad_q", "cu_seqlens_q", "cu_seqlens_k")


def fused_ds_bytes(v: Variant) -> int:
    """Shared memory the fused kernel adds to the dK/dV kernel's: two buffers of a step's dS
    (step query rows x the block's keys) and, per computing warpgroup, a staged float32 dQ
    partial (step query rows x head_dim) that the writer warp adds into dq_accum."""
    if v.op != BACKWARD_FUSED:
        return 0
    return v.dtype.itemsize * 2 * v.block_rows * v.step + 4 * (v.warps // 4) * v.step * v.head_dim


def fused_workspace(params, v: Variant) -> dict:
    """The fused backward's workspace beyond the stats: name -> float32 shape."""
    bh = int(params["batch"]) * int(params["heads"])
    q_tiles = -(-int(params["seq_q"]) // v.step)
    return {"dq_accum": (bh * q_tiles * v.step, v.head_dim), "dq_semaphores": (bh * q_tiles,)}


def fused_tiles(params, v: Variant) -> int:
    """Blocks of the pre- and post-kernels: one per (batch, head, query tile)."""
    return int(params["batch"]) * int(params["heads"]) * -(-int(params["seq_q"]) // v.step)


def select_fused(dtype, head_dim: int, smem_limit: int, table: dict | None = None,
                 capability: int = 0, copy_bytes: int = 0, plain: bool = False,
                 mods: bool = False, lse_given: bool = True,
                 varlen: bool = False, unmasked: bool = False) -> Variant | None:
    """The fused backward's variant for the call, or None where none serves it (float32, a
    head_dim without a wgmma variant, not sm_90a, rows narrower than 16 bytes, no forward lse:
    the two-kernel backward then runs). The backend asks only where its switch is on."""
    if not lse_given:
        return None
    key = (BACKWARD_FUSED, np.dtype(dtype), padded_head_dim(head_dim))
    for v in (TABLE if table is None else table).get(key, ()):
        if (v.plain and not plain) or (mods and not v.mods) or (v.unmasked and not unmasked):
            continue
        if v.shared_bytes <= smem_limit and v.runs_on(capability, copy_bytes):
            return with_varlen(v, varlen)
    return None


FUSED_HEAD_DIMS = (64, 128)  # the kernel's head_dims (flash_bwd_dkdv_wgmma.cu's static_assert)


def _fused_table() -> dict:
    """The dK/dV kernel's wgmma variants at FUSED_HEAD_DIMS, as the fused backward's."""
    return {(BACKWARD_FUSED, dtype, dp): tuple(dataclasses.replace(v, op=BACKWARD_FUSED)
                                               for v in _wgmma(BACKWARD_DKDV, dtype, dp)
                                               if v.head_dim in FUSED_HEAD_DIMS)
            for dtype in (FLOAT16, BFLOAT16) for dp in HEAD_DIMS}


TABLE = {**_table(), **_fused_table()}


def padded_head_dim(d: int) -> int:
    """The variant's head_dim for head_dim d: the next multiple of 16."""
    return max(16, -(-d // 16) * 16)


def select(op: str, dtype, head_dim: int, smem_limit: int, table: dict | None = None,
           capability: int = 0, copy_bytes: int = 0, rows: int = 0,
           many_blocks: bool = False, plain: bool = False, lse_given: bool = True,
           mods: bool = False, varlen: bool = False, paged: bool = False,
           unmasked: bool = False) -> Variant:
    """The first candidate for (op, dtype, head_dim) that fits `smem_limit` bytes per block, runs
    on a GPU of compute `capability` with `copy_bytes`-wide row copies and (decode) takes `rows`
    query rows per KV group. `many_blocks` (decode: more (batch, KV head) pairs than SMs) passes
    over the 8-warp streams and tensor kernels: two 4-warp blocks per SM overlap one's start-up and merge
    with the other's stream (faster there in lab/decode_sweep.py), while 8 warps win when each
    block has an SM to itself. `plain` (the call has no mask, dropout, softcap, ALiBi or sinks)
    admits the variants built without them; `lse_given` (the backward has the forward's lse)
    admits the wgmma dQ kernel, which has no statistics pass; `mods` (the kernel computes
    softcap, ALiBi or sinks for the call) admits only the variants built with them; `unmasked`
    (the call has no mask and no dropout) admits the variants built without them; `varlen`
    (packed sequences) gives the chosen one's varlen copy, `paged` (the forward over a paged KV
    cache) its paged copy."""
    dtype = np.dtype(dtype)
    candidates = (TABLE if table is None else table)[(op, dtype, padded_head_dim(head_dim))]
    need = []  # shared bytes of the candidates that fail only for it
    for v in candidates:
        if (many_blocks and v.isa in (STREAMS, TENSOR) and v.warps > 4) or (v.plain and not plain):
            continue
        if (mods and not v.mods) or (v.unmasked and not unmasked):
            continue
        if v.isa == WGMMA and v.op == BACKWARD_DQ and not lse_given:
            continue
        if v.runs_on(capability, copy_bytes) and v.rows >= rows:
            if v.shared_bytes <= smem_limit:
                return with_paged(with_varlen(v, varlen), paged)
            need.append(v.shared_bytes)
    rows_said = f" with {rows} query rows a KV group" if rows else ""
    raise ValueError(f"{op} in {dtype} at head_dim {head_dim}{rows_said} needs at least "
                     f"{min(need, default=0)} bytes of shared memory per block; this GPU allows "
                     f"{smem_limit}")


def key_reach(params, extras) -> int:
    """Keys [reach, seq_k) no row of the call can see (causal, the window's right side in
    `extras`, a negative offset; not kv_lens, whose values live on the device): the kernels'
    `key_reach` without a batch's own length."""
    a_last = int(params["seq_q"]) - 1 + int(params["causal_offset"])
    right = 0 if int(params["causal"]) else int(extras["window_right"])
    reach = int(params["seq_k"])
    if right >= 0:
        reach = min(reach, a_last + right + 1)
    return max(reach, 0)


def decode_wanted(params) -> bool:
    """The decode kernels take a call whose KV groups have few query rows."""
    group_rows = int(params["heads"]) // int(params["kv_heads"]) * int(params["seq_q"])
    return group_rows <= DECODE_ROWS and int(params["seq_k"]) > 0


@functools.lru_cache(maxsize=1024)  # on every decode call's path: a loop worth remembering
def decode_splits(pairs: int, reach: int, step: int, slots: int,
                  max_splits: int = DECODE_MAX_SPLITS) -> tuple[int, int]:
    """(splits, keys per split) for `pairs` (batch, KV head) pairs over `reach` keys on a GPU
    that holds `slots` decode blocks at once: the count whose blocks finish soonest, taking time
    as waves of blocks times (tiles per block + 1, a block's start-up), with at least 4 tiles a
    split (fewer splits on a tie: less to combine)."""
    tiles = max(1, -(-reach // step))
    best = None
    for n in range(1, min(max_splits, max(1, tiles // 4)) + 1):
        per = -(-tiles // n)
        n_used = -(-tiles // per)
        cost = -(-(pairs * n_used) // slots) * (per + 1)
        if best is None or cost < best[0]:
            best = (cost, n_used, per)
    return best[1], best[2] * step


def only(*isas: str, table: dict | None = None) -> dict:
    """The table restricted to some designs' variants (to test or time those), in its own order:
    instruction sets (MMA, WGMMA) for the forward and backward, decode designs (DECODE_DESIGNS)
    for decode; the other operation's variants stay as they are."""
    decode = any(isa in DECODE_DESIGNS for isa in isas)
    return {key: tuple(v for v in vs if v.isa in isas or ((v.isa in DECODE_DESIGNS) != decode))
            for key, vs in (TABLE if table is None else table).items()}


def with_varlen(v: Variant, varlen: bool) -> Variant:
    """`v`, or (varlen) its copy built with packed sequences."""
    return dataclasses.replace(v, varlen=True) if varlen else v


def with_paged(v: Variant, paged: bool) -> Variant:
    """`v`, or (paged) its copy built to read a paged KV cache: the forward's alone, and never
    a varlen one (a varlen call takes no block table)."""
    if not paged:
        return v
    if v.op != FORWARD or v.varlen:
        raise ValueError(f"a paged KV cache is read by the forward's dense builds alone, not by "
                         f"{v.describe()}")
    return dataclasses.replace(v, paged=True)


def all_variants() -> list[Variant]:
    """Every variant `select` can return (what the compile tests build): the table's, each
    one's varlen copy, and each forward's paged copy."""
    table = [v for vs in TABLE.values() for v in vs]
    return (table + [with_varlen(v, True) for v in table]
            + [with_paged(v, True) for v in table if v.op == FORWARD])


# RoPE: one thread per (token, group of heads, VEC frequencies or VEC passed-through features),
# every head of its group in a loop; VEC elements per access, one variant per (dtype, VEC).
ROPE_SOURCE, ROPE_KERNEL, ROPE_THREADS = "rope.cu", "rope", 256
ROPE_DTYPE_DEFINE = {FLOAT32: 0, FLOAT16: 1, BFLOAT16: 2}
ROPE_ACCESS_BYTES = (16, 4)  # then one element: the widths tried, widest first
ROPE_RESIDENT_THREADS = 2048  # per SM (sm_80 and sm_90): enough work items to fill them


def rope_vectors(dtype) -> tuple:
    """Every elements-per-access a RoPE variant of `dtype` is built for, widest first."""
    size = np.dtype(dtype).itemsize
    return tuple(dict.fromkeys([b // size for b in ROPE_ACCESS_BYTES if b >= size] + [1]))


def rope_vector(dtype, head_dim: int, rotary_dim: int, strides, addresses) -> int:
    """The widest elements-per-access every access of the call allows: rotary_dim/2 and the
    passed-through width a multiple of it, every (batch, seq, head) element stride a multiple
    of it, every address aligned to it."""
    size = np.dtype(dtype).itemsize
    for vec in rope_vectors(dtype):
        if ((rotary_dim // 2) % vec == 0 and (head_dim - rotary_dim) % vec == 0
                and all(int(st) % vec == 0 for st in strides)
                and all(a % (vec * size) == 0 for a in addresses)):
            return vec
    return 1


def rope_head_groups(tokens: int, lanes: int, heads: int, sm_count: int) -> int:
    """Groups the heads of a token are split into, so that (token, group, lane) items fill every
    SM's resident threads; one where the tokens alone do (each thread then reuses its angles
    over all the heads)."""
    want = sm_count * ROPE_RESIDENT_THREADS
    rows = max(1, tokens * lanes)
    if rows >= want or heads <= 1:
        return 1
    per = -(-heads // min(heads, -(-want // rows)))
    return -(-heads // per)


def rope_defines(dtype, vec: int | None = None) -> dict:
    """The defines of the RoPE variant of `dtype` with `vec` elements per access (default the
    widest, 16 bytes)."""
    return {"FERRO_ROPE_DTYPE": ROPE_DTYPE_DEFINE[np.dtype(dtype)],
            "FERRO_ROPE_VEC": rope_vectors(dtype)[0] if vec is None else int(vec)}


def rope_variants() -> list[dict]:
    """The defines of every RoPE variant the backend can launch (what the compile tests build)."""
    return [rope_defines(d, v) for d in ROPE_DTYPE_DEFINE for v in rope_vectors(d)]
