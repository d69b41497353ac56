"""Context parallelism: one attention over a sequence sharded across the ranks of a
`torch.distributed` group (ring attention), forward and backward.

Each rank holds a shard of one sequence: `q` `[B, Sq_local, H, D]`, `k`, `v`
`[B, Sk_local, Hkv, D]`, cut the same way on every rank (`layout`, below). The ranks form a ring;
at step `t` rank `r` holds the K/V shard of rank `(r - t) mod world` and attends its queries to
it with `ferrocupy.torch.attention(..., return_lse=True)`, while the shard for step `t + 1`
travels (one batched `isend`/`irecv` of K and V stacked; with NCCL the transfer runs on NCCL's
own stream, beside the attention on torch's current stream). The partial outputs merge through
their log-sum-exps in float32, so K/V are read once. The backward runs the ring again: each step
is the engine's backward of one block given the merged output and the final lse (the softmax
over every block, which is exactly the block's share of the unsharded gradient); dQ stays, and
dK/dV (float32) travel the ring with one step's lag until they reach their owners.

Layouts (`world` ranks, a sequence of `S = S_local * world` tokens):
- `"contiguous"`: rank r holds tokens `[r * S_local, (r + 1) * S_local)`.
- `"zigzag"`: the sequence is cut into `2 * world` chunks of `S_local / 2`; rank r holds chunks
  r and `2 * world - 1 - r`, in that order (under causal every rank gets the same work).

The visibility rule is the unsharded call's, in global positions: query `i` of the whole
sequence sits at `a = i + causal_offset` and sees key `j` iff (`not causal` or `j <= a`) and
(`window == 0` or `|a - j| < window`). It depends only on `d = a - j`, so every (query chunk,
key chunk) pair is one band `lo <= d <= hi`: the pair is skipped when no query sees a key of it,
trimmed to the rows and keys that take part, and run as one call with the band moved into the
call's own coordinates (`causal` with a non-negative `causal_offset`, and a symmetric `window`
where the band is bounded on both sides); a pair every query sees whole runs with no mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "context_parallel_attention", "shard_sequence", "unshard_sequence"]

LAYOUTS = ("zigzag", "contiguous")


# --- where each rank's tokens sit -----------------------------------------------------------
def _chunks(rank: int, world: int, s_local: int, layout: str) -> tuple:
    """(local start, global start, length) of each contiguous run of rank `rank`'s shard."""
    if layout == "contiguous":
        return ((0, rank * s_local, s_local),)
    half = s_local // 2
    return ((0, rank * half, half), (half, (2 * world - 1 - rank) * half, half))


