"""The tuning seams lab/ scripts use, without a GPU: `ferrocupy.cuda.tuning` (a forced variant,
a forced decode split count, a plan's launches one at a time) on the fake backend of
test_backend_plan.py, and the kernel loader's overlay directory on small source trees."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs, launch, tuning
from ferrocupy.cuda.loader import OVERLAY_ENV, KernelLoader
from ferrocupy.dtypes import BFLOAT16, FLOAT32
from test_backend_plan import DECODE_KERNEL, backend, buf, forward_buffers, params

DECODE_Q, DECODE_K = (2, 1, 32, 128), (2, 32768, 8, 128)


@pytest.fixture
def runs(monkeypatch):
    """Each PackedLaunch run, recorded instead of launched: (kernel, pointers, stream)."""
    out = []
    monkeypatch.setattr(launch.PackedLaunch, "run", lambda self, ptrs, stream: out.append(
        (self.fn.name, dict(ptrs), stream)))
    return out


def decode_call(dtype=BFLOAT16):
    bufs = forward_buffers(DECODE_Q, DECODE_K, dtype)
    return {n: bufs[n] for n in ("q", "k", "v", "out")}, params(DECODE_Q, DECODE_K)


def test_decode_launch_runs_alone_with_its_own_workspace(runs):
    b = backend()
    bufs, p = decode_call()
    (only,) = tuning.launches(b, "forward", bufs, p, stream=5)
    assert only.kernel == DECODE_KERNEL[BFLOAT16] and only.blocks == 2 * 8 * int(only.arg("splits"))
    assert int(only.arg("splits")) > 1
    only()
    only()
    (name, ptrs, stream), again = runs[0], runs[1][1]
    assert name == DECODE_KERNEL[BFLOAT16] and stream == 5 and ptrs == again
    assert ptrs["q"] == bufs["q"].data.ptr and ptrs["mask"] == ptrs["lse"] == 0
    workspace = {ptrs[n] for n in ("part_o", "part_ml", configs.TICKETS)}
    assert len(workspace) == 3 and 0 not in workspace
    tickets = (ctypes.c_float * (2 * 8)).from_address(ptrs[configs.TICKETS])  # one per pair
    assert not any(tickets)  # zero before the first launch (each leaves them so)


def test_decode_splits_forces_the_count_and_restores_the_choice():
    chosen = configs.decode_splits
    bufs, p = decode_call()
    default = int(tuning.launches(backend(), "forward", bufs, p)[0].arg("splits"))
    for n in (1, 3, default + 5):
        with tuning.decode_splits(n):
            assert configs.decode_splits is not chosen
            (only,) = tuning.launches(backend(), "forward", bufs, p)
        got, keys = int(only.arg("splits")), int(only.arg("split_keys"))
        assert got == n and (got - 1) * keys < DECODE_K[1] <= got * keys
        assert configs.decode_splits is chosen
    with pytest.raises(RuntimeError), tuning.decode_splits(2):
        raise RuntimeError("inside")
    assert configs.decode_splits is chosen
    with pytest.raises(ValueError, match="n must be >= 1"), tuning.decode_splits(0):
        pass


def test_backward_launches_share_their_statistics(runs):
    b = backend()
    b.fused_backward = False  # the two kernels (a sweep of their geometries switches it off too)
    q, k = (1, 256, 8, 64), (1, 256, 4, 64)
    names = ("q", "out", "grad_out", "grad_q")
    bufs = {n: buf(q, BFLOAT16, 64 * i) for i, n in enumerate(names)}
    bufs.update({n: buf(k, BFLOAT16) for n in ("k", "v", "grad_k", "grad_v")})
    p = AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(AttentionOptions(causal=True))
    # (no lse: on the fake sm_90a the forward runs first for it, into the workspace too)
    fwd, dq, dkdv = tuning.launches(b, "backward", bufs, p)
    assert (fwd.kernel, dq.kernel, dkdv.kernel) == ("flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                                    "flash_bwd_dkdv_wgmma")
    dkdv()
    dq()
    fwd()
    assert [r[0] for r in runs] == ["flash_bwd_dkdv_wgmma", "flash_bwd_dq_wgmma",
                                    "flash_fwd_wgmma"]
    assert runs[0][1]["stats"] == runs[1][1]["stats"] != 0
    assert runs[1][1][configs.LSE_PASS] == runs[2][1][configs.LSE_PASS] != 0
    assert runs[2][1][configs.TILE_COUNTER]  # the persistent forward's counter, made here


def test_persistent_forward_gets_a_zeroed_tile_counter(runs):
    b = backend()
    q = (4, 1024, 16, 64)
    bufs = {n: buf(q, BFLOAT16) for n in ("q", "k", "v", "out")}
    (fwd,) = tuning.launches(b, "forward", bufs, params(q, q, causal=True))
    fwd()
    assert runs[0][0] == "flash_fwd_wgmma"
    counter = runs[0][1][configs.TILE_COUNTER]
    streams = launch.address(b._counters)
    assert counter and not streams <= counter < streams + b._counters.nbytes  # its own
    assert ctypes.c_uint32.from_address(counter).value == 0


def test_forcing_runs_that_variant_or_refuses():
    q = (2, 512, 8, 128)
    bufs = {n: buf(q, BFLOAT16) for n in ("q", "k", "v", "out")}
    p = params(q, q)
    for geometry in ((4, 1, 64), (8, 1, 64), (4, 2, 32)):
        v = configs.Variant(configs.FORWARD, BFLOAT16, 128, *geometry)
        b = backend()
        b.table = tuning.forcing(v)
        (fwd,) = tuning.launches(b, "forward", bufs, p)
        assert fwd.threads == v.threads and fwd.shared_bytes == v.shared_bytes
        assert dict(b.loader.compiled[-1][2]) == v.defines
        assert b.table[(configs.DECODE, BFLOAT16, 128)] == configs.TABLE[
            (configs.DECODE, BFLOAT16, 128)]  # the other entries as they were
    b = backend()
    b.table = tuning.forcing(configs.Variant(configs.FORWARD, BFLOAT16, 128, 8, 4, 256))
    with pytest.raises(ValueError, match="shared memory"):  # too large for any GPU
        tuning.launches(b, "forward", bufs, p)
    plain = configs.Variant(configs.FORWARD, BFLOAT16, 128, 12, 1, 64, configs.WGMMA, plain=True)
    b.table = tuning.forcing(plain)
    tuning.launches(b, "forward", bufs, p)
    with pytest.raises(ValueError):  # a build without the mask's code cannot take one
        tuning.launches(b, "forward", dict(bufs, mask=buf((1, 1, 1, 512), FLOAT32)), p)
    with pytest.raises(ValueError, match="padded"):
        tuning.forcing(configs.Variant(configs.FORWARD, BFLOAT16, 100, 4, 1, 64))


def test_launches_names_a_buffer_it_does_not_take():
    b = backend()
    bufs, p = decode_call(FLOAT32)
    with pytest.raises(ValueError, match="grad_q"):
        tuning.launches(b, "forward", dict(bufs, grad_q=bufs["q"]), p)
    with pytest.raises(ValueError, match="op must be"):
        tuning.launches(b, "decode", bufs, p)


# --- the kernel loader's overlay ------------------------------------------------------------------
@pytest.fixture
def sources(tmp_path):
    src, overlay = tmp_path / "src", tmp_path / "overlay"
    src.mkdir()
    overlay.mkdir()
    (src / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\nkernel body\n')
    (src / "a.cuh").write_text("package a\n")
    (src / "b.cuh").write_text('#include "a.cuh"\npackage b\n')
    return src, overlay


def test_overlay_files_replace_the_packages(sources, monkeypatch):
    src, overlay = sources
    monkeypatch.delenv(OVERLAY_ENV, raising=False)
    plain = KernelLoader(src).source("k.cu")
    assert "package a" in plain and "package b" in plain and plain.count("package a") == 1
    (overlay / "b.cuh").write_text('#include "a.cuh"\n#include "c.cuh"\nprobe b\n')
    (overlay / "c.cuh").write_text("probe c, a header only the overlay has\n")
    text = KernelLoader(src, overlay=overlay).source("k.cu")
    assert "probe b" in text and "probe c" in text and "package b" not in text
    assert "package a" in text and "kernel body" in text
    (overlay / "k.cu").write_text("probe kernel\n")
    assert KernelLoader(src, overlay=str(overlay)).source("k.cu") == "probe kernel\n"


def test_overlay_from_the_environment(sources, monkeypatch):
    src, overlay = sources
    (overlay / "a.cuh").write_text("probe a\n")
    monkeypatch.setenv(OVERLAY_ENV, str(overlay))
    loader = KernelLoader(src)
    assert loader.overlay == overlay and "probe a" in loader.source("k.cu")
    monkeypatch.setenv(OVERLAY_ENV, "")
    assert KernelLoader(src).overlay is None
    monkeypatch.setenv(OVERLAY_ENV, str(overlay / "missing"))
    with pytest.raises(ValueError, match="not a directory"):
        KernelLoader(src)


def test_package_sources_unchanged_without_an_overlay(monkeypatch):
    from ferrocupy.cuda.loader import SOURCE_DIR, expand_includes

    monkeypatch.delenv(OVERLAY_ENV, raising=False)
    assert KernelLoader().source("rope.cu") == expand_includes(SOURCE_DIR / "rope.cu")


# --- on the GPU: the seams drive the real kernels --------------------------------------------------
@pytest.mark.gpu
def test_forced_launches_compute_what_the_engine_does():
    import cupy as cp

    from ferrocupy import ComputeEngine
    from ferrocupy.cuda.backend import CudaBackend

    rng = cp.random.default_rng(0)
    q = rng.standard_normal((2, 1, 32, 128), dtype=cp.float32).astype(BFLOAT16)
    k, v = (rng.standard_normal((2, 4096, 8, 128), dtype=cp.float32).astype(BFLOAT16)
            for _ in range(2))
    want = cp.empty_like(q)
    ComputeEngine("cuda", quiet=True).flash_attention_v2_with(q, k, v, want)
    want = want.astype(cp.float32)
    p = AttentionDims.new(q, k).params(AttentionOptions())
    tiles = [x for x in configs.TABLE[(configs.DECODE, BFLOAT16, 128)] if x.isa == configs.TILES]
    for n, table in ((1, None), (3, None), (5, tuning.forcing(tiles[-1]))):
        out = cp.full(q.shape, cp.nan, dtype=q.dtype)
        with tuning.decode_splits(n):
            runs = tuning.launches(CudaBackend(table=table), "forward",
                                   dict(q=q, k=k, v=v, out=out), p)
        assert int(runs[0].arg("splits")) == n
        assert len(runs) == (2 if table else 1)  # the tiles design combines in a second kernel
        for launch in runs:
            launch()
        cp.cuda.get_current_stream().synchronize()
        got = out.astype(cp.float32)
        assert float(cp.linalg.norm(got - want) / cp.linalg.norm(want)) < 1e-2, (n, table)


@pytest.mark.gpu
def test_overlay_source_is_what_compiles(tmp_path, monkeypatch):
    from ferrocupy.cuda.loader import SOURCE_DIR

    monkeypatch.delenv(OVERLAY_ENV, raising=False)
    (tmp_path / configs.ROPE_SOURCE).write_text(
        (SOURCE_DIR / configs.ROPE_SOURCE).read_text() + "\n#error the overlay's copy\n")
    loader = KernelLoader(overlay=tmp_path)
    with pytest.raises(Exception, match="the overlay's copy"):
        loader.function(configs.ROPE_SOURCE, configs.ROPE_KERNEL, configs.rope_defines(FLOAT32))
    KernelLoader().function(configs.ROPE_SOURCE, configs.ROPE_KERNEL,
                            configs.rope_defines(FLOAT32))  # the package's compiles
