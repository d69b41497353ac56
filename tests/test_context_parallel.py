"""`ferrocupy.torch.context_parallel_attention` (ring attention over torch.distributed) equals
the same attention computed unsharded in one process: outputs and the gradients of q, k and v,
on gloo groups of 2, 3 and 4 CPU processes (the reference backend), for each layout, causal or
not, with GQA/MQA, causal offsets (negative ones too), windows and a scale.

Each group is started once per world size (forked, so the children import nothing) and runs
every case; the parent compares each case's gathered shards with `ferrocupy.torch.attention` on
the whole sequence. Besides, the block geometry (which query rows meet which keys at each ring
step, under which band) is checked exhaustively against the visibility rule on small shapes."""

from __future__ import annotations

import datetime
import os
import secrets

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import multiprocessing  # noqa: E402

import hypothesis.strategies as st  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from hypothesis import given, settings  # noqa: E402

import ferrocupy.torch as ft  # noqa: E402
from ferrocupy import context_parallel as cp  # noqa: E402
from helpers import requires_gpu  # noqa: E402

WORLDS = (2, 3, 4)

# name: (layout, causal, causal_offset, window, H, Hkv, scale, Sq_local, Sk_local)
CASES = {
    "zigzag-causal-gqa": ("zigzag", True, 0, 0, 4, 2, None, 6, 6),
    "zigzag-full-gqa": ("zigzag", False, 0, 0, 4, 2, None, 6, 6),
    "contiguous-causal-gqa": ("contiguous", True, 0, 0, 4, 2, None, 5, 5),
    "contiguous-full-gqa": ("contiguous", False, 0, 0, 4, 2, None, 5, 5),
    "zigzag-causal-mha-scale": ("zigzag", True, 0, 0, 2, 2, 0.3, 4, 4),
    "contiguous-causal-mqa": ("contiguous", True, 0, 0, 4, 1, None, 4, 4),
    "zigzag-causal-offset": ("zigzag", True, 3, 0, 4, 2, None, 6, 6),
    "contiguous-causal-negative-offset": ("contiguous", True, -5, 0, 4, 2, None, 4, 4),
    "zigzag-causal-negative-offset": ("zigzag", True, -3, 0, 2, 1, None, 4, 4),
    "zigzag-window": ("zigzag", False, 0, 5, 4, 2, None, 6, 6),
    "contiguous-window-offset": ("contiguous", False, -2, 4, 4, 2, None, 4, 4),
    "zigzag-causal-window-offset": ("zigzag", True, 2, 4, 4, 2, None, 6, 6),
    "contiguous-causal-window": ("contiguous", True, 0, 3, 4, 2, None, 4, 4),
    "zigzag-longer-keys-bottom-right": ("zigzag", True, None, 0, 4, 2, None, 4, 6),
    "contiguous-longer-keys-window": ("contiguous", False, 0, 6, 4, 2, None, 4, 8),
}
BATCH, HEAD_DIM = 2, 8


def _offset(case: tuple, world: int) -> int:
    """The case's causal_offset; None is bottom-right (Sk - Sq of the whole sequences)."""
    layout, causal, offset, window, H, Hkv, scale, sq, sk = case
    return (sk - sq) * world if offset is None else offset


def _options(case: tuple, world: int) -> dict:
    layout, causal, offset, window, H, Hkv, scale, sq, sk = case
    return dict(causal=causal, causal_offset=_offset(case, world), window=window, scale=scale)


# a 4-rank group also runs one case on two rings of non-adjacent ranks (subgroups: their ranks
# are not the global ones)
SUBGROUPS = ((0, 2), (1, 3))
SUBGROUP_CASE = "zigzag-causal-gqa"


def _inputs(seed: int, world: int) -> dict:
    """name: (q, k, v, grad_out) over whole sequences, float32 (and "subgroup": the subgroup
    case's, for a 4-rank group)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(name, world) for name in CASES]
    if world == 4:
        sizes.append((SUBGROUP_CASE, len(SUBGROUPS[0])))
    inputs = {}
    for name, ranks in sizes:
        layout, causal, offset, window, H, Hkv, scale, sq, sk = CASES[name]
        shapes = ((sq, H), (sk, Hkv), (sk, Hkv), (sq, H))
        key = name if ranks == world else "subgroup"
        inputs[key] = tuple(torch.randn(BATCH, s * ranks, h, HEAD_DIM, generator=gen)
                            for s, h in shapes)
    return inputs


def _through_ring(tensors: tuple, name: str, rank: int, world: int, group=None) -> tuple:
    """This rank's shards of (out, dq, dk, dv) for one case."""
    q, k, v, grad_out = tensors
    case = CASES[name]
    layout = case[0]
    q, k, v = (cp.shard_sequence(x, rank, world, layout).requires_grad_() for x in (q, k, v))
    out = ft.context_parallel_attention(q, k, v, layout=layout, group=group,
                                        **_options(case, world))
    out.backward(cp.shard_sequence(grad_out, rank, world, layout))
    return out.detach(), q.grad, k.grad, v.grad


