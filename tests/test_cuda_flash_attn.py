"""ferrocupy.flash_attn on CUDA tensors in float16 and bfloat16, against the CPU path (the
reference backend) and SPEC's half-precision rule (tests/half_rule.py): for out, softmax_lse and
every gradient, max|x - x64| <= 2 max|x_torch - x64| + 1e-3 max|x64| (+ what the stored out's
rounding alone costs the gradients), where x64 is tests/flash_oracle.py in float64 on the same
rounded inputs and x_torch the same formula as plain PyTorch ops on the GPU in the dtype. Both
paths are held to the rule, and dropout's S_dmask signs (the Philox keep mask) must agree bit
for bit between them. The varlen and KV-cache-append cases skip where ferrocupy.torch lacks
their interface."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

import flash_oracle as oracle  # noqa: E402
from gpu_helpers import gpu_pytestmark, self_check  # noqa: E402
from half_rule import check_rule  # noqa: E402

import ferrocupy.flash_attn as fa  # noqa: E402
import ferrocupy.torch as ft  # noqa: E402

pytestmark = gpu_pytestmark()

DTYPES = [torch.float16, torch.bfloat16]
# (B, Sq, Sk, H, Hkv, D, options)
CASES = {
    "causal-sq<sk-gqa": (2, 96, 160, 8, 2, 64, dict(causal=True)),
    "causal-sq>sk": (2, 160, 96, 4, 4, 128, dict(causal=True)),
    "window-softcap": (1, 128, 128, 4, 2, 64, dict(window_size=(40, 8), softcap=20.0)),
    "alibi-bh-causal-d256": (2, 64, 80, 4, 1, 256, dict(causal=True, alibi="bh")),
    "dropout-causal": (2, 64, 96, 4, 2, 64, dict(causal=True, dropout_p=0.2)),
}


@pytest.fixture(scope="module")
def cuda():
    if self_check():  # FERRO_GPU_TESTS_ON_REFERENCE=1: the checks themselves, on the CPU path
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch.device("cuda")


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _np(x):
    return x.detach().to("cpu", torch.float64).numpy()


def _run(fn, leaves, go, seed):
    """(out, lse, S_dmask, [dq, dk, dv]) of `fn(*leaves, return_attn_probs=True)`, the dropout
    seed drawn under torch.manual_seed(seed)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    torch.manual_seed(seed)
    out, lse, s_dmask = fn(*leaves)
    out.backward(go)
    return out, lse, s_dmask, [x.grad for x in leaves]


