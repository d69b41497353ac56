"""ComputeEngine: the seed's eight methods. Validates and packs in one place, then hands each
operation (rope, forward, backward: named buffers and the packed params) to a backend, CUDA or the
NumPy reference, which picks, orders and launches its own kernels."""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import numpy as np

from . import dtypes as _dt
from . import rope_args
from .params import LAYOUT_TENSORS, AttentionDims, layout_params
from .tensor import UnifiedTensor, cuda_available


@dataclass(frozen=True)
class AttentionOptions:
    """Options of `flash_attention_v2_with` and its backward (the seed's five fields, and
    `scale`).

    Query `i` sits at absolute position `i + causal_offset`; key `j` is visible when
    `j <= i + causal_offset` (if `causal`) and `|i + causal_offset - j| < window` (if `window > 0`).
    `scale` multiplies `q . k` before the softmax; None is `1/sqrt(head_dim)` (the seed's).
    """

    causal: bool = False
    causal_offset: int = 0
    window: int = 0
    dropout_prob: float = 0.0
    seed: int = 0
    scale: float | None = None

    def validate(self) -> None:
        if not isinstance(self.causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        for name in ("causal_offset", "window"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if not 0 <= value < 2**32:
                raise ValueError(f"{name} must be in [0, 2**32), got {value}")
        p = self.dropout_prob
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer,
                                                                 np.floating)):
            raise TypeError(f"dropout_prob must be a number, got {p!r}")
        if not 0.0 <= float(p) < 1.0 or not 0.0 <= float(np.float32(p)) < 1.0:
            raise ValueError(f"dropout_prob must lie in [0, 1), got {self.dropout_prob}")
        if (isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer))
                or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        sc = self.scale
        if sc is not None:
            if isinstance(sc, (bool, np.bool_)) or not isinstance(sc, (int, float, np.integer,
                                                                      np.floating)):
                raise TypeError(f"scale must be a number or None, got {sc!r}")
            try:
                sc64 = float(sc)
            except OverflowError:
                sc64 = float("inf")
            with np.errstate(over="ignore"):
                sc32 = np.float32(sc64)
            if not (np.isfinite(sc64) and np.isfinite(sc32) and sc32 > 0):
                raise ValueError(f"scale must be finite and > 0 (as float32, which the kernels "
                                 f"take: {sc32}), got {sc}")


def _make_backend(backend: str):
    if backend == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    if backend == "cuda":
        # No CuPy, no driver or no GPU: say which, and what to install, not CuPy's raw error.
        missing, cause = None, None
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() == 0:
                missing = "CuPy sees no CUDA GPU"
        except ImportError as e:
            missing, cause = f"CuPy is not installed ({type(e).__name__}: {e})", e
        except Exception as e:  # CUDARuntimeError: no NVIDIA driver, or one too old
            missing, cause = f"no usable NVIDIA driver or GPU ({type(e).__name__}: {e})", e
        if missing:
            raise RuntimeError(
                f"backend='cuda' needs CuPy, an NVIDIA driver and a CUDA GPU: {missing}. "
                f"Install CuPy with pip install 'ferrocupy[cuda13]' (for drivers that support "
                f"CUDA 13) or 'ferrocupy[cuda12]' (CUDA 12), on a machine with an NVIDIA GPU and "
                f"its driver; or use backend='reference' (NumPy, no GPU)") from cause
        from .cuda.backend import CudaBackend

        return CudaBackend()
    raise ValueError(f"backend must be 'cuda' or 'reference', got {backend!r}")


