"""The CUDA backend: runs the engine's operations as kernel launches. RoPE launches directly;
attention is planned (`plan`: the kernel variants picked from `configs.py` by dtype, head_dim,
copy width and the GPU's shared memory, every launch compiled and checked, arguments packed) and
then run (`run_plan`: addresses filled in, workspace found, launched in order on a stream).
`ferrocupy.plan.AttentionPlan` holds the plans and does every check of the call before this
sees it; each kernel receives the packed parameter struct by value."""

from __future__ import annotations

import threading

import numpy as np

from ..dtypes import ATTENTION_DTYPES, BFLOAT16, FLOAT16, FLOAT32
from ..params import (EXTRAS_ALIBI, EXTRAS_APPEND, EXTRAS_PAGED, EXTRAS_ROTARY, EXTRAS_SINKS,
                      EXTRAS_VARLEN, LAYOUT_TENSORS, contiguous_rope_layout, forward_params_of,
                      seed_extras)
from ..reference import rope_inverse_frequencies
from . import configs
from .launch import NULL, PackedLaunch, Plan, Slot, address, external_stream
from .loader import KernelLoader

GRID_X_MAX = 2**31 - 1
_PLANS_MAX = 256  # RoPE plans kept per backend (a long-running job sees few call shapes)
# buffers whose alignment picks no copy width
_NOT_ROWS = ("mask", "lse", "kv_lens", "stats", "alibi_slopes", "sinks", "grad_sinks",
             "dq_accum", "dq_semaphores", "block_table", "k_new", "v_new", "rotary_cos",
             "rotary_sin", "cu_seqlens_q", "cu_seqlens_k")
_MASK_KIND = {FLOAT32: 0, FLOAT16: 1, BFLOAT16: 2}  # ferro_params.cuh's MaskKind
# Streams that get a tile counter of their own (a persistent kernel's blocks claim tiles from it);
# a launch on any further stream passes none, and its blocks take tiles in a fixed turn. Launches
# on one stream are ordered, so they share its counter; a launch captured in a CUDA graph should
# get its own (run_plan's `counter`: ferrocupy.torch does), else replays of graphs captured on one
# stream, run at once, would claim from the same counter.
COUNTER_STREAMS = 64
_COUNTER_LOCK = threading.Lock()  # two threads meeting new streams get different counters