def shard_sequence(x: Tensor, rank: int, world: int, layout: str = "zigzag",
                   dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of the whole sequence `x` (sequence along `dim`), as
    `context_parallel_attention` takes it: a new contiguous tensor."""
    _check_layout(layout)
    length = x.shape[dim]
    parts = 1 if layout == "contiguous" else 2
    if length % (world * parts):
        raise ValueError(f"layout={layout!r} over {world} ranks needs a sequence length "
                         f"divisible by {world * parts}, got {length} (x of shape "
                         f"{tuple(x.shape)}, dim={dim})")
    pieces = [x.narrow(dim, start, n)
              for _, start, n in _chunks(rank, world, length // world, layout)]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard_sequence(shards, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard (`shards[r]` is rank r's, e.g. from
    `torch.distributed.all_gather`): the inverse of `shard_sequence`."""
    _check_layout(layout)
    world = len(shards)
    s_local = shards[0].shape[dim]
    placed = sorted((start, shard.narrow(dim, local, n))
                    for rank, shard in enumerate(shards)
                    for local, start, n in _chunks(rank, world, s_local, layout))
    return torch.cat([piece for _, piece in placed], dim=dim)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# --- which blocks run, and how ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Band:
    """The visible `d = a - j` of the unsharded call: `lo <= d <= hi` (None: unbounded)."""
    lo: Optional[int]
    hi: Optional[int]

    @staticmethod
    def of(causal: bool, window: int) -> "_Band":
        lo = 0 if causal else None
        if window:
            lo = -(window - 1) if lo is None else max(lo, -(window - 1))
        return _Band(lo, window - 1 if window else None)

    def shifted(self, s: int) -> "_Band":
        """The band of `d - s`."""
        return _Band(None if self.lo is None else self.lo - s,
                     None if self.hi is None else self.hi - s)

    def clip(self, x0: int, x1: int) -> Optional[tuple]:
        """`[x0, x1]` ∩ the band, or None when empty."""
        lo = x0 if self.lo is None else max(x0, self.lo)
        hi = x1 if self.hi is None else min(x1, self.hi)
        return (lo, hi) if lo <= hi else None

    def options(self) -> Optional[dict]:
        """The keywords of `attention` that make this band (on the call's `i - j`), or None
        where none can. A bounded band `[lo, hi]` with `lo <= 0` is `causal` with
        `causal_offset = -lo` (cuts below `lo`) and a symmetric window of `hi - lo + 1` about
        that offset (cuts above `hi`): one form for every band, with an offset that is never
        negative (the GPU kernels' rule) and no asymmetric window (which they lack)."""
        lo, hi = self.lo, self.hi
        if lo is None and hi is None:
            return {}
        if lo is None or lo > 0 or (hi is not None and hi < lo):
            return None
        if hi is None:
            return {"causal": True, "causal_offset": -lo}
        return {"causal": True, "causal_offset": -lo, "window": hi - lo + 1}


@dataclasses.dataclass(frozen=True)
class _Block:
    """One attention call of a step: local query rows against local keys of the visiting
    shard, with the band in the call's own coordinates (`i - j`)."""
    rows: slice
    keys: slice
    band: _Band

    def options(self) -> dict:
        return self.band.options()


def _pair_block(band: _Band, q_chunk: tuple, k_chunk: tuple,
                causal_offset: int) -> Optional[_Block]:
    """The trimmed block of one (query chunk, key chunk) pair, or None when no query sees a
    key of it."""
    q_local, q_global, n = q_chunk
    k_local, k_global, m = k_chunk
    a0 = q_global + causal_offset  # first row's position
    # rows that see some key in [k_global, k_global + m - 1]
    rows = _Band(None if band.lo is None else k_global + band.lo,
                 None if band.hi is None else k_global + m - 1 + band.hi).clip(a0, a0 + n - 1)
    if rows is None:
        return None
    # keys that some of those rows see
    keys = _Band(None if band.hi is None else rows[0] - band.hi,
                 None if band.lo is None else rows[1] - band.lo).clip(k_global,
                                                                      k_global + m - 1)
    if keys is None:
        return None
    local = band.shifted(rows[0] - keys[0])  # d = (i - j) + (first row - first key)
    n_rows, n_keys = rows[1] - rows[0] + 1, keys[1] - keys[0] + 1
    if local.clip(-(n_keys - 1), n_rows - 1) == (-(n_keys - 1), n_rows - 1):
        local = _Band(None, None)  # every row sees every key: no mask
    r0, k0 = q_local + rows[0] - a0, k_local + keys[0] - k_global
    return _Block(slice(r0, r0 + n_rows), slice(k0, k0 + n_keys), local)


def _merge_full(blocks: list) -> list:
    """Unmasked blocks that share rows (keys) and meet in the keys (rows) as one call."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for x in blocks:
            for y in blocks:
                if x is y or x.band.options() != {} or y.band.options() != {}:
                    continue
                if x.rows == y.rows and x.keys.stop == y.keys.start:
                    z = _Block(x.rows, slice(x.keys.start, y.keys.stop), x.band)
                elif x.keys == y.keys and x.rows.stop == y.rows.start:
                    z = _Block(slice(x.rows.start, y.rows.stop), x.keys, x.band)
                else:
                    continue
                blocks = [b for b in blocks if b is not x and b is not y] + [z]
                merged = True
                break
            if merged:
                break
    return blocks


def _whole_block(band: _Band, q_chunks: tuple, k_chunks: tuple, causal_offset: int,
                 sq: int, sk: int) -> Optional[_Block]:
    """One call over the whole shard pair that sees exactly what the pairs see (zigzag's
    diagonal step under causal), or None."""
    shifts = [(qc, kc, qc[1] - qc[0] + causal_offset - kc[1] + kc[0])
              for qc in q_chunks for kc in k_chunks]
    for _, _, g in shifts:
        candidate = band.shifted(g)
        if candidate.options() is None:
            continue
        if all(candidate.clip(*_diffs(qc, kc)) == band.shifted(s).clip(*_diffs(qc, kc))
               for qc, kc, s in shifts):
            return _Block(slice(0, sq), slice(0, sk), candidate)
    return None


def _diffs(q_chunk: tuple, k_chunk: tuple) -> tuple:
    """The range of the whole-shard `i - j` over one chunk pair."""
    return (q_chunk[0] - (k_chunk[0] + k_chunk[2] - 1), q_chunk[0] + q_chunk[2] - 1 - k_chunk[0])


@functools.lru_cache(maxsize=1024)  # the same few (geometry, rank, source) every call
def _step_blocks(geometry: "_Geometry", rank: int, source: int) -> tuple:
    """The calls of the step where `rank`'s queries meet `source`'s keys."""
    g = geometry
    q_chunks = _chunks(rank, g.world, g.sq, g.layout)
    k_chunks = _chunks(source, g.world, g.sk, g.layout)
    blocks = [b for qc in q_chunks for kc in k_chunks
              if (b := _pair_block(g.band, qc, kc, g.causal_offset)) is not None]
    blocks = _merge_full(blocks)
    if len(blocks) > 1:
        whole = _whole_block(g.band, q_chunks, k_chunks, g.causal_offset, g.sq, g.sk)
        if whole is not None:
            return (whole,)
    return tuple(blocks)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    world: int
    sq: int  # query rows per rank
    sk: int  # keys per rank
    layout: str
    band: _Band
    causal_offset: int


# --- the ring ---------------------------------------------------------------------------------
class _Ring:
    """This rank's place in the group's ring: sends go to the next rank, receives come from
    the previous one."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) \
            if group is not None else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) \
            if group is not None else (self.rank - 1) % self.world

    def pass_on(self, send: Tensor) -> tuple:
        """Start sending `send` to the next rank and receiving a tensor like it from the
        previous one: (the receive buffer, the requests to wait on)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (out, lse) into the running float32 (out, lse) of the same rows, in
    place: the softmax over the union of their keys. The weights are computed on the small
    lse tensors; `out` is read and written twice (a scale, then a fused multiply-add). Rows
    that neither saw stay out 0, lse -inf."""
    new_lse = torch.logaddexp(lse, block_lse)  # -inf where both are
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)  # [B, rows, H, 1]
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(block_out, w_new)
    lse.copy_(new_lse)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring, geometry: _Geometry,
                  scale: Optional[float]) -> tuple:
    """(out in q's dtype, lse float32 [B, H, Sq_local]) of this rank's queries over the whole
    sequence."""
    from .torch import attention  # here: ferrocupy.torch imports this module at its end

    B, sq, H, D = q.shape
    out = torch.zeros((B, sq, H, D), dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, sq), -torch.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # one message a step
    for step in range(ring.world):
        last = step == ring.world - 1
        if not last:
            kv_next, requests = ring.pass_on(kv)
        for block in _step_blocks(geometry, ring.rank, (ring.rank - step) % ring.world):
            r = block.rows
            block_out, block_lse = attention(q[:, r], kv[0][:, block.keys], kv[1][:, block.keys],
                                             scale=scale, return_lse=True, **block.options())
            _merge(out[:, r], lse[:, :, r], block_out, block_lse)
        if not last:
            _wait(requests)
            kv = kv_next
    return out.to(q.dtype), lse