class ComputeEngine:
    """Owns the kernels and the device context; outputs are written into the tensors passed in."""

    def __init__(self, backend: str | None = None, *, quiet: bool = False):
        if backend is None:
            backend = "cuda" if cuda_available() else "reference"
            if not quiet:
                why = "a CUDA GPU is usable" if backend == "cuda" else "no CUDA GPU is usable"
                print(f"ferrocupy: using the {backend} backend ({why})", file=sys.stderr)
        self.backend = _make_backend(backend)
        self._validated: dict = {}  # _attention's checked-and-packed calls, by their shapes
        self._seen: dict = {}  # _remembered: calls on these very tensor objects

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def __repr__(self) -> str:
        return f"ComputeEngine(backend={self.backend.name!r}, device={self.backend.device!r})"

    # --- RoPE -----------------------------------------------------------------------------------
    def rope(self, tensor, head_dim: int, pos: int, *, positions=None, rotary_dim=None,
             interleaved: bool = False, inverse: bool = False, out=None) -> None:
        """Rotate-half RoPE (theta 10000) in place; token `s` gets position `pos + s`. The
        keywords are `rope_theta`'s."""
        self.rope_theta(tensor, head_dim, pos, 10000.0, positions=positions,
                        rotary_dim=rotary_dim, interleaved=interleaved, inverse=inverse, out=out)

    def rope_theta(self, tensor, head_dim: int, pos: int, theta: float, *, positions=None,
                   rotary_dim=None, interleaved: bool = False, inverse: bool = False,
                   out=None) -> None:
        """`rope` with base frequency `theta` (a Hugging Face config's `rope_theta`).

        `tensor` is read as `[batch, seq_len, heads, head_dim]`: `[batch, seq_len, ...]` from
        rank 3 on, `[seq_len, ...]` at rank 2, one token at rank 1. Any view whose head_dim
        elements are contiguous and whose heads are evenly spaced is read (and written) where it
        lies, through its strides. Keywords, each off by default:

        - `positions`: int32 or int64 `[seq_len]` or `[batch, seq_len]` on this engine's device,
          its last dimension contiguous (any batch stride: an expanded row too); token (b, s)
          sits at `positions[s]` or `positions[b, s]` instead of `pos + s` (pos must then be 0).
          Its values are not checked: every integer is a position.
        - `rotary_dim`: an even width in [2, head_dim]; only the first `rotary_dim` features of
          each head rotate (frequencies over `rotary_dim`), the rest pass through.
        - `interleaved`: rotate the pairs (x[2i], x[2i+1]) (GPT-J) instead of (x[i], x[i + r/2]).
        - `inverse`: rotate by the negative angle (RoPE's gradient).
        - `out`: write the result here (same shape and dtype, any such view) and leave `tensor`
          as it is; `out` may be `tensor` itself, but must not otherwise share its memory."""
        t = self._tensor("tensor", tensor, contiguous=False)
        o = None if out is None else self._tensor("out", out, contiguous=False)
        ps = None if positions is None else self._tensor("positions", positions, contiguous=False)
        self._check_dtype(("tensor", t), *(() if o is None else (("out", o),)))
        opts = rope_args.Options(head_dim, pos, theta, rotary_dim, interleaved, inverse)
        call = rope_args.checked_call(self.backend, t, o, ps, opts)
        in_place = rope_args.check_buffers(t, o, ps)
        if t.numel:
            self.backend.rope(t.buffer(), call.params, out=None if in_place else o.buffer(),
                              positions=None if ps is None else ps.buffer(), layout=call.layout)

    # --- forward --------------------------------------------------------------------------------
    def flash_attention(self, q, k, v, out, causal: bool = False) -> None:
        """Single-head attention on `[seq, head_dim]` tensors (the v2 kernel on 4-D views)."""
        q4, k4, v4, o4 = (_single_head_view(n, t, self) for n, t in
                          (("q", q), ("k", k), ("v", v), ("out", out)))
        self.flash_attention_v2(q4, k4, v4, o4, causal, 0.0, 0, None)

    def flash_attention_v2(self, q, k, v, out, causal: bool = False, dropout_prob: float = 0.0,
                           seed: int = 0, mask=None) -> None:
        """Fused attention with GQA, causal masking, an additive mask and dropout.

        `q`, `out`: `[batch, seq_q, heads, head_dim]`; `k`, `v`: `[batch, seq_k, kv_heads,
        head_dim]`; `mask`: additive, broadcastable to `[batch, heads, seq_q, seq_k]`.
        """
        opts = AttentionOptions(causal=causal, dropout_prob=dropout_prob, seed=seed)
        self.flash_attention_v2_with(q, k, v, out, opts, mask)

    def flash_attention_v2_with(self, q, k, v, out, opts: AttentionOptions = AttentionOptions(),
                                mask=None, *, lse=None, kv_lens=None) -> None:
        """`flash_attention_v2` with every option (KV-cache offset, sliding window, scale).

        `lse` (optional output, float32 `[batch, heads, seq_q]`): each row's log-sum-exp of its
        scaled, masked scores (natural log, before dropout; -inf for a row that sees no key).
        Give it to the backward to spare it recomputing it.

        `kv_lens` (optional input, int32 `[batch]`, on this engine's device): batch `b` has
        `kv_lens[b] <= seq_k` keys; the slots past them are never read (a preallocated KV cache
        may hold anything there), and its rows sit at `i + causal_offset + kv_lens[b] - seq_k`.
        Its values are read (one small copy to the host) and checked before any launch."""
        named = {"q": q, "k": k, "v": v, "out": out, "mask": mask, "lse": lse, "kv_lens": kv_lens}
        t, dims, params, layout = self._checked("forward", named, opts)
        if dims.batch * dims.heads * dims.seq_q == 0:
            return
        self.backend.forward(self._buffers(t, "q", "k", "v", "out", "mask", "lse", "kv_lens"),
                             params, layout)

    # --- backward -------------------------------------------------------------------------------
    def flash_attention_backward(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                 causal: bool = False) -> None:
        """Single-head backward for `[seq, head_dim]` tensors; writes the three gradients."""
        names = ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v")
        views = [_single_head_view(n, x, self) for n, x in
                 zip(names, (q, k, v, out, grad_out, grad_q, grad_k, grad_v))]
        self.flash_attention_v2_backward(*views, causal)

    def flash_attention_v2_backward(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                    causal: bool = False) -> None:
        """Backward of `flash_attention_v2` without mask or dropout."""
        self.flash_attention_v2_backward_with(q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                              AttentionOptions(causal=causal), None)

    def flash_attention_v2_backward_with(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                         opts: AttentionOptions = AttentionOptions(),
                                         mask=None, *, lse=None, kv_lens=None) -> None:
        """Backward of `flash_attention_v2_with`: `out` is the forward's output for the same
        inputs, `opts` and `mask` (dropout is regenerated from `opts.seed`). Writes, never
        accumulates into, `grad_q`, `grad_k`, `grad_v`; no gradient for the mask.

        `lse` (optional input, float32 `[batch, heads, seq_q]`): the forward's, taken as it is;
        the backward then skips recomputing it (same results to float32 rounding).

        `kv_lens` is not taken: a cache with per-sequence lengths is an inference-time thing."""
        if kv_lens is not None:
            raise ValueError("flash_attention_v2_backward_with does not take kv_lens (the "
                             "forward's per-sequence cache lengths); train on unpadded keys or "
                             "use an additive mask")
        named = {"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out, "grad_q": grad_q,
                 "grad_k": grad_k, "grad_v": grad_v, "mask": mask, "lse": lse}
        t, dims, params, layout = self._checked("backward", named, opts)
        if dims.batch * dims.heads * dims.seq_q == 0:
            # No query row (seq_q or heads 0): every key gets zero gradient, written, not left
            # as it was.
            self.backend.zero(t["grad_k"].buffer())
            self.backend.zero(t["grad_v"].buffer())
            return
        self.backend.backward(self._buffers(t, "q", "k", "v", "out", "grad_out", "grad_q",
                                             "grad_k", "grad_v", "mask", "lse"), params, layout)

    def _check_call(self, op: str, named: dict, opts):
        """(tensors, dims, packed params, packed layout) of an attention call ("forward" or
        "backward"), every check done: the rules of `_OPS[op]`."""
        t = self._tensors(**named)
        pack, outputs, kv_outputs, written = _OPS[op]
        dims, params, layout = self._attention(t, opts, pack, outputs=outputs,
                                               kv_outputs=kv_outputs, written=written)
        return t, dims, params, layout

    def _checked(self, op: str, named: dict, opts):
        """`_check_call`, or what an earlier call on these very tensors and options found."""
        key = self._seen_key(op, named, opts)
        hit = self._remembered(key, named)
        if hit is not None:
            return (named, *hit)
        t, dims, params, layout = self._check_call(op, named, opts)
        self._remember(key, named, (dims, params, layout))
        return t, dims, params, layout

    # --- calls on the same tensor objects ---------------------------------------------------------
    # A loop that calls with the same UnifiedTensors (a decode step, a benchmark) skips the
    # validation that depends only on them: a UnifiedTensor's array, hence its shape, dtype,
    # device, contiguity and address, is fixed for its life, so aliasing and every shape rule
    # give the same answer as last time. What can change is still checked on every call: the
    # values of kv_lens. Weak references: a remembered call keeps no tensor alive, and a tensor
    # that died (its id reused) is never mistaken for a new one. Only on the CUDA backend (a
    # NumPy output's writeable flag can change between calls).
    def _seen_key(self, op: str, named: dict, opts):
        if self.backend.name != "cuda" or not isinstance(opts, AttentionOptions):
            return None
        ids = []
        for x in named.values():
            if x is not None and type(x) is not UnifiedTensor:
                return None
            ids.append(None if x is None else id(x))
        values = _option_values(opts)
        return None if values is None else (op, tuple(ids), values)

    def _remembered(self, key, named: dict):
        """(dims, params, layout) of an earlier call on these very tensors and options, with
        kv_lens' values checked again; None when there was none."""
        if key is None:
            return None
        entry = self._seen.get(key)
        if entry is None:
            return None
        refs, found = entry
        for ref, x in zip(refs, named.values()):
            if (None if ref is None else ref()) is not x:
                return None
        if named.get("kv_lens") is not None:
            _check_kv_lens(named["kv_lens"], found[0])
        return found

    def _remember(self, key, named: dict, found: tuple) -> None:
        if key is None:
            return
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        refs = tuple(None if x is None else weakref.ref(x) for x in named.values())
        self._seen[key] = (refs, found)

    # --- validation (every check runs before any kernel) ----------------------------------------
    def _tensor(self, name: str, x, contiguous: bool = True) -> UnifiedTensor:
        """`x` as a UnifiedTensor on this engine's device; C-contiguous unless `contiguous` is
        False (the attention tensors: `_check_layout` states their rules)."""
        try:
            t = x if isinstance(x, UnifiedTensor) else UnifiedTensor(x)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        want = self.backend.device
        if t.device.split(":")[0] != want.split(":")[0] or (
                ":" in want and t.device != want):
            raise ValueError(f"{name} (shape {t.shape}) is on {t.device}, but this engine's "
                             f"{self.backend.name} backend runs on {want}")
        if contiguous and not t.is_contiguous:
            raise ValueError(f"{name} (shape {t.shape}) is not C-contiguous (strides "
                             f"{t.buffer().strides}); pass a contiguous copy")
        return t

    def _tensors(self, **named) -> dict:
        return {n: (None if x is None and n in _OPTIONAL else
                    self._tensor(n, x, contiguous=n in _CONTIGUOUS))
                for n, x in named.items()}

    def _check_dtype(self, *named) -> None:
        """One data dtype the backend takes for every tensor but `mask` (float32 or that dtype)
        and `lse` (float32)."""
        ok = self.backend.dtypes
        data = [(n, t) for n, t in named if t is not None and n not in _OPTIONAL]
        for name, t in data:
            if t.dtype not in ok:
                raise TypeError(f"{name} has dtype {t.dtype} (shape {t.shape}); the "
                                f"{self.backend.name} kernels take "
                                f"{', '.join(str(d) for d in ok)}")
        if len({t.dtype for n, t in data}) > 1:
            listing = ", ".join(f"{n}: {t.dtype}" for n, t in data)
            raise TypeError(f"inputs and outputs must share one dtype, got {listing}")
        named = dict(named)
        if named.get("mask") is not None and data:
            allowed = _dt.mask_dtypes(data[0][1].dtype)
            m = named["mask"]
            if m.dtype not in allowed:
                raise TypeError(f"mask has dtype {m.dtype} (shape {m.shape}); with "
                                f"{data[0][1].dtype} inputs it must be "
                                f"{' or '.join(str(d) for d in allowed)}")
        if named.get("lse") is not None and named["lse"].dtype != _dt.FLOAT32:
            raise TypeError(f"lse has dtype {named['lse'].dtype} (shape {named['lse'].shape}); "
                            f"it is float32 for every input dtype")

    def _attention(self, t: dict, opts: AttentionOptions, pack: str, outputs=(), kv_outputs=(),
                   written=()):
        """(dims, packed params, packed layout) of an attention call, after every check. What
        depends only on the shapes, strides, dtypes, devices and options is checked and packed
        once per such combination and remembered; what can change from call to call (lse's and
        kv_lens' contiguity, in `_tensor`; aliasing and writability of the outputs; the values of
        kv_lens) is checked on every call."""
        if not isinstance(opts, AttentionOptions):
            raise TypeError(f"opts must be AttentionOptions, got {type(opts).__name__}")
        values = _option_values(opts)
        key = None if values is None else (
            pack, values, tuple(None if x is None else (x.shape, x.strides, x.dtype, x.device)
                                for x in t.values()))
        hit = None if key is None else self._validated.get(key)
        if hit is not None:
            if t.get("kv_lens") is not None:
                _check_kv_lens(t["kv_lens"], hit[0])
            _check_outputs(t, tuple(n for n in written if t.get(n) is not None))
            return hit
        found = self._attention_checked(t, opts, pack, outputs, kv_outputs, written)
        if key is not None:
            if len(self._validated) >= _VALIDATED_MAX:
                self._validated.clear()
            self._validated[key] = found
        return found

    def _attention_checked(self, t: dict, opts, pack: str, outputs, kv_outputs, written):
        opts.validate()
        self._check_dtype(*t.items())
        q, k, v = t["q"], t["k"], t["v"]
        dims = AttentionDims.new(q, k)
        if v.shape != k.shape:
            raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
        for name in outputs:
            if t[name].shape != q.shape:
                raise ValueError(f"{name} shape {t[name].shape} must equal q shape {q.shape}")
        for name in kv_outputs:
            if t[name].shape != k.shape:
                raise ValueError(f"{name} shape {t[name].shape} must equal k shape {k.shape}")
        if t.get("kv_lens") is not None:
            _check_kv_lens(t["kv_lens"], dims)
        if t.get("lse") is not None:
            want = (dims.batch, dims.heads, dims.seq_q)
            if t["lse"].shape != want:
                raise ValueError(f"lse shape {t['lse'].shape} must be [batch, heads, seq_q] = "
                                 f"{list(want)} (q shape {q.shape})")
        present = tuple(n for n in written if t.get(n) is not None)
        _check_layout(t, present)
        _check_outputs(t, present)
        return dims, getattr(dims, pack)(opts, t["mask"]), layout_params(t)

    @staticmethod
    def _buffers(t: dict, *names) -> dict:
        return {n: (None if t[n] is None else t[n].buffer()) for n in names}


