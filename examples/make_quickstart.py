"""Writes examples/quickstart.ipynb from the cells below, so the notebook's text lives in a
reviewable file, then runs it top to bottom and saves it with its outputs (printed values and
plots, so a forge shows them). Run from anywhere, on whatever backend the machine has:

    python examples/make_quickstart.py

Rerun it after the cells change or after benchmarks/publish.py has published new runs (the last
cell plots them)."""

from pathlib import Path

import nbformat

OUT = Path(__file__).resolve().parent / "quickstart.ipynb"

CELLS = [
    ("md", """# ferrocupy quickstart

Fused attention and rotary embeddings for NVIDIA GPUs, with a NumPy reference backend that follows
the same rules on any machine. This notebook runs top to bottom on either: with a CUDA GPU and CuPy
the engine picks the CUDA kernels, otherwise the reference (float64 inside, slower, same results to
rounding). The contract is [docs/semantics.md](../docs/semantics.md)."""),
    ("code", """import numpy as np
import matplotlib.pyplot as plt

from ferrocupy import AttentionDims, AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy import reference

eng = ComputeEngine()          # CUDA when a GPU is usable, else the reference
where = "cuda" if eng.backend_name == "cuda" else "cpu"
print(eng)

rng = np.random.default_rng(0)

def put(a):
    \"\"\"A host array as a tensor on the engine's device.\"\"\"
    return UnifiedTensor.from_numpy(np.ascontiguousarray(a), device=where)

def empty(shape, dtype=np.float32):
    return UnifiedTensor.empty(shape, dtype, device=where)"""),
    ("md", """## RoPE

`rope(tensor, head_dim, pos)` rotates `[B, S, H, D]` queries or keys in place (rotate-half,
theta 10000); token `s` sits at position `pos + s`. A rotation keeps each head vector's norm."""),
    ("code", """B, S, H, Hkv, D = 2, 64, 4, 2, 32
q_host = rng.standard_normal((B, S, H, D)).astype(np.float32)
k_host = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
v_host = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)

q, k, v = put(q_host), put(k_host), put(v_host)
eng.rope(q, D, 0)
eng.rope(k, D, 0)
rotated = q.to_numpy()
print("norms kept:", np.allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(q_host, axis=-1), rtol=1e-5))"""),
    ("md", """## Forward with a mask, and its log-sum-exp

Grouped-query attention (4 query heads over 2 KV heads), causal, plus an additive mask that
broadcasts over heads. `lse` (float32 `[B, H, S]`) is each row's log-sum-exp; give it to the
backward to spare it a pass. Checked here against a dense float64 computation."""),
    ("code", """mask_host = rng.standard_normal((B, 1, S, S)).astype(np.float32)
opts = AttentionOptions(causal=True)
out, lse = empty(q.shape), empty((B, H, S))
eng.flash_attention_v2_with(q, k, v, out, opts, put(mask_host), lse=lse)

def dense(q, k, v, mask, causal):
    b, s, h, d = q.shape
    kk = np.repeat(k, h // k.shape[2], axis=2).astype(np.float64)
    vv = np.repeat(v, h // v.shape[2], axis=2).astype(np.float64)
    scores = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), kk) / np.sqrt(d) + mask
    if causal:
        scores = np.where(np.tril(np.ones((s, kk.shape[1]), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, vv)

want = dense(rotated, k.to_numpy(), v_host, mask_host, causal=True)
got = out.to_numpy()
print("relative error:", np.linalg.norm(got - want) / np.linalg.norm(want))"""),
    ("md", """## Backward

The gradients are written (never accumulated) into the three outputs; dropout would be regenerated
from `opts.seed`."""),
    ("code", """grad_out = put(rng.standard_normal((B, S, H, D)).astype(np.float32))
gq, gk, gv = empty(q.shape), empty(k.shape), empty(v.shape)
eng.flash_attention_v2_backward_with(q, k, v, out, grad_out, gq, gk, gv, opts, put(mask_host), lse=lse)
print("grad norms:", [round(float(np.linalg.norm(g.to_numpy())), 3) for g in (gq, gk, gv)])"""),
    ("md", """## Which keys a row sees: causal, a KV-cache offset and a sliding window

Row `i` sits at `a = i + causal_offset` and sees key `j` when `j <= a` (causal) and `|a - j| <
window`. Keys that no row can reach are never read."""),
    ("code", """small_q, small_k = np.zeros((1, 8, 1, 16), np.float32), np.zeros((1, 24, 1, 16), np.float32)
params = AttentionDims.new(small_q, small_k).params(AttentionOptions(causal=True, causal_offset=12, window=6))
seen = reference.visible(params, np.arange(8), np.arange(24))
plt.figure(figsize=(6, 2.4))
plt.imshow(seen, cmap="Greens", aspect="auto")
plt.xlabel("key j"); plt.ylabel("query row i")
plt.title("causal, causal_offset=12, window=6")
plt.show()"""),
    ("md", """## One decode step from a preallocated KV cache

A cache of capacity 64 holds sequences of different lengths (`kv_lens`); the slots past each
length hold anything, NaN here, and are never read. One new token per sequence sits at the end of
its sequence (`causal_offset = capacity - 1`). On a GPU, calls like this (few query rows per KV
head) take the split-KV decode kernels."""),
    ("code", """cap, lens = 64, np.array([40, 17], np.int32)
kc = rng.standard_normal((B, cap, Hkv, D)).astype(np.float32)
vc = rng.standard_normal((B, cap, Hkv, D)).astype(np.float32)
for b, n in enumerate(lens):
    kc[b, n:], vc[b, n:] = np.nan, np.nan
q1 = rng.standard_normal((B, 1, H, D)).astype(np.float32)
out1 = empty(q1.shape)
eng.flash_attention_v2_with(put(q1), put(kc), put(vc), out1,
                            AttentionOptions(causal=True, causal_offset=cap - 1), kv_lens=put(lens))
step = out1.to_numpy()
print("finite:", np.isfinite(step).all())
for b, n in enumerate(lens):  # the same as attending to each sequence's own keys
    alone = dense(q1[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], 0.0, causal=False)
    print(f"sequence {b} ({n} keys): relative error",
          float(np.linalg.norm(step[b] - alone[0]) / np.linalg.norm(alone[0])))"""),
    ("md", """## bfloat16

The same call in bfloat16 (`ml_dtypes.bfloat16`, CuPy's dtype): float32 inside, the output
rounded once."""),
    ("code", """import ml_dtypes

bf = ml_dtypes.bfloat16
out_bf = empty(q.shape, bf)
eng.flash_attention_v2_with(put(rotated.astype(bf)), put(k.to_numpy().astype(bf)),
                            put(v_host.astype(bf)), out_bf, opts, put(mask_host))
print("bf16 vs float64:", np.linalg.norm(out_bf.to_numpy().astype(np.float64) - want) / np.linalg.norm(want))"""),
    ("md", """## Tensors in PyTorch's `[B, H, S, D]` layout

Every attention tensor may be any view whose last dimension is contiguous: SDPA's `[B, H, S, D]`
transposed to `[B, S, H, D]`, one part of a packed QKV buffer. The kernels read and write it
through its strides; nothing is copied. (With `ferrocupy.torch`, pass `x.transpose(1, 2)`.)"""),
    ("code", """def sdpa_layout(a):
    \"\"\"`a` ([B, S, H, D]) stored as [B, H, S, D], seen as a [B, S, H, D] view of that memory.\"\"\"
    stored = put(a.transpose(0, 2, 1, 3))
    return UnifiedTensor(stored.buffer().transpose(0, 2, 1, 3))

qt, kt, vt = (sdpa_layout(a) for a in (rotated, k.to_numpy(), v_host))
out_t = sdpa_layout(np.full(q.shape, np.nan, np.float32))  # the output in that layout too
eng.flash_attention_v2_with(qt, kt, vt, out_t, opts, put(mask_host))
print("q view strides (elements):", qt.strides, " contiguous:", qt.is_contiguous)
print("same as the contiguous call:", np.array_equal(out_t.to_numpy(), out.to_numpy()))"""),
    ("md", """## Speed

The latest full benchmark runs on the newest GPU measured, as `benchmarks/publish.py` publishes
them: ferrocupy's throughput over the fastest PyTorch implementation in the same run, for the
cases README.md tabulates (above 1: ferrocupy faster). Every case, with the command and versions
of each run: [benchmarks/RESULTS.md](../benchmarks/RESULTS.md)."""),
    ("code", """import sys
from pathlib import Path

sys.path.insert(0, str(Path("..") / "benchmarks"))
import publish

gpu, by_dtype = next(iter(publish.latest(publish.load_runs()).items()))
dtypes = [d for d in publish.DTYPES if d in by_dtype]
fig, axes = plt.subplots(1, len(dtypes), figsize=(4.6 * len(dtypes), 3.8), sharex=True,
                         squeeze=False)
for ax, dtype in zip(axes[0], dtypes):
    run = by_dtype[dtype]
    rows = [r for r in run.rows(dtype) if publish.HEADLINE.match(r["case"]) and r["ratio"]]
    ratios = [r["ratio"] for r in rows]
    bars = ax.barh([publish.case_label(r) for r in rows], ratios,
                   color=["C0" if x >= 1 else "C1" for x in ratios])
    ax.bar_label(bars, [f"{x:.2f}" for x in ratios], padding=2, fontsize=8)
    ax.axvline(1.0, color="gray", ls=":")
    ax.set_xscale("log")
    ax.set_xlim(0.25, 16)
    ax.set_xticks([0.25, 0.5, 1, 2, 4, 8], ["0.25", "0.5", "1", "2", "4", "8"])
    ax.minorticks_off()
    ax.invert_yaxis()
    ax.set_title(f"{dtype}, run of {run.date[:10]}", fontsize=10)
    ax.set_xlabel("ferrocupy / fastest PyTorch")
fig.suptitle(f"ferrocupy vs PyTorch, {gpu}")
fig.tight_layout()
plt.show()"""),
]


def notebook():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in CELLS]
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating changes nothing
        cell.id = f"cell-{i:02d}"
    return nb


def executed(nb):
    """`nb` run top to bottom in a fresh kernel, from the examples folder, with its outputs (no
    timing metadata: rerunning changes only what the cells print and plot). The kernel imports
    this checkout's ferrocupy, installed or not."""
    import os

    import nbclient

    root = str(OUT.parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))

    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(OUT.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on a failure
    return nb


if __name__ == "__main__":
    nbformat.write(executed(notebook()), OUT)
    print(f"wrote {OUT}, with its outputs")
