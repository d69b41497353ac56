"""Attention plans: the front door every caller goes through.

A plan is one attention operation (forward or backward) for one set of tensor *specs* (shape,
element strides, dtype, device of each argument) and options. Making it runs every check that
depends on those alone and packs the kernels' parameter structs; `ComputeEngine.plan_attention`
and `plan_attention_backward` make plans and keep them, one per combination. Running it runs
the checks that depend on the call's memory, on every call and before anything is launched:

- each argument matches the plan's spec (`run`; `run_pointers` takes the caller's word);
- no output shares a byte with any other argument (inputs, the other outputs; the span of a
  strided view counts whole, so views interleaved in one buffer overlap), and a host output is
  writable;
- the index tensors' values (read from the call's memory, on the call's stream): every
  `kv_lens` value lies in `[0, seq_k]` (with an append, `kv_lens[b] + new keys` too); each
  `cu_seqlens_*` starts at 0, never decreases, ends at its tensor's total and steps by at most
  its `max_seqlen_*`; every `block_table` entry a sequence reaches names a block of the cache;
  RoPE tables have a row for every position an append rotates.

If any check fails, the call raises `ValueError` (or `TypeError`) naming the argument and its
shape, and nothing is written.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from . import dtypes as _dt
from .params import LAYOUT_TENSORS, AttentionDims, check_seed, extras_params, layout_params

FORWARD, BACKWARD = "forward", "backward"
# Argument names in call order; which are optional (None allowed), which are written.
ARGS = {
    FORWARD: ("q", "k", "v", "out", "mask", "lse", "kv_lens", "alibi_slopes", "sinks",
              "cu_seqlens_q", "cu_seqlens_k", "block_table", "k_new", "v_new", "rotary_cos",
              "rotary_sin"),
    BACKWARD: ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v", "mask", "lse",
               "alibi_slopes", "sinks", "grad_sinks", "cu_seqlens_q", "cu_seqlens_k"),
}
OPTIONAL = ("mask", "lse", "kv_lens", "alibi_slopes", "sinks", "grad_sinks", "cu_seqlens_q",
            "cu_seqlens_k", "block_table", "k_new", "v_new", "rotary_cos", "rotary_sin")
# Written by every call that has them; an append also writes the cache (k and v).
WRITTEN = {FORWARD: ("out", "lse"), BACKWARD: ("grad_q", "grad_k", "grad_v", "grad_sinks")}
_APPEND_WRITTEN = ("k", "v")
_Q_SHAPED = {FORWARD: ("out",), BACKWARD: ("out", "grad_out", "grad_q")}
_K_SHAPED = {FORWARD: (), BACKWARD: ("grad_k", "grad_v")}
_INDEX = ("kv_lens", "cu_seqlens_q", "cu_seqlens_k", "block_table")  # int32, values checked
# C-contiguous; the rank-4 tensors need a contiguous last dim
_CONTIGUOUS = ("lse", "alibi_slopes", "sinks", "grad_sinks", "k_new", "v_new", "rotary_cos",
               "rotary_sin") + _INDEX
_PER_HEAD = ("alibi_slopes", "sinks", "grad_sinks")  # float32 per-head values, checked together

_TORCH_DTYPES = {"torch.float32": _dt.FLOAT32, "torch.float16": _dt.FLOAT16,
                 "torch.bfloat16": _dt.BFLOAT16, "torch.int32": np.dtype(np.int32),
                 "torch.int64": np.dtype(np.int64), "torch.float64": np.dtype(np.float64)}


class TensorSpec(NamedTuple):
    """What a plan knows of a tensor: shape, element strides, dtype and device ("cpu" or
    "cuda:N"). `TensorSpec.of(x)` reads them from a UnifiedTensor, a NumPy or CuPy array or a
    PyTorch tensor; `TensorSpec.contiguous(shape, dtype, device)` is a C-contiguous one."""

    shape: tuple
    strides: tuple
    dtype: np.dtype
    device: str

    @classmethod
    def contiguous(cls, shape, dtype, device: str) -> "TensorSpec":
        shape = tuple(int(n) for n in shape)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        return cls(shape, tuple(reversed(strides)), _dt.parse(dtype), device)

    @classmethod
    def of(cls, x) -> "TensorSpec":
        if isinstance(x, TensorSpec):
            return x
        if _is_torch(x):
            name = str(x.dtype)
            if name not in _TORCH_DTYPES:
                raise TypeError(f"tensor of shape {tuple(x.shape)} has dtype {name}, which "
                                f"ferrocupy does not take")
            dev = x.device
            device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
            return cls(tuple(x.shape), tuple(x.stride()), _TORCH_DTYPES[name], device)
        from .tensor import UnifiedTensor

        t = x if isinstance(x, UnifiedTensor) else UnifiedTensor(x)
        return cls(t.shape, t.strides, t.dtype, t.device)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        """C order (a dimension of size 1 may have any stride, as in NumPy; an empty tensor,
        which has no element to place, is contiguous whatever its strides)."""
        if self.numel == 0:
            return True
        step = 1
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and st != step:
                return False
            step *= n
        return True

    @property
    def span_bytes(self) -> int:
        """Bytes from the first element's address to one past the last byte the view can
        touch (0 for an empty tensor): its span, not its size."""
        if self.numel == 0:
            return 0
        return int(sum((n - 1) * st for n, st in zip(self.shape, self.strides)) + 1) \
            * self.dtype.itemsize

    def __str__(self) -> str:
        return f"shape {self.shape}, strides {self.strides}, {self.dtype}, {self.device}"


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


class PlanScalars(NamedTuple):
    """The call's arguments besides tensors and options that a plan depends on (kept in its
    key): varlen's `max_seqlen_q`, `max_seqlen_k` (ints, with `cu_seqlens_*`; None without)
    and an append's `rotary_interleaved` (with RoPE tables)."""

    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    rotary_interleaved: bool = False

    def key(self):
        """The values with their types (True == 1, but only one is a valid max_seqlen)."""
        return tuple((type(x), x) for x in self)