_OPTION_VALUES: dict = {}  # id(opts) -> (opts, its values), see _option_values
_OPTION_VALUES_MAX = 256


def _option_values(opts: AttentionOptions):
    """The options' values with their types, hashable (True == 1 == 1.0, but only some of them
    are valid), or None if one is unhashable (validate() will say why). Remembered per options
    object (a frozen dataclass; the entry holds it, so its id is not reused while remembered):
    a loop passing the same object pays for this once."""
    hit = _OPTION_VALUES.get(id(opts))
    if hit is not None and hit[0] is opts:
        return hit[1]
    values = tuple((x.__class__, x) for x in opts.__dict__.values())
    try:
        hash(values)
    except TypeError:
        return None
    if len(_OPTION_VALUES) >= _OPTION_VALUES_MAX:
        _OPTION_VALUES.clear()
    _OPTION_VALUES[id(opts)] = (opts, values)
    return values


_OPTIONAL = ("mask", "lse", "kv_lens")  # None is allowed; none takes the data dtype
_CONTIGUOUS = ("lse", "kv_lens")  # C-contiguous; the others as `_check_layout` says
# Per operation: the params it packs, the tensors shaped like q, those shaped like k, those written.
_OPS = {
    "forward": ("params", ("out",), (), ("out", "lse")),
    "backward": ("params_bwd", ("out", "grad_out", "grad_q"), ("grad_k", "grad_v"),
                 ("grad_q", "grad_k", "grad_v")),
}
_VALIDATED_MAX = 256  # remembered call shapes per engine (a long-running job sees few)
_SEEN_MAX = 64  # remembered calls on the same tensor objects per engine


