"""The CUDA backend's planning without a GPU: a CudaBackend is built around a fake device (an
H200's limits) and a loader that records what it would compile, so the launch plans (variant,
grid, shared memory, arguments, the decode split) and the per-(op, dtype, head_dim, copy width)
kernel cache are tested on any machine. The GPU suite runs the same plans for real."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.cuda.launch import NULL, address
from ferrocupy.dtypes import BFLOAT16, FLOAT32
from ferrocupy.params import contiguous_layout


class FakeLoader:
    def __init__(self):
        self.compiled = []

    def function(self, source, name, defines=None, options=()):
        self.compiled.append((source, name, tuple(sorted((defines or {}).items())), options))
        return SimpleNamespace(name=name, max_dynamic_shared_size_bytes=0)


def backend(capability=90):
    b = object.__new__(CudaBackend)
    b.xp, b._id, b.device, b.loader = np, 0, "cuda:0", FakeLoader()
    b._table, b._kernels = configs.TABLE, {}
    b._smem_limit, b._smem_per_sm, b.sm_count, b.capability = 232448, 233472, 132, capability
    b._counters, b._counter_of = np.zeros(64, np.uint32), {}
    fake_runtime(b)
    return b


def buf(shape, dtype, offset=0):
    """An array-like with the attributes the planner reads (dtype, data.ptr)."""
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype),
                           data=SimpleNamespace(ptr=0x10000 + offset))


def forward_buffers(shape_q, shape_k, dtype, offset=0):
    return dict(q=buf(shape_q, dtype, offset), k=buf(shape_k, dtype), v=buf(shape_k, dtype),
                out=buf(shape_q, dtype), mask=None, lse=None, kv_lens=None)


def ptrs(bufs):
    return {n: 0 if x is None else x.data.ptr for n, x in bufs.items()}


def plan_launch(b, op, bufs, p):
    """One attention launch of `op` on C-contiguous buffers."""
    return b._plan(op, bufs, p, contiguous_layout(p), ptrs(bufs))


def plan_decode(b, bufs, p):
    return b._plan_decode(bufs, p, contiguous_layout(p), ptrs(bufs))


def make_plan(b, op, bufs, p):
    """The backend's plan of "forward" or "backward" on C-contiguous buffers."""
    return b.plan(op, bufs, p, contiguous_layout(p), ptrs(bufs))


def params(shape_q, shape_k, **opts):
    return AttentionDims.new(np.zeros(shape_q), np.zeros(shape_k)).params(AttentionOptions(**opts))