class AttentionPlan:
    """One checked attention operation for one set of specs and options (see the module
    docstring). Read-only attributes: `op` ("forward" / "backward"), `options`, `dims`
    (`AttentionDims`), `specs` (name -> `TensorSpec` or None), `params`, `layout` and `extras`
    (the packed structs the kernels receive), `names` (the arguments in call order),
    `written`, `scalars` (`PlanScalars`)."""

    def __init__(self, backend, op: str, specs: dict, opts, scalars: PlanScalars = PlanScalars()):
        self.backend, self.op, self.options, self.scalars = backend, op, opts, scalars
        self.names = ARGS[op]
        self.specs = {n: specs.get(n) for n in self.names}
        self.dims, self.params, self.layout, self.extras = _check(backend, op, self.specs, opts,
                                                                 scalars)
        self.new_keys = _new_keys(self.specs)
        written = WRITTEN[op] + (_APPEND_WRITTEN if self.new_keys is not None else ())
        self.written = tuple(n for n in written if self.specs[n] is not None)
        # (An append writes the cache even when no query row attends.)
        self.empty = (self.dims.batch * self.dims.heads * self.dims.seq_q == 0
                      and self.new_keys is None)
        # (name, span) of the arguments that occupy memory, and of the outputs among them
        self._spans = [(n, s.span_bytes) for n, s in self.specs.items()
                       if s is not None and s.numel]
        self._outputs = [(n, span) for n, span in self._spans if n in self.written]
        self._indexed = any(self.specs.get(n) is not None for n in _INDEX)
        self._rows = [n for n, s in self.specs.items() if s is not None and n in LAYOUT_TENSORS]
        self._launches: dict = {}  # the CUDA backend's plans, by (its table, rows' alignment)
        # Dropout's seed, written into the kernels' packed params on each run: plans of one call
        # shape that differ only in their seed share the backend's launch plans (`reseeded`).
        self._seed = int(self.params["seed"]) if opts.dropout_prob else None

    def reseeded(self, opts) -> "AttentionPlan":
        """This plan for options `opts` that differ from its own in the seed alone (only the
        seed is checked): every check and the backend's launch plans are shared."""
        check_seed(opts.seed)
        plan = object.__new__(AttentionPlan)
        plan.__dict__.update(self.__dict__)
        plan.options = opts
        seed = int(opts.seed) & 0xFFFFFFFF  # the kernels use the low 32 bits
        raw = bytearray(self.params.tobytes())  # (a copy this way is ~8x cheaper than .copy())
        struct.pack_into("<I", raw, self.params.dtype.fields["seed"][1], seed)
        plan.params = np.frombuffer(raw, self.params.dtype)[0]
        if plan._seed is not None:
            plan._seed = seed
        return plan

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={tuple(s.shape)}" for n, s in self.specs.items() if s)
        return f"AttentionPlan({self.op}, {shown}, {self.options})"

    # --- running ----------------------------------------------------------------------------
    def run(self, *args, stream=None, alloc=None, **named) -> None:
        """Run on these tensors (the plan's argument names, positional in `names` order or by
        keyword; an optional one the plan has no spec for is None). Each must match its spec.
        `stream` (CUDA): a CUstream handle (int) or a CuPy stream, default CuPy's current;
        `alloc(shape)`: makes the call's float32 workspace (e.g. `torch.empty`), default the
        plan's own per stream."""
        tensors = self._bind(args, named)
        cuda = self.backend.name == "cuda"
        arrays, ptrs = {}, {}
        for n, x in tensors.items():
            spec = self.specs[n]
            if (x is None) != (spec is None):
                raise ValueError(f"{n}: the plan was made {'without' if spec is None else 'with'}"
                                 f" it, but this call {'passes' if spec is None else 'omits'} it")
            if x is None:
                arrays[n], ptrs[n] = None, 0
                continue
            got = TensorSpec.of(x)
            if got != spec:
                raise ValueError(f"{n} ({got}) does not match the plan's {n} ({spec}); make a "
                                 f"plan for it")
            if cuda and _is_torch(x):
                ptrs[n] = x.data_ptr()
            else:
                arrays[n] = _array(x)
                ptrs[n] = _address(arrays[n])
        if cuda:
            self.run_pointers(ptrs, stream=stream, alloc=alloc)
            return
        for n in self.written:
            if not arrays[n].flags.writeable:
                raise ValueError(f"{n} (shape {self.specs[n].shape}) is read-only")
        self._check_memory(ptrs)
        if self._indexed:
            self._check_values(lambda n: np.asarray(arrays[n]))
        if self.empty:
            if self.op == BACKWARD:
                # No query row: every key (and sink) gets zero gradient, written, not left as
                # it was.
                for n in ("grad_k", "grad_v", "grad_sinks"):
                    if arrays[n] is not None:
                        self.backend.zero(arrays[n])
            return
        getattr(self.backend, self.op)(arrays, self.params, self.layout, self.extras)

    def run_pointers(self, pointers: dict, *, stream=None, alloc=None, capturing=False,
                     fresh=()) -> None:
        """CUDA: run on the tensors at these device addresses (name -> int, 0 or absent for an
        argument the plan has no spec for). The caller vouches that each address holds a tensor
        of the plan's spec, on the plan's device; the memory checks still run. `capturing`
        (a bool, or a function answering it, asked only where it matters): the call is being
        captured in a CUDA graph, so a persistent kernel claims its tiles from a counter of
        the call's own, made with `alloc`, not from the stream's. `fresh`: names of outputs
        the caller allocated for this call alone (they share memory with nothing), whose
        overlap checks are skipped."""
        backend = self.backend
        if backend.name != "cuda":
            raise ValueError(f"run_pointers needs the CUDA backend; this plan runs on "
                             f"{backend.name}: use run()")
        for name, span in self._outputs:
            if name not in fresh:
                self._check_output(name, span, pointers)
        if type(stream) is not int:
            stream = backend.current_stream() if stream is None else int(
                getattr(stream, "ptr", stream))
        if self._indexed:
            self._check_values(lambda n: backend.read_int32(
                pointers[n], self.specs[n].numel, stream).reshape(self.specs[n].shape))
        if self.empty:
            if self.op == BACKWARD:  # (as run(): every key and sink gets zero gradient)
                for n in ("grad_k", "grad_v", "grad_sinks"):
                    spec = self.specs[n]
                    if spec is not None:
                        backend.zero_view(pointers[n], spec.shape, spec.strides, spec.dtype,
                                          stream)
            return
        low = 0  # the data rows' addresses' low bits pick the copy width
        for n in self._rows:
            low |= pointers[n]
        low = (backend.generation, low & 15)
        launch = self._launches.get(low)
        if launch is None:
            launch = self._launches[low] = backend.plan(self.op, self.specs, self.params,
                                                        self.layout, dict.fromkeys(self.names, 0)
                                                        | pointers, self.extras)
        counter = None
        if launch.counted and (capturing() if callable(capturing) else capturing):
            if alloc is None:
                raise ValueError("run_pointers(capturing=True) needs alloc (a zeroed tile "
                                 "counter of the call's own)")
            counter = alloc((1,))
            counter.zero_() if hasattr(counter, "zero_") else counter.fill(0)
        backend.run_plan(launch, pointers, stream, alloc, counter, seed=self._seed)

    # --- checks on the call's memory ----------------------------------------------------------
    def _check_values(self, read) -> None:
        """The index tensors' values (`read(name)`: a host int array of that argument)."""
        specs, dims = self.specs, self.dims
        lens = None if specs.get("kv_lens") is None else read("kv_lens")
        if lens is not None:
            check_kv_lens_values(lens, dims.seq_k, self.new_keys)
        if specs.get("cu_seqlens_q") is not None:
            for side, total, most in (("q", specs["q"].shape[0], self.scalars.max_seqlen_q),
                                      ("k", specs["k"].shape[0], self.scalars.max_seqlen_k)):
                check_cu_seqlens(read(f"cu_seqlens_{side}"), f"cu_seqlens_{side}", total, most,
                                 f"max_seqlen_{side}")
        reach = (np.full(dims.batch, dims.seq_k, np.int64) if lens is None
                 else lens.astype(np.int64) + (self.new_keys or 0))
        if specs.get("block_table") is not None:
            k = specs["k"]
            check_block_table(read("block_table"), reach, k.shape[1], k.shape[0])
        if specs.get("rotary_cos") is not None:
            check_rotary_reach(specs["rotary_cos"].shape[0], lens, self.new_keys, dims.seq_q,
                               _rotates_q_rows(self.options))

    def _bind(self, args, named) -> dict:
        if len(args) > len(self.names):
            raise TypeError(f"run() takes at most {len(self.names)} tensors ({', '.join(self.names)})"
                            f", got {len(args)}")
        tensors = dict.fromkeys(self.names)
        tensors.update(zip(self.names, args))
        for n, x in named.items():
            if n not in tensors:
                raise TypeError(f"run() got an unexpected argument {n!r}; the plan's are "
                                f"{', '.join(self.names)}")
            if n in self.names[:len(args)]:
                raise TypeError(f"run() got {n!r} twice")
            tensors[n] = x
        return tensors

    def _check_memory(self, ptrs: dict) -> None:
        """No output shares a byte with another argument (`ptrs`: name -> address)."""
        for name, span in self._outputs:
            self._check_output(name, span, ptrs)

    def _check_output(self, name: str, span: int, ptrs: dict) -> None:
        """Output `name` (`span` bytes) shares no byte with another argument."""
        lo = ptrs[name]
        hi = lo + span
        for other, ospan in self._spans:
            if other != name and ptrs[other] < hi and lo < ptrs[other] + ospan:
                raise ValueError(
                    f"{name} (shape {self.specs[name].shape}) shares memory with {other} "
                    f"(shape {self.specs[other].shape}); pass a separate output tensor")