def _check_kv_lens(t: UnifiedTensor, dims) -> None:
    """int32 [batch] with every value in [0, seq_k]; reads the values (a copy to the host)."""
    if t.dtype != np.int32:
        raise TypeError(f"kv_lens has dtype {t.dtype} (shape {t.shape}); it must be int32")
    if t.shape != (dims.batch,):
        raise ValueError(f"kv_lens shape {t.shape} must be [batch] = [{dims.batch}]")
    buf = t.buffer()
    check_kv_lens_values(buf if isinstance(buf, np.ndarray) else buf.get(), dims.seq_k)


def check_kv_lens_values(values: np.ndarray, seq_k: int) -> None:
    """Every kv_lens value (on the host) in [0, seq_k]."""
    bad = np.flatnonzero((values < 0) | (values > seq_k))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"kv_lens[{i}] = {int(values[i])} is outside [0, seq_k = {seq_k}] "
                         f"({bad.size} of {values.size} entries are)")


def _memory_range(a) -> tuple[int, int]:
    """[first byte, last byte + 1) that a view with non-negative strides can touch (a strided
    view's span, not its size: two views interleaved in one buffer count as sharing it)."""
    # (NumPy's `a.data` is a memoryview, which refuses bfloat16; the array interface does not)
    start = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    if a.size == 0:
        return start, start
    return start, start + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) + a.itemsize


