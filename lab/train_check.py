"""Training check: a small GPT-style model (RoPE + causal GQA attention + MLP)
trained on next-byte prediction over this repository's README, from one seed, with
`ferrocupy.torch.attention` and with torch SDPA, in float32 and in bfloat16 (autocast). The
run-to-run noise is the gap between two SDPA runs from different seeds; ferrocupy's curve should
sit within it of SDPA's from the same seed.

    python3 lab/train_check.py [--steps 300] [--out lab/results/training-check]

Writes OUT.json (the loss curves) and OUT.png (the plot), and prints a summary per dtype: the
mean loss over the last 50 steps of each run, and the largest gap between smoothed curves (same
seed: ferrocupy vs SDPA; noise: SDPA seed 0 vs seed 1)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ferrocupy.torch as ft

ROOT = Path(__file__).resolve().parents[1]
VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 256, 256, 8, 2, 2, 256, 16


def rope(x, theta=10000.0):
    """Rotate-half RoPE on [B, S, H, D] (plain torch, differentiable: the same in both runs)."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, attention: str):
        super().__init__()
        self.attention = attention
        self.d = DIM // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.d, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        B, S, _ = x.shape
        h = self.norm1(x)
        q = rope(self.q(h).view(B, S, HEADS, self.d))
        k, v = self.kv(h).view(B, S, 2, KV_HEADS, self.d).unbind(2)
        k = rope(k)
        if self.attention == "ferrocupy":
            a = ft.attention(q, k, v, causal=True)
        else:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
        x = x + self.o(a.reshape(B, S, DIM))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, attention: str):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(attention: str, seed: int, dtype: str, steps: int, data: torch.Tensor,
          device: str) -> list[float]:
    torch.manual_seed(seed)
    model = GPT(attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.Generator().manual_seed(1234)  # the same data order for every run
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=batches)
        idx = torch.stack([data[s:s + SEQ] for s in starts]).to(device)
        tgt = torch.stack([data[s + 1:s + SEQ + 1] for s in starts]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tgt.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def smooth(xs, w=20):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "lab" / "results" / "training-check"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = ap.parse_args()
    data = torch.tensor(list((ROOT / "README.md").read_bytes()), dtype=torch.long)
    curves = {}
    for dtype in ("float32", "bfloat16"):
        for name, attention, seed in (("sdpa seed 0", "sdpa", 0), ("ferrocupy seed 0", "ferrocupy", 0),
                                      ("sdpa seed 1", "sdpa", 1)):
            t0 = time.time()
            curves[f"{dtype}: {name}"] = train(attention, seed, dtype, args.steps, data,
                                               args.device)
            print(f"{dtype} {name}: {time.time() - t0:.1f} s", flush=True)
    summary = []
    for dtype in ("float32", "bfloat16"):
        a, b, c = (curves[f"{dtype}: {n}"] for n in ("sdpa seed 0", "ferrocupy seed 0",
                                                     "sdpa seed 1"))
        sa, sb, sc = smooth(a), smooth(b), smooth(c)
        skip = min(50, len(sa) - 1)  # the first steps, where every run falls fast
        same = max(abs(x - y) for x, y in zip(sa[skip:], sb[skip:]))
        noise = max(abs(x - y) for x, y in zip(sa[skip:], sc[skip:]))
        tail = lambda xs: sum(xs[-50:]) / len(xs[-50:])  # noqa: E731
        line = (f"{dtype}: last-50 mean loss sdpa {tail(a):.4f}, ferrocupy {tail(b):.4f}, "
                f"sdpa seed 1 {tail(c):.4f}; largest smoothed gap ferrocupy-sdpa {same:.4f}, "
                f"sdpa seed 0-seed 1 (noise) {noise:.4f}: "
                + ("within the noise" if same <= noise else "OUTSIDE the noise"))
        summary.append(line)
        print(line)
    Path(args.out + ".json").write_text(json.dumps({"steps": args.steps, "curves": curves,
                                                    "summary": summary}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        for name, style in (("sdpa seed 0", "-"), ("ferrocupy seed 0", "--"), ("sdpa seed 1", ":")):
            ax.plot(smooth(curves[f"{dtype}: {name}"]), style, label=name)
        ax.set_title(f"{dtype}: {LAYERS}-layer GPT, RoPE + causal GQA {HEADS}/{KV_HEADS}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (20-step mean)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print(f"wrote {args.out}.json, {args.out}.png; ln(256) = {math.log(256):.3f}")


if __name__ == "__main__":
    main()