# --- the checks that depend on the specs and options alone ---------------------------------------
def _check(backend, op: str, specs: dict, opts, scalars: PlanScalars):
    """(dims, params, layout, extras) of a call, every spec rule checked (SPEC "Errors")."""
    for n in ARGS[op]:
        if specs[n] is None and n not in OPTIONAL:
            raise TypeError(f"{n} is required")
    for n, s in specs.items():
        if s is None:
            continue
        check_device(backend, n, s)
        if n in _CONTIGUOUS and not s.is_contiguous:
            raise ValueError(f"{n} (shape {s.shape}) is not C-contiguous (element strides "
                             f"{s.strides}); pass a contiguous copy")
    opts.validate()
    check_dtypes(backend, specs)
    q, k, v = specs["q"], specs["k"], specs["v"]
    _check_index_dtypes(specs)
    dims = _dims_of(specs, scalars)
    check_backend_reach(backend, specs, opts, dims)
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
    for n in _Q_SHAPED[op]:
        if specs[n].shape != q.shape:
            raise ValueError(f"{n} shape {specs[n].shape} must equal q shape {q.shape}")
    for n in _K_SHAPED[op]:
        if specs[n].shape != k.shape:
            raise ValueError(f"{n} shape {specs[n].shape} must equal k shape {k.shape}")
    lens = specs.get("kv_lens")
    if lens is not None and lens.shape != (dims.batch,):
        raise ValueError(f"kv_lens shape {lens.shape} must be [batch] = [{dims.batch}]")
    varlen = specs.get("cu_seqlens_q") is not None
    lse = specs.get("lse")
    if varlen:
        want, text = (dims.heads, q.shape[0]), "[heads, total_q]"
    else:
        want, text = (dims.batch, dims.heads, dims.seq_q), "[batch, heads, seq_q]"
    if lse is not None and lse.shape != want:
        raise ValueError(f"lse shape {lse.shape} must be {text} = {list(want)} (q shape "
                         f"{q.shape})")
    _check_per_head(specs, dims)
    new_keys, rotary_dim = _check_append(specs, dims, opts)
    _check_layout(specs, WRITTEN[op] + (_APPEND_WRITTEN if new_keys is not None else ()))
    pack = dims.params if op == FORWARD else dims.params_bwd
    block_table = specs.get("block_table")
    extras = extras_params(opts, specs["alibi_slopes"], specs["sinks"], varlen=varlen,
                           page_size=0 if block_table is None else k.shape[1],
                           new_keys=new_keys, rotary_dim=rotary_dim,
                           rotary_interleaved=scalars.rotary_interleaved)
    return dims, pack(opts, specs["mask"]), layout_params(specs), extras