def _rank_main(rank: int, world: int, directory: str, inputs: dict) -> None:
    """One rank: every case through the ring, its shards of (out, dq, dk, dv) saved."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results = {name: _through_ring(inputs[name], name, rank, world) for name in CASES}
        if world == 4:
            groups = [dist.new_group(list(ranks)) for ranks in SUBGROUPS]  # every rank makes all
            (mine,) = [i for i, ranks in enumerate(SUBGROUPS) if rank in ranks]
            results["subgroup"] = _through_ring(inputs["subgroup"], SUBGROUP_CASE,
                                                SUBGROUPS[mine].index(rank),
                                                len(SUBGROUPS[mine]), groups[mine])
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _gather(per_rank: list, key: str, layout: str) -> tuple:
    return tuple(cp.unshard_sequence([p[key][i] for p in per_rank], layout) for i in range(4))


def _run_group(world: int, directory: str, inputs: dict) -> dict:
    """name: (out, dq, dk, dv) over whole sequences, gathered from every rank's shards (and
    "subgroup0", "subgroup1" for a 4-rank group)."""
    tmp.start_processes(_rank_main, args=(world, directory, inputs), nprocs=world,
                        start_method=_start_method())
    per_rank = [torch.load(os.path.join(directory, f"rank{r}.pt")) for r in range(world)]
    results = {name: _gather(per_rank, name, CASES[name][0]) for name in CASES}
    if world == 4:
        for i, ranks in enumerate(SUBGROUPS):
            results[f"subgroup{i}"] = _gather([per_rank[r] for r in ranks], "subgroup",
                                              CASES[SUBGROUP_CASE][0])
    return results


def _start_method() -> str:
    """"fork" (a child imports nothing: fast) on a machine without a GPU; "spawn" (each rank
    imports this module through the parent's sys.path) where torch sees one. A forked child
    cannot run a backward once its parent's autograd engine has started its threads ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"), and on a GPU
    machine earlier tests in the process (CUDA or not: 28 ring tests failed so on an H100 where
    torch had not initialised CUDA) start them; nothing public says whether they have.
    FERROCUPY_RING_START picks one."""
    forced = os.environ.get("FERROCUPY_RING_START")
    if forced:
        return forced
    if torch.cuda.is_available() or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "fork"


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """world: (inputs, results), each group run once, on first use."""
    seed = int(os.environ.get("FERROCUPY_TEST_SEED") or secrets.randbits(63))
    runs = {}

    def get(world: int):
        if world not in runs:
            print(f"ring seed: {seed} (replay with FERROCUPY_TEST_SEED={seed})")
            inputs = _inputs(seed + world, world)
            directory = str(tmp_path_factory.mktemp(f"ring{world}"))
            runs[world] = inputs, _run_group(world, directory, inputs)
        return runs[world]

    return get


def _unsharded(q, k, v, grad_out, **options) -> tuple:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = ft.attention(q, k, v, **options)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_equal_to_unsharded(got: tuple, want: tuple) -> None:
    for what, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, (1e-5, 1e-4, 1e-4, 1e-4)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_ring_equals_unsharded_attention(ring_runs, world, name):
    inputs, results = ring_runs(world)
    want = _unsharded(*inputs[name], **_options(CASES[name], world))
    _assert_equal_to_unsharded(results[name], want)


@pytest.mark.parametrize("index", range(len(SUBGROUPS)))
def test_a_subgroup_of_non_adjacent_ranks_is_its_own_ring(ring_runs, index):
    inputs, results = ring_runs(4)
    want = _unsharded(*inputs["subgroup"], **_options(CASES[SUBGROUP_CASE], 2))
    _assert_equal_to_unsharded(results[f"subgroup{index}"], want)


# --- the block geometry -------------------------------------------------------------------------
def _visible(geometry, causal: bool, window: int, rank: int, source: int) -> torch.Tensor:
    """[Sq_local, Sk_local] bool: which of `rank`'s rows see which of `source`'s keys, from the
    unsharded rule in global positions (element by element)."""
    g = geometry
    rows = [start + i for _, start, n in cp._chunks(rank, g.world, g.sq, g.layout)
            for i in range(n)]
    keys = [start + j for _, start, n in cp._chunks(source, g.world, g.sk, g.layout)
            for j in range(n)]
    return torch.tensor([[(not causal or j <= i + g.causal_offset)
                          and (window == 0 or abs(i + g.causal_offset - j) < window)
                          for j in keys] for i in rows])


def _covered(blocks: list, sq: int, sk: int) -> torch.Tensor:
    """[Sq_local, Sk_local] int: how many blocks make each (row, key) visible, by SPEC's rule
    applied to the options each block passes to `attention`."""
    count = torch.zeros(sq, sk, dtype=torch.int64)
    for block in blocks:
        opts = block.options()
        assert opts is not None, block
        causal, offset, window = (opts.get("causal", False), opts.get("causal_offset", 0),
                                  opts.get("window", 0))
        for i in range(block.rows.stop - block.rows.start):
            a = i + offset
            for j in range(block.keys.stop - block.keys.start):
                if (not causal or j <= a) and (window == 0 or abs(a - j) < window):
                    count[block.rows.start + i, block.keys.start + j] += 1
    return count


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 5), layout=st.sampled_from(cp.LAYOUTS), half_q=st.integers(1, 4),
       half_k=st.integers(1, 4), causal=st.booleans(), offset=st.integers(-12, 12),
       window=st.sampled_from([0, 0, 1, 2, 3, 7]), data=st.data())
def test_blocks_cover_exactly_the_visible_pairs_once(world, layout, half_q, half_k, causal,
                                                     offset, window, data):
    sq, sk = 2 * half_q, 2 * half_k
    geometry = cp._Geometry(world, sq, sk, layout, cp._Band.of(causal, window), offset)
    rank = data.draw(st.integers(0, world - 1))
    source = data.draw(st.integers(0, world - 1))
    blocks = cp._step_blocks(geometry, rank, source)
    want = _visible(geometry, causal, window, rank, source)
    count = _covered(blocks, sq, sk)
    assert count.max() <= 1, blocks
    assert torch.equal(count.bool(), want), blocks
    # a call's options are ones the GPU kernels take (a non-negative causal_offset, a
    # symmetric window), and a step whose keys no query sees runs nothing
    for block in blocks:
        assert set(block.options()) <= {"causal", "causal_offset", "window"}
        assert block.options().get("causal_offset", 0) >= 0
        assert block.rows.stop > block.rows.start and block.keys.stop > block.keys.start
    if not want.any():
        assert blocks == ()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_causal_is_one_call_a_step_and_skips_nothing_it_needs(world):
    """The balanced case: each step is one kernel call; the own step is causal over the whole
    shard pair, the others unmasked over half of it."""
    geometry = cp._Geometry(world, 8, 8, "zigzag", cp._Band.of(True, 0), 0)
    for rank in range(world):
        for step in range(world):
            blocks = cp._step_blocks(geometry, rank, (rank - step) % world)
            assert len(blocks) == 1, (rank, step, blocks)
            (block,) = blocks
            if step == 0:
                assert block.options() == {"causal": True, "causal_offset": 0}
            else:
                assert block.options() == {}
                cells = (block.rows.stop - block.rows.start) * (block.keys.stop - block.keys.start)
                assert cells == 8 * 8 // 2


def test_contiguous_causal_skips_later_shards():
    geometry = cp._Geometry(4, 8, 8, "contiguous", cp._Band.of(True, 0), 0)
    assert cp._step_blocks(geometry, 1, 2) == ()
    assert cp._step_blocks(geometry, 1, 3) == ()
    assert cp._step_blocks(geometry, 2, 0)[0].options() == {}


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_then_unshard_is_the_identity(layout, world):
    x = torch.arange(2 * 12 * world).reshape(2, 12 * world)
    shards = [cp.shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 12) for s in shards)
    assert torch.equal(cp.unshard_sequence(shards, layout), x)


def test_zigzag_shard_holds_chunks_r_and_mirror():
    x = torch.arange(16).reshape(1, 16)
    assert cp.shard_sequence(x, 1, 4, "zigzag").tolist() == [[2, 3, 12, 13]]
    assert cp.shard_sequence(x, 1, 4, "contiguous").tolist() == [[4, 5, 6, 7]]


# --- bad input: refused before any rank talks to another ----------------------------------------
def _qkv(sq=4, sk=4, H=4, Hkv=2):
    return (torch.randn(1, sq, H, 8), torch.randn(1, sk, Hkv, 8), torch.randn(1, sk, Hkv, 8))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1"),
    (dict(layout="striped"), ValueError, "layout"),
    (dict(window=-1), ValueError, "window"),
])
def test_bad_options_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        ft.context_parallel_attention(*_qkv(), **kwargs)


def test_odd_shard_for_zigzag_is_refused_with_the_shapes():
    with pytest.raises(ValueError, match=r"zigzag.*q \(1, 3, 4, 8\)"):
        ft.context_parallel_attention(*_qkv(sq=3, sk=3))


def test_mismatched_shapes_are_refused_with_the_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"v \(1, 5, 2, 8\)"):
        ft.context_parallel_attention(q, k, torch.randn(1, 5, 2, 8), layout="contiguous")


def test_without_a_process_group_it_says_what_to_do():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ft.context_parallel_attention(*_qkv())


# --- GPU: a one-GPU NCCL group ------------------------------------------------------------------
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_one_gpu_nccl_group_equals_attention(tmp_path, layout, dtype):
    """World size 1 on the device: the ring's blocks, merge and backward through the CUDA
    kernels; equal to one `attention` call (the blocks are the whole sequence)."""
    group = None
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0,
                                world_size=1)
        group = dist.group.WORLD
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad_out = (torch.randn(2, 256, h, 64, device="cuda", generator=gen,
                                         dtype=dtype) for h in (8, 2, 2, 8))
        options = dict(causal=True, causal_offset=0, window=0, scale=None)
        want = _unsharded(q, k, v, grad_out, **options)
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = ft.context_parallel_attention(q, k, v, layout=layout, group=group, **options)
        out.backward(grad_out)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for g, w in zip((out.detach(), q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    finally:
        if group is not None:
            dist.destroy_process_group()