def test_forward_plan_on_hopper_is_the_wgmma_kernel_and_is_chosen_once():
    b = backend()
    q, k = (4, 4096, 16, 128), (4, 4096, 16, 128)
    p = params(q, k, causal=True)
    fn, blocks, threads, smem, args = plan_launch(b, configs.FORWARD, forward_buffers(q, k, BFLOAT16), p)
    v = configs.select(configs.FORWARD, BFLOAT16, 128, 232448, capability=90, copy_bytes=16,
                       plain=True)  # (the call has no mask, dropout or model option)
    assert v.isa == configs.WGMMA and v.plain and fn.name == "flash_fwd_wgmma"
    assert v.tiles(p) == -(-4096 // v.block_rows) * 4 * 16
    assert v.persistent and blocks == 132  # one block per SM, each claiming tiles
    assert args[v.args.index("tile_counter")].name == "tile_counter"  # the stream's, on each run
    small = params((1, 128, 2, 128), (1, 128, 2, 128))
    assert plan_launch(b, configs.FORWARD, forward_buffers((1, 128, 2, 128), (1, 128, 2, 128), BFLOAT16),
                   small)[1] == 2  # never more blocks than tiles
    assert threads == v.threads == 32 * v.warps + 128  # and a loading warpgroup
    assert smem == v.shared_bytes == fn.max_dynamic_shared_size_bytes
    assert len(args) == len(v.args) + 3 and args[-3] == 8  # 16-byte copies (then mask kind, layout)
    plan_launch(b, configs.FORWARD, forward_buffers(q, k, BFLOAT16), p)
    assert len(b.loader.compiled) == 1  # the second call reused the chosen kernel
    assert b.loader.compiled[0][3] == ("-arch=sm_90a",)
    assert ("FERRO_PLAIN", 1) in b.loader.compiled[0][2]  # no mask, no dropout: the plain build
    for opts in (dict(causal=True, dropout_prob=0.1), dict(causal=True)):
        bufs = forward_buffers(q, k, BFLOAT16)
        if "dropout_prob" not in opts:
            bufs["mask"] = buf((1, 1, 1, 4096), FLOAT32)
        plan_launch(b, configs.FORWARD, bufs, params(q, k, **opts))
        assert b.loader.compiled[-1][1] == "flash_fwd_wgmma"
        assert "FERRO_PLAIN" not in dict(b.loader.compiled[-1][2])  # the general build


def test_unaligned_rows_or_another_gpu_take_the_mma_kernel():
    q, k = (2, 256, 8, 128), (2, 256, 8, 128)
    p = params(q, k)
    b = backend()
    fn, *_ , args = plan_launch(b, configs.FORWARD, forward_buffers(q, k, BFLOAT16, offset=2), p)
    assert fn.name == "flash_fwd_half" and args[-3] == 1  # element-wise copies
    fn, *_ = plan_launch(backend(capability=80), configs.FORWARD, forward_buffers(q, k, BFLOAT16), p)
    assert fn.name == "flash_fwd_half"


# The first decode kernel at head_dim 128 (16-byte rows, sm_90): the tensor-core one in half
# precision, the streams one in float32.
DECODE_KERNEL = {FLOAT32: "flash_decode_streams", BFLOAT16: "flash_decode_mma"}


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_decode_plan_splits_the_keys_and_merges_them_in_the_kernel(dtype):
    """Few pairs, long keys: several splits a pair; the pair's last block merges them, counted
    in zeroed tickets (one per pair) in the workspace: no combine launch."""
    b = backend()
    q, k = (2, 1, 32, 128), (2, 32768, 8, 128)
    p = params(q, k, causal=True, causal_offset=32767)
    assert configs.decode_wanted(p)
    ((fn, blocks, threads, smem, args),), work = plan_decode(b, forward_buffers(q, k, dtype), p)
    names = configs.ARGS[configs.DECODE]
    at = {n: args[names.index(n)] for n in ("part_o", "part_ml", configs.TICKETS)}
    assert all(a.name == n for n, a in at.items())  # each filled in on every run
    assert fn.name == DECODE_KERNEL[dtype]
    splits, split_keys = int(args[names.index("splits")]), int(args[names.index("split_keys")])
    assert blocks == 2 * 8 * splits and splits > 1 and splits * split_keys >= 32768
    assert work["part_o"] == (splits, 2 * 32, 128) and work["part_ml"] == (splits, 2 * 32, 2)
    assert work[configs.TICKETS] == (2 * 8,)
    assert smem == fn.max_dynamic_shared_size_bytes <= 232448
    plan_decode(b, forward_buffers(q, k, dtype), p)
    assert len(b.loader.compiled) == 1  # chosen once


def test_decode_tiles_design_combines_in_a_second_kernel():
    """The tiles design leaves every split in the workspace (no tickets): the combine merges."""
    b = backend()
    b.table = configs.only(configs.TILES)
    q, k = (2, 1, 32, 128), (2, 32768, 8, 128)
    p = params(q, k, causal=True, causal_offset=32767)
    ((fn, blocks, _, _, args), (comb, cblocks, cthreads, csmem, cargs)), work = \
        plan_decode(b, forward_buffers(q, k, BFLOAT16), p)
    assert fn.name == "flash_decode" and comb.name == "flash_decode_combine"
    assert set(work) == {"part_o", "part_ml"}
    assert args[configs.ARGS[configs.DECODE].index(configs.TICKETS)] is NULL  # none
    assert cblocks == 2 * 32 and cthreads == configs.COMBINE_THREADS and csmem == 0


def test_decode_with_one_split_writes_out_itself():
    """Enough (batch, KV head) pairs to fill the GPU: one split, no workspace, no combine."""
    b = backend()
    q, k = (64, 1, 32, 128), (64, 2048, 8, 128)
    launches, _ = plan_decode(b, forward_buffers(q, k, BFLOAT16), params(q, k))
    assert len(launches) == 1
    fn, blocks, _, _, args = launches[0]
    assert fn.name == DECODE_KERNEL[BFLOAT16] and blocks == 64 * 8
    assert args[3] is NULL and args[4] is NULL


@pytest.mark.parametrize("seq_q", [1, 4])
@pytest.mark.parametrize("batch, warps", [(1, 8), (16, 8), (64, 4)])
def test_decode_warps_follow_the_number_of_pairs(batch, warps, seq_q):
    """Up to one (batch, KV head) pair per SM, the 8-warp tensor block; beyond, 4 warps (two
    blocks an SM)."""
    b = backend()
    q, k = (batch, seq_q, 32, 128), (batch, 2048, 8, 128)
    launches, _ = plan_decode(b, forward_buffers(q, k, BFLOAT16), params(q, k))
    assert launches[0][0].name == "flash_decode_mma" and launches[0][2] == 32 * warps


@pytest.mark.parametrize("dtype, heads, seq_q, offset, capability, design", [
    (BFLOAT16, 32, 1, 0, 90, configs.TENSOR),  # 4 rows a group
    (BFLOAT16, 32, 3, 0, 90, configs.TENSOR),  # 12: the tensor kernel takes up to 16
    (BFLOAT16, 32, 4, 0, 80, configs.TENSOR),  # 16
    (BFLOAT16, 32, 1, 0, 75, configs.STREAMS),  # no mma.sync bf16 before sm_80
    (BFLOAT16, 32, 1, 2, 90, configs.TILES),  # K rows that take no 16-byte copies
    (BFLOAT16, 32, 3, 0, 75, configs.TILES),  # no mma.sync bf16 before sm_80
    (FLOAT32, 32, 1, 0, 90, configs.STREAMS),  # 4 rows a group
    (FLOAT32, 32, 2, 0, 90, configs.STREAMS),  # 8
    (FLOAT32, 32, 3, 0, 90, configs.TILES),  # 12: more than the streams kernel holds
    (FLOAT32, 32, 1, 1, 90, configs.TILES),  # K rows that take no 16-byte copies
])
def test_decode_design_follows_dtype_rows_and_copy_width(dtype, heads, seq_q, offset, capability,
                                                         design):
    b = backend(capability)
    q, k = (2, seq_q, heads, 128), (2, 4096, 8, 128)
    bufs = dict(forward_buffers(q, k, dtype), k=buf(k, dtype, offset * dtype.itemsize))
    launches, _ = plan_decode(b, bufs, params(q, k))
    copy_bytes = 16 if not offset else 4 if dtype == FLOAT32 else 2
    v = configs.select(configs.DECODE, dtype, 128, 232448, capability=capability,
                       copy_bytes=copy_bytes, rows=heads // 8 * seq_q)
    assert v.isa == design and launches[0][0].name == v.kernel
    assert len(launches) == 2 or design != configs.TILES


def test_swapping_the_table_forgets_the_chosen_kernels():
    b = backend()
    q, k = (1, 128, 4, 64), (1, 128, 4, 64)
    plan_launch(b, configs.FORWARD, forward_buffers(q, k, BFLOAT16), params(q, k))
    b.table = configs.only(configs.MMA)
    fn, *_ = plan_launch(b, configs.FORWARD, forward_buffers(q, k, BFLOAT16), params(q, k))
    assert fn.name == "flash_fwd_half"


def fake_runtime(b, stream=7):
    """The fake backend with a CuPy-like runtime (device 0, one current stream)."""
    b.generation = 0
    b.xp = SimpleNamespace(empty=np.empty, zeros=np.zeros, cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: 0),
        get_current_stream=lambda: SimpleNamespace(ptr=stream),
        ExternalStream=lambda ptr, device: contextlib.nullcontext()))