def _check_index_dtypes(specs: dict) -> None:
    for n in _INDEX:
        s = specs.get(n)
        if s is not None and s.dtype != np.int32:
            raise TypeError(f"{n} has dtype {s.dtype} (shape {s.shape}); it must be int32")


def _dims_of(specs: dict, scalars: PlanScalars):
    """The call's dims: varlen (`cu_seqlens_*` with `max_seqlen_*`), paged (`block_table`) or
    dense, with the rules on which tensors each takes."""
    q, k = specs["q"], specs["k"]
    cu_q, cu_k = specs.get("cu_seqlens_q"), specs.get("cu_seqlens_k")
    max_q, max_k = scalars.max_seqlen_q, scalars.max_seqlen_k
    if cu_q is None and cu_k is None:
        for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if value is not None:
                raise ValueError(f"{name} = {value} is given without cu_seqlens_q and "
                                 f"cu_seqlens_k (varlen)")
        table = specs.get("block_table")
        if table is None:
            return AttentionDims.new(q, k)
        return AttentionDims.paged(q, k, table)
    if cu_q is None or cu_k is None:
        given, missing = ("cu_seqlens_q", "cu_seqlens_k")[::1 if cu_k is None else -1]
        raise ValueError(f"varlen needs cu_seqlens_q and cu_seqlens_k: {given} (shape "
                         f"{specs[given].shape}) is given without {missing}")
    for name in ("mask", "kv_lens", "block_table", "k_new"):
        if specs.get(name) is not None:
            raise ValueError(f"{name} (shape {specs[name].shape}) cannot be combined with "
                             f"cu_seqlens_q/cu_seqlens_k (varlen)")
    for name, s in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if len(s.shape) != 1 or s.shape[0] < 1:
            raise ValueError(f"{name} shape {s.shape} must be [sequences + 1]")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q shape {cu_q.shape} and cu_seqlens_k shape {cu_k.shape} "
                         f"must be equal ([sequences + 1])")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if value is None:
            raise TypeError(f"{name} is required with cu_seqlens_q/cu_seqlens_k (varlen)")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not 0 <= value < 2**31:
            raise ValueError(f"{name} must be in [0, 2**31), got {value}")
    return AttentionDims.packed(q, k, cu_q.shape[0] - 1, int(max_q), int(max_k))