_NO_SEED = torch.zeros((), dtype=torch.int64)


def _block_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, scale: Optional[float], options: dict) -> tuple:
    """The engine's backward of one block given the merged out and the final lse: this block's
    share of dQ, and its dK, dV (the op `ferrocupy::attention_bwd`, which ferrocupy.torch
    registers; the forward imported it)."""
    options = {"causal": False, "causal_offset": 0, "window": 0, **options}
    grad_q, grad_k, grad_v, _ = torch.ops.ferrocupy.attention_bwd(
        grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse, attn_mask=None, dropout_p=0.0,
        seed=_NO_SEED, scale=scale, **options)
    return grad_q, grad_k, grad_v


def _ring_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   ring: _Ring, geometry: _Geometry, scale: Optional[float]) -> tuple:
    """(dq, dk, dv) of this rank's shards. dK/dV of the visiting shard are summed as they go
    round: at step t the sum for shard (r - t) arrives from the previous rank (which added its
    share at step t - 1), gets this rank's share and moves on; after the last step each sum
    has every rank's share and has arrived at its owner."""
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    grad_kv, grad_requests = None, None
    for step in range(ring.world):
        last = step == ring.world - 1
        if not last:
            kv_next, kv_requests = ring.pass_on(kv)
        shares = []
        for block in _step_blocks(geometry, ring.rank, (ring.rank - step) % ring.world):
            r, j = block.rows, block.keys
            gq, gk, gv = _block_backward(grad_out[:, r], q[:, r], kv[0][:, j], kv[1][:, j],
                                         out[:, r], lse[:, :, r], scale, block.options())
            grad_q[:, r] += gq
            shares.append((j, gk, gv))
        if grad_requests is None:
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        else:
            _wait(grad_requests)
        for j, gk, gv in shares:
            grad_kv[0][:, j] += gk
            grad_kv[1][:, j] += gv
        if ring.world > 1:
            grad_kv, grad_requests = ring.pass_on(grad_kv)
        if not last:
            _wait(kv_requests)
            kv = kv_next
    if grad_requests is not None:
        _wait(grad_requests)
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, geometry, scale):
        out, lse = _ring_forward(q, k, v, ring, geometry, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.geometry, ctx.scale = ring, geometry, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(grad_out, q, k, v, out, lse, ctx.ring, ctx.geometry, ctx.scale)
        return (*grads, None, None, None)


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None,
                               causal: bool = False, causal_offset: int = 0, window: int = 0,
                               scale: Optional[float] = None, layout: str = "zigzag",
                               dropout_p: float = 0.0, seed: Optional[int] = None) -> Tensor:
    """Attention over one sequence sharded across the ranks of `group` (ring attention);
    returns this rank's shard of the output, `[B, Sq_local, H, D]` in q's dtype, with autograd
    (each rank gets its shards' gradients).

    - `q`: `[B, Sq_local, H, D]`; `k`, `v`: `[B, Sk_local, Hkv, D]` (`H % Hkv == 0`): this
      rank's shard, cut by `layout` (`"zigzag"` or `"contiguous"`; `shard_sequence` cuts a whole
      tensor). Every rank passes the same shapes, dtype and options.
    - `group`: a `torch.distributed` process group (None: the default one); NCCL for CUDA
      tensors, gloo for CPU tensors (the reference backend).
    - `causal`, `causal_offset`, `window`, `scale`: as `ferrocupy.torch.attention`'s, over the
      whole sequence (query i of the sequence sits at `i + causal_offset`).
    - `dropout_p > 0` is refused (NotImplementedError): the keep mask of the unsharded call
      needs each block's global row and key indices in dropout's Philox counter, which the
      engine cannot offset yet.
    """
    _check(q, k, v, causal_offset, window, layout, dropout_p)
    if group is None and not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group first, or pass group=")
    ring = _Ring(group)
    geometry = _Geometry(ring.world, q.shape[1], k.shape[1], layout,
                         _Band.of(bool(causal), int(window)), int(causal_offset))
    return _RingAttention.apply(q, k, v, ring, geometry,
                                None if scale is None else float(scale))


def _check(q: Tensor, k: Tensor, v: Tensor, causal_offset: int, window: int, layout: str,
           dropout_p: float) -> None:
    """The checks that need no other rank (the block calls check the rest, by name)."""
    _check_layout(layout)
    if dropout_p:
        raise NotImplementedError(
            f"context_parallel_attention: dropout_p={dropout_p} is not supported: the unsharded "
            f"call's keep mask needs each block's global row and key indices in the Philox "
            f"counter, and the engine has no dropout index offset")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S_local, heads, D] shards, got {shapes}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must have one shape, with q's batch and head_dim: {shapes}")
    if layout == "zigzag" and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError(f"layout='zigzag' needs an even shard length (two chunks a rank), "
                         f"got {shapes}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if not isinstance(causal_offset, int) or isinstance(causal_offset, bool):
        raise TypeError(f"causal_offset must be an int, got {causal_offset!r}")