def _check_layout(t: dict, written) -> None:
    """Strides: whole elements, none negative. The rank-4 tensors (q, k, v, out and the
    gradients) need only a contiguous last dimension (head_dim stride 1: rows are copied in
    16-byte pieces); their other dimensions, and the mask's, may have any stride (a transposed
    or sliced view, a broadcast input). An output must not overlap itself."""
    for name, x in t.items():
        if x is None or x.numel == 0:  # nothing is read or written (CuPy may give it 0 strides)
            continue
        st, shape = x.strides, x.shape
        if any(not isinstance(s, int) or s < 0 for s in st):
            raise ValueError(f"{name} (shape {shape}) has strides {st} (in elements): each must "
                             f"be a non-negative whole number of elements")
        if name in LAYOUT_TENSORS and shape[-1] > 1 and st[-1] != 1:
            raise ValueError(f"{name} (shape {shape}, element strides {st}) must have a "
                             f"contiguous last dimension (head_dim stride 1); its other "
                             f"dimensions may have any stride")
        if name in written and _overlaps_itself(shape, st):
            raise ValueError(f"{name} (shape {shape}, element strides {st}) has elements that "
                             f"share memory; an output needs one place per element")


def _overlaps_itself(shape, strides) -> bool:
    """Whether two indices of a view can reach one element: sorted by stride, each dimension
    must step past everything the smaller ones reach (sufficient, and what dense layouts and
    their transposes and slices satisfy)."""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def _check_outputs(t: dict, written) -> None:
    """Outputs must be writable and share no memory with any other argument: the kernels read
    inputs after other blocks (or the other backward kernel) have written outputs."""
    spans = {n: (x.device, *_memory_range(x.buffer())) for n, x in t.items()
             if x is not None and x.numel}
    for out in written:
        buf = t[out].buffer()
        if isinstance(buf, np.ndarray) and not buf.flags.writeable:
            raise ValueError(f"{out} (shape {t[out].shape}) is read-only")
        if out not in spans:
            continue
        dev, lo, hi = spans[out]
        for other, (odev, olo, ohi) in spans.items():
            if other != out and dev == odev and lo < ohi and olo < hi:
                raise ValueError(f"{out} (shape {t[out].shape}) shares memory with {other} "
                                 f"(shape {t[other].shape}); pass a separate output tensor")


def _single_head_view(name: str, x, engine: ComputeEngine) -> UnifiedTensor:
    t = engine._tensor(name, x)
    if len(t.shape) != 2:
        raise ValueError(f"{name} must be a [seq_len, head_dim] tensor, got shape {t.shape}")
    return t.reshaped((1, t.shape[0], 1, t.shape[1]))