def _new_keys(specs: dict):
    """The keys an append writes per sequence (`k_new`'s seq dimension), or None."""
    k_new = specs.get("k_new")
    return None if k_new is None else int(k_new.shape[1])


def _check_append(specs: dict, dims, opts):
    """(new_keys or None, rotary_dim or 0) of a KV-cache append: `k_new`, `v_new` `[batch,
    new_keys, kv_heads, head_dim]` in q's dtype, with `kv_lens` (the cache lengths);
    `rotary_cos`, `rotary_sin` `[seqlen_ro, rotary_dim / 2]`, float32 or q's dtype."""
    k_new, v_new = specs.get("k_new"), specs.get("v_new")
    cos, sin = specs.get("rotary_cos"), specs.get("rotary_sin")
    if k_new is None and v_new is None:
        for name, s in (("rotary_cos", cos), ("rotary_sin", sin)):
            if s is not None:
                raise ValueError(f"{name} (shape {s.shape}) rotates an append's q and k_new: it "
                                 f"needs k_new and v_new")
        return None, 0
    if k_new is None or v_new is None:
        given = "k_new" if v_new is None else "v_new"
        raise ValueError(f"an append needs k_new and v_new: {given} (shape "
                         f"{specs[given].shape}) is given alone")
    if specs.get("kv_lens") is None:
        raise ValueError("an append (k_new, v_new) needs the cache lengths (cache_seqlens)")
    want = (dims.batch, None, dims.kv_heads, dims.head_dim)
    if len(k_new.shape) != 4 or any(w is not None and n != w for n, w in zip(k_new.shape, want)):
        raise ValueError(f"k_new shape {k_new.shape} must be [batch, new_keys, kv_heads, "
                         f"head_dim] with batch, kv_heads, head_dim = {dims.batch}, "
                         f"{dims.kv_heads}, {dims.head_dim} (q shape {specs['q'].shape}, "
                         f"k shape {specs['k'].shape})")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new shape {v_new.shape} must equal k_new shape {k_new.shape}")
    dtype = specs["q"].dtype
    for name, s in (("k_new", k_new), ("v_new", v_new)):
        if s.dtype != dtype:
            raise TypeError(f"{name} has dtype {s.dtype} (shape {s.shape}); it must be the "
                            f"cache's and q's ({dtype})")
    if cos is None and sin is None:
        return int(k_new.shape[1]), 0
    if cos is None or sin is None:
        given = "rotary_cos" if sin is None else "rotary_sin"
        raise ValueError(f"RoPE needs rotary_cos and rotary_sin: {given} (shape "
                         f"{specs[given].shape}) is given alone")
    if len(cos.shape) != 2 or not 1 <= cos.shape[1] <= dims.head_dim // 2:
        raise ValueError(f"rotary_cos shape {cos.shape} must be [seqlen_ro, rotary_dim / 2] "
                         f"with 2 <= rotary_dim <= head_dim = {dims.head_dim}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin shape {sin.shape} must equal rotary_cos shape {cos.shape}")
    for name, s in (("rotary_cos", cos), ("rotary_sin", sin)):
        if s.dtype not in (_dt.FLOAT32, dtype):
            raise TypeError(f"{name} has dtype {s.dtype} (shape {s.shape}); it must be float32 "
                            f"or q's dtype ({dtype})")
    if sin.dtype != cos.dtype:  # the CUDA append reads both as one type (append_kv.cu)
        raise TypeError(f"rotary_sin has dtype {sin.dtype} (shape {sin.shape}); it must be "
                        f"rotary_cos's ({cos.dtype})")
    return int(k_new.shape[1]), 2 * int(cos.shape[1])