def _inherited(q, k, v, go, out_half, kw):
    """Per gradient, what rounding the stored out to the dtype moves it by in a FlashAttention
    backward: Delta = rowsum(dO * O) shifts by delta, so dS shifts by -P * delta, which is minus
    the gradient of sum(delta * lse) (finite lse only)."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    out64, lse64, _ = oracle.attention(*leaves, **kw)
    delta = (go.double() * (out_half.detach().double() - out64.detach())).sum(-1).transpose(1, 2)
    fin = torch.isfinite(lse64)
    (delta[fin] * lse64[fin]).sum().backward()
    return [float(x.grad.abs().max()) for x in leaves[:2]] + [0.0]


def _check(name_prefix, got, x64, plain, inherited=(0.0, 0.0, 0.0)):
    out, lse, _, grads = got
    check_rule(f"{name_prefix} out", _np(out), _np(x64[0]), _np(plain[0]))
    check_rule(f"{name_prefix} lse", _np(lse), _np(x64[1]), _np(plain[1]))
    for i, name in enumerate(("dq", "dk", "dv")):
        check_rule(f"{name_prefix} {name}", _np(grads[i]), _np(x64[3][i]), _np(plain[3][i]),
                   inherited=inherited[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_func_cuda_against_cpu_and_the_half_rule(cuda, gen, dtype, case):
    B, Sq, Sk, H, Hkv, D, opts = CASES[case]
    opts = dict(opts)
    alibi = (torch.rand(B, H, generator=gen) * 0.3) if opts.pop("alibi", None) else None
    q, k, v, go = (torch.randn(*s, generator=gen).to(dtype) for s in
                   ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)))
    seed = int(torch.randint(2**62, (), generator=gen))

    def call(device):
        a = None if alibi is None else alibi.to(device)
        return lambda *x: fa.flash_attn_func(*x, alibi_slopes=a, return_attn_probs=True, **opts)

    got = _run(call(cuda), [x.to(cuda) for x in (q, k, v)], go.to(cuda), seed)
    cpu = _run(call("cpu"), (q, k, v), go, seed)
    keep = ~torch.signbit(cpu[2]) if opts.get("dropout_p") else None
    if keep is not None:
        assert torch.equal(keep, ~torch.signbit(got[2].cpu())), "dropout keep masks differ"
    kw = dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
              softcap=opts.get("softcap", 0.0), alibi=alibi, keep=keep,
              dropout_p=opts.get("dropout_p", 0.0))

    def formula(device, dt):
        leaves = [x.to(device, dt).requires_grad_(True) for x in (q, k, v)]
        out, lse, _ = oracle.attention(*leaves, dtype=dt, **{**kw, "alibi": None if alibi is None
                                                              else alibi.to(device)})
        out.backward(go.to(device, dt))
        return out, lse, None, [x.grad for x in leaves]

    x64 = formula("cpu", torch.float64)
    plain = formula(cuda, dtype)
    for label, res in (("cuda", got), ("cpu", cpu)):
        inh = _inherited(q, k, v, go, res[0].cpu(), kw)
        _check(f"{case} {dtype} {label}", res, x64, plain, inh)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sq, opts", [(1, dict(causal=True)),
                                      (5, dict(causal=True, window_size=(64, 0)))],
                         ids=["decode", "chunk-window"])
def test_kvcache_read_cuda_against_cpu_and_the_half_rule(cuda, gen, dtype, sq, opts):
    """flash_attn_with_kvcache without appending (kv_lens on the engine), slots past each
    length NaN (never read)."""
    B, cap, H, Hkv, D = 3, 300, 8, 2, 128
    q = torch.randn(B, sq, H, D, generator=gen).to(dtype)
    kc, vc = (torch.randn(B, cap, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([7, 300, 160], dtype=torch.int32)
    for b in range(B):
        kc[b, int(lens[b]):] = float("nan")
        vc[b, int(lens[b]):] = float("nan")
    res = [fa.flash_attn_with_kvcache(q.to(d), kc.to(d), vc.to(d), cache_seqlens=lens.to(d),
                                      return_softmax_lse=True, **opts) for d in ("cpu", cuda)]
    kw = dict(causal=True, window=opts.get("window_size", (-1, -1)))
    x64 = oracle.kvcache(q, kc, vc, lens, **kw)
    plain = oracle.kvcache(q.to(cuda), kc.to(cuda), vc.to(cuda), lens, dtype=dtype, **kw)
    for label, (out, lse) in zip(("cpu", "cuda"), res):
        check_rule(f"{label} out", _np(out), _np(x64[0]), _np(plain[0]))
        check_rule(f"{label} lse", _np(lse), _np(x64[1]), _np(plain[1]))



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_rows_and_left_pads_on_cuda(cuda, gen, dtype):
    """cache_batch_idx and cache_leftpad without appending: each sequence's rows gathered on the
    GPU, then the kv_lens decode kernels; slots before each pad and past each length NaN."""
    B, Bc, cap, H, Hkv, D = 3, 4, 300, 8, 2, 64
    q = torch.randn(B, 1, H, D, generator=gen).to(dtype)
    kc, vc = (torch.randn(Bc, cap, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    idx = torch.tensor([3, 0, 2], dtype=torch.int32)
    pad = torch.tensor([5, 0, 150], dtype=torch.int32)
    lens = torch.tensor([7, 300, 290], dtype=torch.int32)
    for b in range(B):
        for c in (kc, vc):
            c[int(idx[b]), :int(pad[b])] = float("nan")
            c[int(idx[b]), int(lens[b]):] = float("nan")
    out, lse = fa.flash_attn_with_kvcache(q.to(cuda), kc.to(cuda), vc.to(cuda),
                                          cache_seqlens=lens.to(cuda),
                                          cache_batch_idx=idx.to(cuda), cache_leftpad=pad.to(cuda),
                                          causal=True, return_softmax_lse=True)
    rows = [kc[int(idx[b])].roll(-int(pad[b]), 0) for b in range(B)]
    vrows = [vc[int(idx[b])].roll(-int(pad[b]), 0) for b in range(B)]
    k_seq, v_seq, seen = torch.stack(rows), torch.stack(vrows), lens - pad
    x64 = oracle.kvcache(q, k_seq, v_seq, seen, causal=True)
    plain = oracle.kvcache(q.to(cuda), k_seq.to(cuda), v_seq.to(cuda), seen, dtype=dtype,
                           causal=True)
    check_rule("out", _np(out), _np(x64[0]), _np(plain[0]))
    check_rule("lse", _np(lse), _np(x64[1]), _np(plain[1]))

needs_varlen = pytest.mark.skipif(
    "cu_seqlens_q" not in inspect.signature(ft.attention).parameters,
    reason="ferrocupy.torch.attention has no varlen keywords in this tree")
needs_kvcache = pytest.mark.skipif(not hasattr(ft, "attention_with_kvcache"),
                                   reason="ferrocupy.torch.attention_with_kvcache is not here")


@needs_varlen
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_cuda_matches_cpu(cuda, gen, dtype):
    lens_q, lens_k, H, Hkv, D = [37, 1, 90, 64], [50, 77, 90, 12], 4, 2, 64
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), Hkv, D, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), Hkv, D, generator=gen).to(dtype)
    go = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype)
    kw = dict(causal=True, window_size=(48, 0), softcap=10.0)
    res = []
    for device in ("cpu", cuda):
        leaves = [x.detach().clone().to(device).requires_grad_(True) for x in (q, k, v)]
        out, lse, _ = fa.flash_attn_varlen_func(*leaves, cu_q.to(device), cu_k.to(device),
                                                max(lens_q), max(lens_k), return_attn_probs=True,
                                                **kw)
        out.backward(go.to(device))
        res.append([out, lse] + [x.grad for x in leaves])
    want64 = oracle.varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), max(lens_k), causal=True,
                           window=(48, 0), softcap=10.0)
    for name, c, g, w in zip(("out", "lse"), *res, want64):
        # the CPU path rounds the float64 result once: the CUDA path may err at most twice that
        # much more, plus SPEC's 1e-3 max|x64| (no plain-PyTorch varlen to measure against)
        check_rule(name, _np(g), _np(w), _np(c))


@needs_kvcache
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_append_cuda_matches_cpu(cuda, gen, dtype):
    B, cap, H, Hkv, D, Sn = 3, 256, 8, 2, 128, 4
    q = torch.randn(B, Sn, H, D, generator=gen).to(dtype)
    kn, vn = (torch.randn(B, Sn, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, cap, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([0, 100, 252], dtype=torch.int32)
    angles = torch.rand(cap, 32, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    res = []
    for device in ("cpu", cuda):
        caches = [kc.to(device).clone(), vc.to(device).clone()]
        out, lse = fa.flash_attn_with_kvcache(
            q.to(device), *caches, kn.to(device), vn.to(device), rotary_cos=cos.to(device),
            rotary_sin=sin.to(device), cache_seqlens=lens.to(device), causal=True,
            return_softmax_lse=True)
        res.append([out, lse] + caches)
    qr, k64, v64 = oracle.append(q, kc, vc, kn, vn, lens, cos=cos, sin=sin, causal=True)
    want64 = list(oracle.kvcache(qr, k64, v64, lens + Sn, causal=True)) + [k64, v64]
    for name, c, g, w in zip(("out", "lse", "k_cache", "v_cache"), *res, want64):
        # at most twice the CPU path's error (one rounding of the float64 result) + 1e-3 max|x|
        check_rule(name, _np(g), _np(w), _np(c))