def recorded(monkeypatch, *fields):
    """Launches record (kernel name, and `fields` of each: "ptrs", "stream", "args") instead of
    running."""
    from ferrocupy.cuda import launch

    runs = []
    get = {"ptrs": lambda self, ptrs, stream: dict(ptrs), "stream": lambda self, ptrs, s: s,
           "args": lambda self, ptrs, stream: self.args}
    monkeypatch.setattr(launch.PackedLaunch, "run", lambda self, ptrs, stream, seed=None: runs.append(
        (self.fn.name, *(get[f](self, ptrs, stream) for f in fields))))
    return runs


def test_a_plans_workspace_is_its_own_per_stream_or_the_callers(monkeypatch):
    runs = recorded(monkeypatch, "ptrs", "stream")
    b = backend()
    q, k = (2, 1, 32, 128), (2, 32768, 8, 128)
    p = params(q, k, causal=True, causal_offset=32767)
    bufs = forward_buffers(q, k, BFLOAT16)
    plan = make_plan(b, "forward", bufs, p)
    b.run_plan(plan, ptrs(bufs), 7)
    first = runs[:]
    assert [r[0] for r in first] == [DECODE_KERNEL[BFLOAT16]]  # splits merged in the kernel
    assert set(plan.launches[0].slot_names) == {"q", "k", "v", "out", "part_o", "part_ml",
                                                "tickets"}  # absent: NULL
    assert not first[0][1]["tickets"] % 4 and runs[0][1]["tickets"] != runs[0][1]["part_o"]
    b.run_plan(plan, ptrs(dict(bufs, out=buf(q, BFLOAT16, offset=4096))), 7)  # another output
    assert runs[1][1]["out"] == 0x10000 + 4096
    assert runs[1][1]["part_o"] == runs[0][1]["part_o"]  # the workspace, reused on its stream
    assert set(plan.workspace) == {"part_o", "part_ml", "tickets"} and set(plan.owned) == {7}
    assert not plan.owned[7]["tickets"].any()  # zeroed where made (each launch leaves it so)
    b.run_plan(plan, ptrs(bufs), 8)
    assert set(plan.owned) == {7, 8}  # another stream, its own workspace
    assert runs[-1][2] == 8 and runs[-1][1]["part_o"] != runs[0][1]["part_o"]
    made = []
    b.run_plan(plan, ptrs(bufs), 9, alloc=lambda shape: made.append(
        np.full(shape, 7, np.float32)) or made[-1])
    assert [m.shape for m in made] == [plan.workspace[n] for n in ("part_o", "part_ml", "tickets")]
    assert not made[2].any() and made[0].all()  # the caller's tickets zeroed, the rest left
    assert runs[-1][1]["part_o"] == made[0].ctypes.data and set(plan.owned) == {7, 8}