class CudaBackend:
    name = "cuda"
    dtypes = ATTENTION_DTYPES
    _fused_backward = None  # None: configs.FUSED_BACKWARD decides (see fused_backward)

    def __init__(self, table: dict | None = None):
        import cupy

        self.xp = cupy
        self._id = cupy.cuda.Device().id
        self.device = f"cuda:{self._id}"
        self.loader = KernelLoader()
        self._table = configs.TABLE if table is None else table
        # (op, dtype, head_dim, copy bytes, decode rows, many decode blocks) -> (variant, kernel); a decode variant ->
        # its combine
        self._kernels: dict = {}
        self.generation = 0  # counts table swaps: a plan made before one is stale
        self._rope_plans: dict = {}  # see rope
        self._rope_tables: dict = {}  # (rotary_dim, theta) -> its inverse frequencies, uploaded
        # Read once: CuPy's `attributes` queries every device attribute on each access.
        attrs = cupy.cuda.Device(self._id).attributes
        self._smem_limit = attrs["MaxSharedMemoryPerBlockOptin"]
        self._smem_per_sm = attrs["MaxSharedMemoryPerMultiprocessor"]
        self.sm_count = attrs["MultiProcessorCount"]
        self.capability = int(cupy.cuda.Device(self._id).compute_capability)  # e.g. 90
        # The persistent kernels' tile counters, one per stream: zero now, and each launch
        # leaves its counter at zero again, so calls on a stream (ordered) share one.
        self._counters = cupy.zeros(COUNTER_STREAMS, dtype=np.uint32)
        cupy.cuda.Device(self._id).synchronize()  # zero before a kernel on any stream reads it
        self._counter_of: dict = {}  # stream -> its counter's address

    @property
    def table(self) -> dict:
        return self._table

    @table.setter
    def table(self, table: dict) -> None:  # a tuning sweep swaps it; forget the chosen kernels
        self._table = table
        self._kernels = {}
        self.generation += 1  # plans made with the old table are made again

    @property
    def fused_backward(self) -> bool:
        """Whether the backward takes the fused kernels where they serve the call (default
        configs.FUSED_BACKWARD: the environment's switch, else configs.FUSED_BACKWARD_DEFAULT);
        setting it renews the plans."""
        return configs.FUSED_BACKWARD if self._fused_backward is None else self._fused_backward

    @fused_backward.setter
    def fused_backward(self, on: bool) -> None:
        self._fused_backward = bool(on)
        self.generation += 1  # plans made before choose their backward again

    def device_name(self) -> str:
        props = self.xp.cuda.runtime.getDeviceProperties(self._id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else name

    def empty(self, shape, dtype):
        """An uninitialised array on this backend's device."""
        with self.xp.cuda.Device(self._id):
            return self.xp.empty(shape, dtype=dtype)

    def zero(self, array) -> None:
        """Fill `array` with zeros on this backend's device (its current stream)."""
        with self.xp.cuda.Device(self._id):
            array.fill(0)

    # --- operations -----------------------------------------------------------------------------
    def rope(self, x, params: np.void, *, out=None, positions=None,
             layout: np.void | None = None) -> None:
        """RoPE of `x` into `out` (None: in place), on CuPy's current stream of this device;
        `layout`: both one's strides and the positions' batch stride (None: C-contiguous)."""
        if self.xp.cuda.runtime.getDevice() != self._id:
            with self.xp.cuda.Device(self._id):
                return self.rope(x, params, out=out, positions=positions, layout=layout)
        out = x if out is None else out
        ptrs = {"x": address(x), "out": address(out),
                "positions": 0 if positions is None else address(positions)}
        if layout is None:
            layout = contiguous_rope_layout(params)
        key = (params.tobytes(), layout.tobytes(), x.dtype, x.size, ptrs["x"] == ptrs["out"],
               (ptrs["x"] | ptrs["out"]) & 15)
        plan = self._rope_plans.get(key)
        if plan is None:
            plan = self._rope_plan(x, params, layout, ptrs, positions is not None)
            if len(self._rope_plans) >= _PLANS_MAX:
                self._rope_plans.clear()
            self._rope_plans[key] = plan
        plan.run(ptrs, self.xp.cuda.get_current_stream().ptr)

    def _rope_plan(self, x, params: np.void, layout: np.void, ptrs: dict,
                   has_positions: bool) -> Plan:
        """RoPE's one launch: the widest access the addresses and strides allow, enough
        (token, head group, lane) items to fill the GPU."""
        d, heads = int(params["head_dim"]), int(params["heads"])
        rd = int(params["rotary_dim"]) or d
        in_place = ptrs["x"] == ptrs["out"]
        strides = [layout[f"{n}_{c}"] for n in ("x", "out") for c in "bsh"]
        vec = configs.rope_vector(x.dtype, d, rd, strides, (ptrs["x"], ptrs["out"]))
        fn = self.loader.function(configs.ROPE_SOURCE, configs.ROPE_KERNEL,
                                  configs.rope_defines(x.dtype, vec))
        tokens = x.size // (d * heads)
        # rope.cu's lanes: rotating ones, then copying ones with two vectors each
        lanes = rd // 2 // vec + ((0 if in_place else (d - rd) // vec) + 1) // 2
        groups = configs.rope_head_groups(tokens, lanes, heads, self.sm_count)
        threads = configs.ROPE_THREADS
        blocks = max(1, min(-(-(tokens * groups * lanes) // threads), self.sm_count * 32))
        args = (Slot("x"), Slot("out"), Slot("positions") if has_positions else NULL,
                self._rope_frequencies(rd, params["theta"]), np.uint64(tokens),
                np.uint32(groups), params, layout)
        return Plan([PackedLaunch(fn, blocks, threads, 0, args)])

    def _rope_frequencies(self, rotary_dim: int, theta) -> object:
        """The float32 inverse frequencies of (rotary_dim, theta) on this device: the reference's
        own values (reference.rope_inverse_frequencies), uploaded once."""
        key = (rotary_dim, np.float32(theta).tobytes())
        table = self._rope_tables.get(key)
        if table is None:
            host = rope_inverse_frequencies(rotary_dim, theta)
            stream = self.xp.cuda.get_current_stream()
            table = self.xp.asarray(host)
            stream.synchronize()  # in place before any stream's kernel reads it
            self._rope_tables[key] = table
        return table

    # --- attention: plans made by ferrocupy.plan.AttentionPlan, one per alignment ------------
    def plan(self, op: str, buffers: dict, params: np.void, layout: np.void, ptrs: dict,
             extras: np.void | None = None) -> Plan:
        """The launches of `op` ("forward" or "backward") for these params, layout and extras
        (the call's AttnExtras; None: a call with the seed's options alone), the buffers' dtypes
        (`buffers`: name -> anything with `.dtype`, or None for an absent one) and their
        addresses' alignment (`ptrs`: name -> address), every launch compiled and checked. The
        caller keeps it: it is the same for every call with these."""
        if extras is None:
            extras = seed_extras(params)
        if self.xp.cuda.runtime.getDevice() != self._id:
            with self.xp.cuda.Device(self._id):
                return self.plan(op, buffers, params, layout, ptrs, extras)
        return self._make_plan(op, buffers, params, layout, ptrs, extras)

    def current_stream(self) -> int:
        """CuPy's current stream on this backend's device, as a CUstream handle."""
        if self.xp.cuda.runtime.getDevice() != self._id:  # CuPy's current stream is per device
            with self.xp.cuda.Device(self._id):
                return self.xp.cuda.get_current_stream().ptr
        return self.xp.cuda.get_current_stream().ptr

    def read_int32(self, ptr: int, n: int, stream: int) -> np.ndarray:
        """`n` int32 values at device address `ptr`, copied to the host in `stream`'s order."""
        host = np.empty(n, np.int32)
        if n:
            runtime = self.xp.cuda.runtime
            runtime.memcpyAsync(host.ctypes.data, ptr, 4 * n, runtime.memcpyDeviceToHost, stream)
            runtime.streamSynchronize(stream)
        return host

    def zero_view(self, ptr: int, shape, strides, dtype, stream: int) -> None:
        """Write zeros to the strided view (element `strides`) at device address `ptr`."""
        xp, dtype = self.xp, np.dtype(dtype)
        span = (sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * dtype.itemsize
        with xp.cuda.Device(self._id), external_stream(xp, stream, self._id):
            mem = xp.cuda.MemoryPointer(xp.cuda.UnownedMemory(ptr, span, None, self._id), 0)
            xp.ndarray(tuple(shape), dtype, mem,
                       tuple(st * dtype.itemsize for st in strides)).fill(0)

    def run_plan(self, plan: Plan, ptrs: dict, stream: int, alloc=None, counter=None,
                 seed: int | None = None) -> None:
        """Launch `plan` on `stream` with these buffer addresses (name -> int, 0 for an absent
        one). Its workspace comes from `alloc`, or else is the plan's own for this stream.
        `counter`: a zeroed uint32 (array or tensor) for a persistent launch to claim tiles from
        instead of the stream's (a launch captured in a CUDA graph takes one of its own).
        `seed`: dropout's seed word for this run (None: the one the plan was packed with)."""
        if self.xp.cuda.runtime.getDevice() != self._id:
            with self.xp.cuda.Device(self._id):
                return self.run_plan(plan, ptrs, stream, alloc, counter, seed)
        with plan.lock:  # (see Plan.lock: one run at a time, its workspace to its launches)
            keep = None
            if plan.workspace:
                ptrs = dict(ptrs)
                if alloc is not None:
                    keep = [alloc(shape) for shape in plan.workspace.values()]
                    for n, x in zip(plan.workspace, keep):
                        if n == configs.TICKETS:  # zero before the launch (queued on the stream)
                            x.zero_() if hasattr(x, "zero_") else x.fill(0)
                    ptrs.update(zip(plan.workspace, (address(x) for x in keep)))
                else:
                    owned = plan.owned.get(stream)
                    if owned is None:
                        # Zeroed once: the tickets must start at zero, and each launch leaves
                        # them so (the stream orders the launches that share them).
                        with external_stream(self.xp, stream, self._id):
                            owned = plan.owned[stream] = {
                                n: (self.xp.zeros if n == configs.TICKETS else self.xp.empty)(
                                    shape, dtype=np.float32)
                                for n, shape in plan.workspace.items()}
                    ptrs.update((n, address(a)) for n, a in owned.items())
            if plan.counted:
                ptrs = dict(ptrs, tile_counter=address(counter) if counter is not None
                            else self._tile_counter(stream))
            for launch in plan.launches:
                launch.run(ptrs, stream, seed)
        del keep  # the launches are queued: the allocator may reuse it in stream order

    def _make_plan(self, op: str, buffers: dict, params: np.void, layout: np.void,
                   ptrs: dict, extras: np.void) -> Plan:
        before = []  # launches that carry their own struct (the backward's lse pass)
        if op == "forward":
            append = int(extras["flags"]) & EXTRAS_APPEND
            if append:  # its launch first; with RoPE, the attention reads the rotated q
                first, workspace, layout, ptrs = self._plan_append(buffers, params, layout, ptrs,
                                                                   extras)
            if not int(params["batch"]) * int(params["heads"]) * int(params["seq_q"]):
                launches, more = [], {}  # (an append with no query row: the writes alone)
            elif configs.decode_wanted(params):
                launches, more = self._plan_decode(buffers, params, layout, ptrs, extras)
            else:
                launches = [self._plan(configs.FORWARD, buffers, params, layout, ptrs, extras)]
                more = {}
            if append:
                launches = first + [_rotated_q(launch, workspace) for launch in launches]
                workspace = workspace | more
            else:
                workspace = more
        else:
            rows = int(params["batch"]) * int(params["heads"]) * int(params["seq_q"])
            workspace = {"stats": (rows, 2)}
            bufs = dict(buffers, stats=Slot("stats"))
            if self._lse_pass_wanted(bufs, params, layout, ptrs, extras):
                before = [self._plan_lse_pass(bufs, params, layout, ptrs, extras)]
                workspace[configs.LSE_PASS] = (rows,)
                bufs["lse"] = Slot(configs.LSE_PASS)
            fused = self._plan_fused(bufs, params, layout, ptrs, extras)
            if fused is not None:
                launches, more = fused
                workspace.update(more)
            else:
                launches = [self._plan(configs.BACKWARD_DQ, bufs, params, layout, ptrs, extras)]
                if int(params["seq_k"]):
                    launches.append(self._plan(configs.BACKWARD_DKDV, bufs, params, layout, ptrs,
                                               extras))
            if buffers.get("grad_sinks") is not None:  # from the stats the dQ kernel wrote
                fn = self.loader.function(configs.SINKS_SOURCE, configs.SINKS_KERNEL, {}, ())
                launches.append((fn, int(params["heads"]), configs.SINKS_THREADS, 0,
                                 (Slot("stats"), Slot("sinks"), Slot("grad_sinks"),
                                  _slot_of(buffers, "cu_seqlens_q"))))
        return Plan(before + [PackedLaunch(fn, blocks, threads, smem, args + (params, extras))
                              for fn, blocks, threads, smem, args in launches], workspace)

    def _lse_pass_wanted(self, bufs: dict, params, layout, ptrs: dict, extras) -> bool:
        """Whether a backward not given the forward's lse runs the forward first for it: where,
        given one, its dQ kernel would be a wgmma one (which has no statistics pass), so that no
        call on sm_90a leaves the warpgroup kernels for want of an lse. (A call with no key or
        no query row runs none: dQ is zeros then, the mma.sync kernel's quick case.)"""
        rows = int(params["batch"]) * int(params["heads"]) * int(params["seq_q"])
        if bufs.get("lse") is not None or not int(params["seq_k"]) or not rows:
            return False
        given = dict(bufs, lse=Slot(configs.LSE_PASS))
        v = self.variant(configs.BACKWARD_DQ, **self._choice(configs.BACKWARD_DQ, given, params,
                                                             layout, ptrs, extras))
        return v.isa == configs.WGMMA

    def _plan_lse_pass(self, bufs: dict, params, layout, ptrs: dict, extras) -> PackedLaunch:
        """The forward of the backward's call without dropout (its own struct), writing each
        row's lse into the workspace's LSE_PASS and its O into grad_q, which the backward then
        writes over (an output: it shares no byte with any argument the forward reads). A
        varlen call's forward is the varlen one (the same extras, the call's cu_seqlens slots):
        its lse lands in the layout dQ reads, [heads, total_q], which the workspace's
        batch * heads * max_seqlen_q floats hold (total_q <= batch * max_seqlen_q)."""
        fwd_params = forward_params_of(params)
        fwd_layout = np.zeros((), layout.dtype)
        fwd_layout[()] = layout  # (a copy)
        for c in "bsh":
            fwd_layout[f"out_{c}"] = layout[f"grad_q_{c}"]
        fwd_layout = fwd_layout[()]
        fwd_bufs = dict(bufs, out=Slot("grad_q"), lse=Slot(configs.LSE_PASS), kv_lens=None)
        fn, blocks, threads, smem, args = self._plan(configs.FORWARD, fwd_bufs, fwd_params,
                                                     fwd_layout, dict(ptrs, out=ptrs["grad_q"]),
                                                     extras)
        return PackedLaunch(fn, blocks, threads, smem, args + (fwd_params, extras))

    def _plan_append(self, buffers: dict, params, layout, ptrs: dict, extras):
        """The KV-cache append's launch (append_kv.cu: none when it writes nothing and rotates
        nothing), its workspace (with RoPE: `q_rot`, the rotated q, C-contiguous, in float32
        words), and the layout and addresses the attention is then planned with (with RoPE, q's
        are q_rot's)."""
        b, sq, h, hkv, d = (int(params[n]) for n in ("batch", "seq_q", "heads", "kv_heads",
                                                      "head_dim"))
        dtype = np.dtype(buffers["q"].dtype)
        rotary = int(extras["flags"]) & EXTRAS_ROTARY
        items = b * int(extras["new_keys"]) * hkv * d + (b * sq * h * d if rotary else 0)
        workspace, own = {}, layout  # the append reads q through the call's own layout
        if rotary:
            workspace[configs.Q_ROTATED] = (-(-b * sq * h * d * dtype.itemsize // 4),)
            rotated = np.zeros((), layout.dtype)
            rotated[()] = layout  # (a copy)
            rotated["q_b"], rotated["q_s"], rotated["q_h"] = (sq * h * d if b > 1 else 0,
                                                              h * d if sq > 1 else 0,
                                                              d if h > 1 else 0)
            layout = rotated[()]
            ptrs = dict(ptrs, q=0)  # the workspace's allocation: aligned
        if not items:
            return [], workspace, layout, ptrs
        fn = self.loader.function(configs.APPEND_SOURCE, configs.APPEND_KERNEL,
                                  configs.append_defines(dtype))
        cos = buffers.get("rotary_cos")
        tables_f32 = np.uint32(cos is not None and np.dtype(cos.dtype) == FLOAT32)

        def opt(name):
            return NULL if buffers.get(name) is None else Slot(name)

        args = (opt("q"), opt("k"), opt("v"), opt("k_new"), opt("v_new"),
                Slot(configs.Q_ROTATED) if rotary else NULL, opt("kv_lens"), opt("block_table"),
                opt("rotary_cos"), opt("rotary_sin"), tables_f32, own)
        threads = configs.APPEND_THREADS
        blocks = max(1, min(-(-items // threads), self.sm_count * 8))
        return [(fn, blocks, threads, 0, args)], workspace, layout, ptrs

    def _tile_counter(self, stream: int) -> int:
        """The address of `stream`'s tile counter (0 once every counter has its stream)."""
        addr = self._counter_of.get(stream)
        if addr is None:
            with _COUNTER_LOCK:
                addr = self._counter_of.get(stream)
                n = len(self._counter_of)
                if addr is None and n < COUNTER_STREAMS:
                    addr = self._counter_of[stream] = address(self._counters) + 4 * n
        return addr or 0

    # --- planning ---------------------------------------------------------------------------------
    def variant(self, op: str, dtype, head_dim: int, copy_bytes: int = 16,
                rows: int = 0, many_blocks: bool = False, plain: bool = False,
                lse_given: bool = True, mods: bool = False, varlen: bool = False,
                paged: bool = False, unmasked: bool = False) -> configs.Variant:
        return configs.select(op, dtype, head_dim, self._smem_limit, self.table,
                              self.capability, copy_bytes, rows, many_blocks, plain, lse_given,
                              mods, varlen, paged, unmasked)

    def _plan(self, op: str, buffers: dict, params, layout, ptrs: dict, extras=None):
        """(kernel, blocks, threads, shared bytes, arguments) of one attention launch; each
        buffer is a `Slot` (its address filled in on each run), NULL where absent. `extras`:
        the call's AttnExtras (None: the seed's options alone)."""
        extras = seed_extras(params) if extras is None else extras
        choice = self._choice(op, buffers, params, layout, ptrs, extras)
        v, fn = self._kernel(op, **choice)
        vec = choice["copy_bytes"] // choice["dtype"].itemsize
        mask = buffers.get("mask")
        smem = v.shared_bytes
        blocks = v.blocks(params, self.sm_count)
        if v.tiles(params) > GRID_X_MAX:
            raise ValueError(f"{op}: {v.tiles(params)} tiles exceed the grid limit {GRID_X_MAX}")
        def arg(a):
            if a == configs.TILE_COUNTER:  # the stream's, or the call's own: filled in on each run
                return Slot(a)
            return _slot_of(buffers, a)

        args = tuple(arg(a) for a in v.args)
        mask_kind = np.uint32(_MASK_KIND[np.dtype(mask.dtype)] if mask is not None else 0)
        return fn, blocks, v.threads, smem, args + (np.uint32(vec), mask_kind, layout)

    def _choice(self, op: str, buffers: dict, params, layout, ptrs: dict, extras) -> dict:
        """What selects an attention launch's variant (`variant`'s arguments bar the op): dtype,
        head_dim, copy width, and whether the call is `plain`, passes the forward's lse, needs
        the model options built in, is varlen (packed sequences: the FERRO_VARLEN builds), is a
        forward over a paged KV cache (the FERRO_PAGED builds). A paged cache's k and v strides
        are a block's, a row's within the block and a head's (the layout's b, s, h), so the copy
        width covers the block stride too."""
        d = int(params["head_dim"])
        dtype = np.dtype(buffers["q"].dtype)
        names = [a for a in configs.ARGS[op] if a not in _NOT_ROWS]
        vec = _copy_width(dtype, d, [ptrs[a] for a in names], _strides(layout, names))
        lse_given = op != configs.BACKWARD_DQ or buffers.get("lse") is not None
        # the `plain` variants: no mask, no dropout, no model option the kernel computes; the
        # `mods` ones: a model option the kernel computes; the wgmma dQ: given the forward's lse
        mods = model_options(op, extras, lse_given)
        unmasked = buffers.get("mask") is None and float(params["dropout_prob"]) == 0.0
        return dict(dtype=dtype, head_dim=d, copy_bytes=vec * dtype.itemsize,
                    plain=unmasked and not mods, unmasked=unmasked,
                    lse_given=lse_given, mods=mods, varlen=packed(extras),
                    paged=op == configs.FORWARD and reads_pages(extras))

    def fused_variant(self, buffers: dict, params, layout, ptrs: dict,
                      extras=None) -> configs.Variant | None:
        """The fused backward's variant for this call (configs.select_fused), or None: the
        two-kernel backward runs."""
        extras = seed_extras(params) if extras is None else extras
        if not self.fused_backward or not int(params["seq_k"]) or not int(params["seq_q"]):
            return None
        d = int(params["head_dim"])
        dtype = np.dtype(buffers["q"].dtype)
        names = [a for a in configs.ARGS[configs.BACKWARD_FUSED] + configs.FUSED_POST_ARGS
                 + configs.FUSED_PRE_ARGS if a not in _NOT_ROWS and a in ptrs]
        vec = _copy_width(dtype, d, [ptrs[a] for a in names], _strides(layout, names))
        mods = model_options(configs.BACKWARD_FUSED, extras)
        unmasked = buffers.get("mask") is None and float(params["dropout_prob"]) == 0.0
        return configs.select_fused(dtype, d, self._smem_limit, self.table, self.capability,
                                    vec * dtype.itemsize, unmasked and not mods, mods,
                                    buffers.get("lse") is not None, packed(extras), unmasked)

    def _plan_fused(self, buffers: dict, params, layout, ptrs: dict, extras) -> tuple | None:
        """The fused backward's launches (pre-kernel, fused dK/dV/dQ kernel, post-kernel) and its
        workspace beyond the stats, or None where it does not serve the call."""
        v = self.fused_variant(buffers, params, layout, ptrs, extras)
        if v is None:
            return None
        ws = configs.fused_workspace(params, v)
        bufs = dict(buffers, **{n: Slot(n) for n in ws})
        main = self._plan(configs.BACKWARD_FUSED, bufs, params, layout, ptrs, extras)
        blocks = configs.fused_tiles(params, v)
        if blocks > GRID_X_MAX:
            raise ValueError(f"backward: {blocks} query tiles exceed the grid limit {GRID_X_MAX}")
        pre, post = (self.loader.function(v.source, k, v.defines, v.options)
                     for k in (configs.FUSED_PRE_KERNEL, configs.FUSED_POST_KERNEL))
        slots = (lambda names: tuple(_slot_of(bufs, a) for a in names))
        return [(pre, blocks, configs.FUSED_THREADS, 0, slots(configs.FUSED_PRE_ARGS) + (layout,)),
                main,
                (post, blocks, configs.FUSED_THREADS, 0,
                 slots(configs.FUSED_POST_ARGS) + (layout,))], ws

    def _plan_decode(self, buffers: dict, params, layout, ptrs: dict,
                     extras=None) -> tuple[list, dict]:
        """The decode kernel over (batch, KV head, split) blocks; with more than one split, the
        last block of each pair to finish merges the splits (counted in the workspace's
        `tickets`), except in the tiles design, which always leaves its result in the workspace
        for the combine kernel. Every launch is planned (compiled, checked) before any runs."""
        d = int(params["head_dim"])
        dtype = np.dtype(buffers["q"].dtype)
        vec = _copy_width(dtype, d, [ptrs["k"], ptrs["v"]], _strides(layout, ("k", "v")))
        group_rows = int(params["heads"]) // int(params["kv_heads"]) * int(params["seq_q"])
        pairs = int(params["batch"]) * int(params["kv_heads"])
        extras = seed_extras(params) if extras is None else extras
        mods = model_options(configs.DECODE, extras)
        v, fn = self._kernel(configs.DECODE, dtype, d, vec * dtype.itemsize, group_rows,
                             pairs > self.sm_count, mods=mods, varlen=packed(extras))
        splits, split_keys = configs.decode_splits(pairs, configs.key_reach(params, extras), v.step,
                                                   self._resident(fn, v) * self.sm_count)
        rows = int(params["batch"]) * int(params["heads"]) * int(params["seq_q"])
        if pairs * splits > GRID_X_MAX:
            raise ValueError(f"decode: {pairs * splits} blocks exceed the grid limit {GRID_X_MAX}")
        combine_launch = v.isa == configs.TILES
        combined = splits > 1 or combine_launch
        # The workspace: per split, each row's unnormalised O and (max, sum); none when the one
        # split writes out itself; with the split merged in the kernel, a ticket per pair (zero
        # before the launch: see run_plan), each a Slot filled in on each run.
        workspace = {"part_o": (splits, rows, v.head_dim), "part_ml": (splits, rows, 2)} \
            if combined else {}
        if combined and not combine_launch:
            workspace[configs.TICKETS] = (pairs,)
        part_o, part_ml, tickets = (Slot(n) if n in workspace else NULL
                                    for n in ("part_o", "part_ml", configs.TICKETS))
        mask = buffers.get("mask")
        mask_kind = np.uint32(_MASK_KIND[np.dtype(mask.dtype)] if mask is not None else 0)

        def opt(name):
            return NULL if buffers.get(name) is None else Slot(name)

        args = (opt("q"), opt("k"), opt("v"), part_o, part_ml, tickets, opt("out"),
                opt("lse"), opt("mask"), opt("kv_lens"), opt("block_table"), opt("alibi_slopes"),
                opt("sinks"), opt("cu_seqlens_q"), opt("cu_seqlens_k"),
                np.uint32(splits), np.uint32(split_keys), np.uint32(vec), mask_kind, layout)
        launches = [(fn, pairs * splits, v.threads, v.shared_bytes, args)]
        if combine_launch:
            combine = self._kernels.get(v)
            if combine is None:
                combine = self._kernels[v] = self.loader.function(v.source, v.combine_kernel,
                                                                  v.defines, v.options)
            launches.append((combine, rows, v.combine_threads, 0,
                             (part_o, part_ml, opt("out"), opt("lse"), opt("sinks"),
                              opt("cu_seqlens_q"), opt("cu_seqlens_k"), np.uint32(splits),
                              layout)))
        return launches, workspace

    def _resident(self, fn, v: configs.Variant) -> int:
        """Blocks of `fn` one SM holds at once: the driver's occupancy answer (registers, shared
        memory, threads), or the shared-memory and thread bounds where there is none."""
        driver = getattr(getattr(self.xp, "cuda", None), "driver", None)
        occupancy = getattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor", None)
        function = getattr(fn, "kernel", None)  # a cupy.RawKernel's CUfunction
        if occupancy is not None and hasattr(function, "ptr"):
            return max(1, occupancy(function.ptr, v.threads, v.shared_bytes))
        return max(1, min(self._smem_per_sm // (v.shared_bytes + 1024), 2048 // v.threads))

    def _kernel(self, op: str, dtype, head_dim: int, copy_bytes: int, rows: int = 0,
                many_blocks: bool = False, plain: bool = False, lse_given: bool = True,
                mods: bool = False, varlen: bool = False, paged: bool = False,
                unmasked: bool = False):
        """(variant, compiled kernel) for one (op, dtype, head_dim, copy width, decode rows,
        decode blocks beyond one per SM, no mask, dropout or model option, the forward's lse
        given, softcap, ALiBi or sinks computed, packed sequences, a paged KV cache, no mask or
        dropout), chosen, compiled and given its shared memory once."""
        key = (op, dtype, head_dim, copy_bytes, rows, many_blocks, plain, lse_given, mods, varlen,
               unmasked, paged)  # (paged last: tests read key[-1])
        hit = self._kernels.get(key)
        if hit is None:
            v = self.variant(op, dtype, head_dim, copy_bytes, rows, many_blocks, plain, lse_given,
                             mods, varlen, paged, unmasked)
            fn = self.loader.function(v.source, v.kernel, v.defines, v.options)
            if fn.max_dynamic_shared_size_bytes < v.shared_bytes:
                fn.max_dynamic_shared_size_bytes = v.shared_bytes
            hit = self._kernels[key] = (v, fn)
        return hit


def _slot_of(buffers: dict, name: str):
    """The argument for kernel parameter `name`: NULL where the call has no such buffer, the
    Slot `buffers` names where another buffer or workspace fills it (the backward's lse pass),
    else the buffer's own Slot."""
    given = buffers.get(name)
    return given if isinstance(given, Slot) else NULL if given is None else Slot(name)


def _rotated_q(launch: tuple, workspace: dict) -> tuple:
    """An attention launch reading the append's rotated q (the workspace's) where the plan
    has one."""
    if configs.Q_ROTATED not in workspace:
        return launch
    fn, blocks, threads, smem, args = launch
    args = tuple(Slot(configs.Q_ROTATED) if isinstance(a, Slot) and a.name == "q" else a
                 for a in args)
    return fn, blocks, threads, smem, args


def model_options(op: str, extras: np.void, lse_given: bool = True) -> bool:
    """Whether a kernel of `op` computes a model option of the call (softcap, ALiBi, or sinks
    where the kernel forms a row's denominator: the forwards, and dQ without the forward's lse),
    so that it needs a variant built with them (configs.py's `mods`, never `plain`)."""
    flags = int(extras["flags"])
    sinks = bool(flags & EXTRAS_SINKS) and (op in (configs.FORWARD, configs.DECODE)
                                             or (op == configs.BACKWARD_DQ and not lse_given))
    return float(extras["softcap"]) > 0.0 or bool(flags & EXTRAS_ALIBI) or sinks


def packed(extras: np.void) -> bool:
    """Whether the call is varlen (packed sequences): its kernels are the varlen builds."""
    return bool(int(extras["flags"]) & EXTRAS_VARLEN)


def reads_pages(extras: np.void) -> bool:
    """Whether the call reads a paged KV cache: its forward kernel is a paged build."""
    return bool(int(extras["flags"]) & EXTRAS_PAGED)


def _copy_width(dtype: np.dtype, d: int, ptrs, strides=()) -> int:
    """Elements per global load of a tile row: 16 bytes when head_dim and every row allow it
    (each address in `ptrs` and every row stride in `strides`, in elements, a multiple of it),
    else 4 bytes, else one element (a half-precision head_dim that is odd)."""
    size = dtype.itemsize
    for width in (16 // size, 4 // size):
        if width and d % width == 0 and all(p % (width * size) == 0 for p in ptrs) \
                and all(st % width == 0 for st in strides):
            return width
    return 1


def _strides(layout: np.void, names) -> list:
    """The row strides (batch, seq, head) of the named buffers that `layout` describes."""
    return [int(layout[f"{n}_{c}"]) for n in names if n in LAYOUT_TENSORS for c in "bsh"]


def alignment(ptrs: dict) -> int:
    """The low 4 bits shared by the data rows' addresses (which copy widths they allow)."""
    low = 0
    for name, ptr in ptrs.items():
        if name not in _NOT_ROWS:
            low |= ptr
    return low & 15