def _rotates_q_rows(opts) -> bool:
    """Whether an append's RoPE puts q's row i at cache_seqlens[b] + i (causal or windowed,
    as flash-attn does) rather than every row at cache_seqlens[b]."""
    return bool(opts.causal) or opts.windows() != (-1, -1)


def _check_per_head(specs: dict, dims) -> None:
    """alibi_slopes float32 [heads] or [batch, heads]; sinks and grad_sinks float32 [heads];
    grad_sinks only with sinks."""
    for n in _PER_HEAD:
        s = specs.get(n)
        if s is None:
            continue
        if s.dtype != _dt.FLOAT32:
            raise TypeError(f"{n} has dtype {s.dtype} (shape {s.shape}); it must be float32")
        shapes = {(dims.heads,): "[heads]"}
        if n == "alibi_slopes":
            shapes[(dims.batch, dims.heads)] = "[batch, heads]"
        if s.shape not in shapes:
            want = " or ".join(f"{name} = {list(w)}" for w, name in shapes.items())
            raise ValueError(f"{n} shape {s.shape} must be {want} (q shape {specs['q'].shape})")
    if specs.get("grad_sinks") is not None and specs.get("sinks") is None:
        raise ValueError(f"grad_sinks (shape {specs['grad_sinks'].shape}) is the gradient of "
                         f"sinks, which this call does not have")