def test_persistent_forward_takes_its_streams_tile_counter(monkeypatch):
    """Each stream has its own tile counter (calls on one stream are ordered, so they share it);
    past the backend's COUNTER_STREAMS streams a launch gets none (NULL: blocks take tiles in a
    fixed turn). Plans without a persistent launch take none."""
    from ferrocupy.cuda import backend as backend_mod

    runs = recorded(monkeypatch, "ptrs", "stream")
    b = backend()
    q, k = (4, 1024, 16, 64), (4, 1024, 16, 64)
    bufs, p = forward_buffers(q, k, BFLOAT16), params(q, k, causal=True)
    plan = make_plan(b, "forward", bufs, p)
    assert plan.counted
    base = address(b._counters)
    for stream in (7, 8, 7):
        b.run_plan(plan, ptrs(bufs), stream)
    assert [r[1]["tile_counter"] for r in runs] == [base, base + 4, base]
    for stream in range(100, 100 + backend_mod.COUNTER_STREAMS - 1):  # 2 taken: 63 more calls
        b.run_plan(plan, ptrs(bufs), stream)
    assert runs[-2][1]["tile_counter"] == base + 4 * (backend_mod.COUNTER_STREAMS - 1)
    assert runs[-1][1]["tile_counter"] == 0  # the 65th stream: none left
    assert len(b._counter_of) == backend_mod.COUNTER_STREAMS  # (and nothing kept for it)
    own = np.zeros(1, np.uint32)  # a counter of the call's own (a launch captured in a graph)
    b.run_plan(plan, {n: 0x10000 for n in ("q", "k", "v", "out")}, 7, counter=own)
    assert runs[-1][1]["tile_counter"] == address(own)
    runs.clear()
    bufs32 = forward_buffers(q, k, FLOAT32)
    plan32 = make_plan(b, "forward", bufs32, params(q, k))  # float32: not persistent
    b.run_plan(plan32, ptrs(bufs32), 7)
    assert not plan32.counted
    assert [r[0] for r in runs] == ["flash_attn_v2"] and "tile_counter" not in runs[0][1]


def test_backward_plan_owns_its_stats(monkeypatch):
    from ferrocupy.cuda import launch

    runs = recorded(monkeypatch, "args", "ptrs")
    b = backend()
    b.fused_backward = False  # the two-kernel backward (the fused one: test_fused_backward_plan)
    q, k = (1, 256, 8, 64), (1, 256, 4, 64)
    bufs = dict(forward_buffers(q, k, BFLOAT16), grad_out=buf(q, BFLOAT16),
                grad_q=buf(q, BFLOAT16), grad_k=buf(k, BFLOAT16), grad_v=buf(k, BFLOAT16))
    bufs.pop("kv_lens")
    p = AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(AttentionOptions(causal=True))

    def backward(bufs, p):
        plan = make_plan(b, "backward", bufs, p)
        b.run_plan(plan, ptrs(bufs), 7)
        return plan

    plan = backward(bufs, p)
    b.run_plan(plan, ptrs(bufs), 7)
    names = [r[0] for r in runs]
    # (a plain call on the fake sm_90 with 16-byte rows, not given the forward's lse: the
    # forward first, its lse into the workspace, then dQ and dK/dV on the warpgroup tensor cores)
    assert names == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"] * 2
    assert "stats" in [a.name for a in runs[1][1] if isinstance(a, launch.Slot)]
    assert plan.workspace == {"stats": (8 * 256, 2), configs.LSE_PASS: (8 * 256,)}
    assert runs[1][2]["stats"] == runs[5][2]["stats"]  # the same stats buffer on the second call
    runs.clear()  # dropout: the wgmma variants built with it (the forward first without it)
    dropout = AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(
        AttentionOptions(causal=True, dropout_prob=0.1))
    backward(bufs, dropout)
    assert [r[0] for r in runs] == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                    "flash_bwd_dkdv_wgmma"]
    assert "FERRO_PLAIN" not in b._kernels[next(k for k in b._kernels if k[0] == "backward_dkdv"
                                                and not k[6])][0].defines
    runs.clear()  # given the forward's lse, dQ on the warpgroup tensor cores too
    backward(dict(bufs, lse=buf((1, 8, 256), FLOAT32)), p)
    assert [r[0] for r in runs] == ["flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"]
    runs.clear()  # and with dropout
    backward(dict(bufs, lse=buf((1, 8, 256), FLOAT32)), dropout)
    assert [r[0] for r in runs] == ["flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"]


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel", "fused"])
def test_a_run_writes_its_dropout_seed_into_every_launch(monkeypatch, fused):
    """What the driver receives: each launch's packed struct, read back through the kernel
    argument array, carries the seed of the run that launched it (a plan is shared by calls
    that differ in their seed alone), and the plan's own where a run names none."""
    import ctypes

    from ferrocupy.cuda import launch

    seen = []  # per launch with a params struct: its seed word, as the kernel would read it

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        packed = plan.launches[fn - 1]
        addrs = (ctypes.c_uint64 * len(packed.args)).from_address(args)
        at = next((i for i, a in enumerate(packed.args)  # the params struct
                   if isinstance(a, np.void) and "seed" in a.dtype.fields), None)
        if at is None:
            return
        word = packed.args[at].dtype.fields["seed"][1]
        seen.append(ctypes.c_uint32.from_address(addrs[at] + word).value)

    monkeypatch.setattr(launch, "driver", SimpleNamespace(launchKernel=launch_kernel))
    b = backend()
    b.fused_backward = fused
    q, k = (1, 256, 8, 64), (1, 256, 4, 64)
    bufs = dict(forward_buffers(q, k, BFLOAT16), grad_out=buf(q, BFLOAT16),
                grad_q=buf(q, BFLOAT16), grad_k=buf(k, BFLOAT16), grad_v=buf(k, BFLOAT16),
                lse=buf((1, 8, 256), FLOAT32))  # (given: dQ and dK/dV, no forward first)
    bufs.pop("kv_lens")
    p = AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(
        AttentionOptions(causal=True, dropout_prob=0.1, seed=11))
    plan = make_plan(b, "backward", bufs, p)
    assert len(plan.launches) == (3 if fused else 2)
    for i, x in enumerate(plan.launches):
        x._function = i + 1  # (a compiled kernel's handle: the fake loader compiles nothing)
    for seed in (None, 5, 2**32 - 1, None):
        b.run_plan(plan, ptrs(bufs), 7, seed=seed)
    per_run = len(plan.launches)  # every launch reads it (the fused pre- and post-kernels too)
    assert seen == [s for s in (11, 5, 2**32 - 1, 2**32 - 1) for _ in range(per_run)]