def check_backend_reach(backend, specs: dict, opts, dims) -> None:
    """The backend takes every option and tensor of the call: the one place that refuses, by
    name and before any launch, what a backend's kernels cannot take (SPEC: no silent fallback).
    The CUDA kernels take every option today (a paged KV cache on the decode kernels and the
    forward's paged builds alike), so it refuses nothing."""


def check_device(backend, name: str, t) -> None:
    """`t` (anything with `.device` and `.shape`) is on the backend's device."""
    want = backend.device
    if t.device.split(":")[0] != want.split(":")[0] or (":" in want and t.device != want):
        raise ValueError(f"{name} (shape {t.shape}) is on {t.device}, but this engine's "
                         f"{backend.name} backend runs on {want}")


def check_dtypes(backend, specs: dict) -> None:
    """One data dtype the backend takes for every tensor but `mask` (float32 or that dtype),
    `lse` (float32) and `kv_lens` (int32, checked with its shape)."""
    ok = backend.dtypes
    data = [(n, s) for n, s in specs.items() if s is not None and n not in OPTIONAL]
    for n, s in data:
        if s.dtype not in ok:
            raise TypeError(f"{n} has dtype {s.dtype} (shape {s.shape}); the {backend.name} "
                            f"kernels take {', '.join(str(d) for d in ok)}")
    if len({s.dtype for _, s in data}) > 1:
        listing = ", ".join(f"{n}: {s.dtype}" for n, s in data)
        raise TypeError(f"inputs and outputs must share one dtype, got {listing}")
    mask, dtype = specs.get("mask"), data[0][1].dtype
    if mask is not None and mask.dtype not in _dt.mask_dtypes(dtype):
        allowed = " or ".join(str(d) for d in _dt.mask_dtypes(dtype))
        raise TypeError(f"mask has dtype {mask.dtype} (shape {mask.shape}); with {dtype} inputs "
                        f"it must be {allowed}")
    lse = specs.get("lse")
    if lse is not None and lse.dtype != _dt.FLOAT32:
        raise TypeError(f"lse has dtype {lse.dtype} (shape {lse.shape}); it is float32 for "
                        f"every input dtype")


def _check_layout(specs: dict, written) -> None:
    """Strides: whole elements, none negative. The rank-4 tensors (q, k, v, out and the
    gradients) need only a contiguous last dimension (rows are copied in 16-byte pieces);
    their other dimensions, and the mask's, may have any stride (a transposed or sliced view,
    a broadcast input). An output must not overlap itself."""
    for name, s in specs.items():
        if s is None or s.numel == 0:  # nothing is read or written (CuPy may give 0 strides)
            continue
        st, shape = s.strides, s.shape
        if any(not isinstance(x, (int, np.integer)) or x < 0 for x in st):
            raise ValueError(f"{name} (shape {shape}) has strides {st} (in elements): each must "
                             f"be a non-negative whole number of elements")
        if name in LAYOUT_TENSORS and shape[-1] > 1 and st[-1] != 1:
            raise ValueError(f"{name} (shape {shape}, element strides {st}) must have a "
                             f"contiguous last dimension (head_dim stride 1); its other "
                             f"dimensions may have any stride")
        if name in written and overlaps_itself(shape, st):
            raise ValueError(f"{name} (shape {shape}, element strides {st}) has elements that "
                             f"share memory; an output needs one place per element")