def test_threads_running_one_plan_launch_with_their_own_tensors(monkeypatch):
    """Two threads running the same backward plan (one call shape) at once on one stream: each
    launch gets the addresses of its own run, never the other thread's (a run writes them into
    the launch's one argument array, then launches), and a run's two kernels are queued
    together (they share the stream's statistics workspace: dK/dV must read what its own dQ
    wrote)."""
    import ctypes
    import sys
    import threading

    from ferrocupy.cuda import launch

    b = backend()
    b.fused_backward = False  # (a run of the two kernels)
    q, k = (1, 256, 8, 64), (1, 256, 4, 64)
    bufs = dict(forward_buffers(q, k, BFLOAT16), grad_out=buf(q, BFLOAT16),
                grad_q=buf(q, BFLOAT16), grad_k=buf(k, BFLOAT16), grad_v=buf(k, BFLOAT16),
                lse=buf((1, 8, 256), FLOAT32))  # (given: dQ and dK/dV, no forward first)
    bufs.pop("kv_lens")
    plan = make_plan(b, "backward", bufs, AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(
        AttentionOptions(causal=True)))
    assert len(plan.launches) == 2 and "stats" in plan.workspace
    for i, x in enumerate(plan.launches):
        x._function = i  # (a compiled kernel's handle: the fake loader compiles nothing)
    at = [next(i for i, a in enumerate(x.args) if isinstance(a, launch.Slot) and a.name == "q")
          for x in plan.launches]
    queued = []  # (the q each launch got, which kernel)

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        addrs = (ctypes.c_uint64 * len(plan.launches[fn].args)).from_address(args)
        queued.append((ctypes.c_uint64.from_address(addrs[at[fn]]).value, fn,
                       int(threading.current_thread().name)))

    monkeypatch.setattr(launch, "driver", SimpleNamespace(launchKernel=launch_kernel))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        def run(tag):
            for _ in range(5000):
                b.run_plan(plan, dict(ptrs(bufs), q=tag), 7)

        threads = [threading.Thread(target=run, args=(tag,), name=str(tag))
                   for tag in (1 << 20, 2 << 20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    # each launch with its own thread's q, and each run's dQ followed by its own dK/dV
    wrong = sum((q, fn) != (tag, i % 2) or tag != queued[i - i % 2][2]
                for i, (q, fn, tag) in enumerate(queued))
    assert len(queued) == 20000 and not wrong, f"{wrong} of 20000 launches out of their run"


# --- softcap, ALiBi and sinks: the variants built with them (`mods`), the sinks' launch ----------
def _extras(opts, **named):
    from ferrocupy.params import extras_params

    return extras_params(AttentionOptions(**opts), named.get("alibi"), named.get("sinks"))


def _defines(b) -> list:
    return [dict(c[2]) for c in b.loader.compiled]


@pytest.mark.parametrize("capability, kernel", [(90, "flash_fwd_wgmma"), (80, "flash_fwd_half")])
def test_model_options_take_the_variants_built_with_them(capability, kernel):
    """A call with softcap, ALiBi or sinks runs a variant built with them (FERRO_MODS: on sm_90a
    the general wgmma one), one without them a variant built without (its registers as before);
    the slopes and sinks are kernel arguments and the AttnExtras struct comes last."""
    q, k = (2, 256, 8, 128), (2, 256, 8, 128)
    p = params(q, k, causal=True)
    for named, opts in ((dict(alibi=buf((8,), FLOAT32)), {}), (dict(sinks=buf((8,), FLOAT32)), {}),
                        ({}, dict(softcap=30.0))):
        b = backend(capability)
        bufs = forward_buffers(q, k, BFLOAT16) | dict(alibi_slopes=named.get("alibi"),
                                                      sinks=named.get("sinks"))
        extras = _extras(dict(causal=True, **opts), **named)
        plan = b.plan("forward", bufs, p, contiguous_layout(p), ptrs(bufs), extras)
        (launch,) = plan.launches
        assert launch.fn.name == kernel and launch.args[-1] is extras and launch.args[-2] is p
        v = configs.select(configs.FORWARD, BFLOAT16, 128, 232448, capability=capability,
                           copy_bytes=16, mods=True)
        assert v.mods and not v.plain and _defines(b)[-1].get("FERRO_MODS") == 1
        for n in ("alibi_slopes", "sinks"):
            slot = launch.args[v.args.index(n)]
            assert (slot is NULL) == (bufs[n] is None)
    b = backend(capability)
    make_plan(b, "forward", forward_buffers(q, k, BFLOAT16), p)
    assert "FERRO_MODS" not in _defines(b)[-1]


def test_grad_sinks_adds_the_sinks_launch_after_the_backward():
    """With grad_sinks the backward ends with flash_bwd_sinks, a block per head, reading the dQ
    kernel's stats; sinks alone with the forward's lse leave dQ and dK/dV plain (on sm_90a the
    plain wgmma kernels: the lse holds the sinks)."""
    q, k = (2, 256, 8, 64), (2, 256, 8, 64)
    p = AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(AttentionOptions())
    sinks = buf((8,), FLOAT32)
    bufs = dict(forward_buffers(q, k, BFLOAT16), grad_out=buf(q, BFLOAT16),
                grad_q=buf(q, BFLOAT16), grad_k=buf(k, BFLOAT16), grad_v=buf(k, BFLOAT16),
                lse=buf((2, 8, 256), FLOAT32), alibi_slopes=None, sinks=sinks,
                grad_sinks=buf((8,), FLOAT32))
    b = backend()
    b.fused_backward = False  # the two-kernel backward (the fused one: test_fused_backward_plan)
    extras = _extras({}, sinks=sinks)
    plan = b.plan("backward", bufs, p, contiguous_layout(p), ptrs(bufs), extras)
    dq, dkdv, tail = plan.launches
    assert (dq.fn.name, dkdv.fn.name) == ("flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma")
    assert all(("FERRO_PLAIN", 1) in c[2] for c in b.loader.compiled[:2])
    assert tail.fn.name == configs.SINKS_KERNEL and tail.blocks == 8
    assert tail.threads == configs.SINKS_THREADS
    assert [a.name for a in tail.args[:3]] == ["stats", "sinks", "grad_sinks"]
    assert tail.args[3] is NULL  # cu_seqlens_q: a dense call's stats are [batch, heads, seq_q]
    assert tail.args[4] is p and tail.args[5] is extras
    # without the forward's lse, on sm_80 dQ forms the rows' denominators itself: the sinks'
    # variant; on sm_90a the forward (the sinks' variant) runs first for the lse
    b = backend(capability=80)
    plan = b.plan("backward", bufs | dict(lse=None), p, contiguous_layout(p), ptrs(bufs), extras)
    assert plan.launches[0].fn.name == "flash_bwd_dq_half"
    assert _defines(b)[0].get("FERRO_MODS") == 1
    assert len(plan.launches) == 3
    b = backend()
    b.fused_backward = False
    plan = b.plan("backward", bufs | dict(lse=None), p, contiguous_layout(p), ptrs(bufs), extras)
    assert [x.fn.name for x in plan.launches] == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                                  "flash_bwd_dkdv_wgmma", configs.SINKS_KERNEL]
    assert [d.get("FERRO_MODS") for d in _defines(b)[:3]] == [1, None, None]


def test_decode_with_alibi_takes_the_decode_variant_built_with_it():
    b = backend()
    q, k = (2, 1, 32, 128), (2, 4096, 8, 128)
    p = params(q, k, causal=True, causal_offset=4095)
    alibi = buf((2, 32), FLOAT32)
    bufs = forward_buffers(q, k, BFLOAT16) | dict(alibi_slopes=alibi, sinks=None)
    (fn, _, _, _, args), *_ = b._plan_decode(bufs, p, contiguous_layout(p), ptrs(bufs),
                                             _extras(dict(causal=True), alibi=alibi))[0]
    assert fn.name == "flash_decode_mma" and _defines(b)[0].get("FERRO_MODS") == 1
    names = configs.ARGS[configs.DECODE]
    assert args[names.index("alibi_slopes")].name == "alibi_slopes"
    assert args[names.index("sinks")] is NULL