def overlaps_itself(shape, strides) -> bool:
    """Whether two indices of a view can reach one element: sorted by stride, each dimension
    must step past everything the smaller ones reach (sufficient, and what dense layouts and
    their transposes and slices satisfy)."""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def check_kv_lens_values(values: np.ndarray, seq_k: int, new_keys: int | None = None) -> None:
    """Every kv_lens value (on the host) in [0, seq_k]; with an append of `new_keys` keys at
    each (kv_lens are then the cache_seqlens), `kv_lens[b] + new_keys` too."""
    i, count = _first((values < 0) | (values > seq_k))
    if i is not None:
        raise ValueError(f"kv_lens[{i}] = {int(values[i])} is outside [0, seq_k = {seq_k}] "
                         f"({count} of {values.size} entries are)")
    if new_keys is None:
        return
    ends = values.astype(np.int64) + new_keys
    i, count = _first(ends > seq_k)
    if i is not None:
        raise ValueError(f"cache_seqlens[{i}] = {int(values[i])} plus {new_keys} new keys (k_new) "
                         f"= {int(ends[i])} overflows the cache's capacity of {seq_k} keys "
                         f"({count} of {values.size} sequences do)")


def _first(bad: np.ndarray):
    """(the first index where `bad`, how many are), or (None, 0)."""
    where = np.flatnonzero(bad)
    return (int(where[0]), where.size) if where.size else (None, 0)


def check_cu_seqlens(values: np.ndarray, name: str, total: int, most: int,
                     most_name: str) -> None:
    """`values` (on the host) start at 0, never decrease, end at `total` (the packed tensor's
    rows), and no step exceeds `most` (the max_seqlen)."""
    values = values.astype(np.int64)
    if values[0] != 0:
        raise ValueError(f"{name}[0] = {int(values[0])} must be 0 ({name}: {values.tolist()})")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {int(values[-1])} must equal the packed tensor's rows "
                         f"({total}) ({name} shape {values.shape})")
    steps = np.diff(values)
    n, _ = _first((steps < 0) | (steps > most))
    if n is not None:
        what = "decreases" if steps[n] < 0 else f"exceeds {most_name} = {most}"
        raise ValueError(f"{name}[{n + 1}] - {name}[{n}] = {int(values[n + 1])} - "
                         f"{int(values[n])} = {int(steps[n])}: sequence {n}'s length {what}")


def check_block_table(table: np.ndarray, reach: np.ndarray, page_size: int,
                      num_blocks: int) -> None:
    """Every block a sequence reaches (the first ceil(reach[b] / page_size) of its row) is a
    block of the cache; the entries past them are never read and may hold anything."""
    used = -(-reach // page_size)
    cols = np.arange(table.shape[1])[None, :]
    bad = (cols < used[:, None]) & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a block of the "
                         f"cache (k shape: {num_blocks} blocks of {page_size}); sequence {b} "
                         f"reaches {int(reach[b])} keys ({int(used[b])} blocks)")


def check_rotary_reach(rows: int, lens: np.ndarray, new_keys: int, seq_q: int,
                       per_row: bool) -> None:
    """The RoPE tables (`rows` positions) cover every position the append rotates: k_new's
    at cache_seqlens[b] + t, q's at cache_seqlens[b] + i (`per_row`) or cache_seqlens[b]."""
    span = max(new_keys, seq_q if per_row else min(seq_q, 1))
    if span == 0:
        return
    ends = lens.astype(np.int64) + span
    i, _ = _first(ends > rows)
    if i is not None:
        raise ValueError(f"rotary_cos/rotary_sin have {rows} positions (shape [{rows}, ...]), "
                         f"but sequence {i} rotates positions up to {int(ends[i]) - 1} "
                         f"(cache_seqlens[{i}] = {int(lens[i])})")


# --- tensors of any kind -----------------------------------------------------------------------
def _array(x):
    """The NumPy or CuPy array behind `x` (no copy)."""
    from .tensor import UnifiedTensor

    if isinstance(x, UnifiedTensor):
        return x.buffer()
    if isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy"):
        return x
    if _is_torch(x):
        x = x.detach()  # DLPack refuses a tensor that requires grad (no copy)
    return UnifiedTensor(x).buffer()


def memory_range(a) -> tuple[int, int]:
    """[first byte, last byte + 1) that NumPy or CuPy array `a` (non-negative strides) can
    touch: its span, not its size."""
    start = _address(a)
    if a.size == 0:
        return start, start
    return start, start + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) + a.itemsize


def _address(a) -> int:
    """A NumPy array's host address or a CuPy array's device address."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return a.data.ptr


