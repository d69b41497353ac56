"""RoPE as plain PyTorch ops, the way model code writes it: Hugging Face's `rotate_half` (Llama;
partial rotary as GPT-NeoX and Phi apply it) and GPT-J's `rotate_every_two` (interleaved pairs).
The angles are SPEC's float32 ones (tests/rope_formula.py), so the comparison measures the
rotation; autograd through these formulas is the gradient the op must give. Used by the CPU and
the CUDA torch tests."""

from __future__ import annotations

import numpy as np
import torch

from rope_formula import inverse_frequencies


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    """Hugging Face's: (x1, x2) -> (-x2, x1) over the two halves."""
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def rotate_every_two(t: torch.Tensor) -> torch.Tensor:
    """GPT-J's: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)


def angles(positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """float32 `[..., S, r/2]` angles `f32(t) * inv_i` of integer positions `[S]` or `[B, S]`."""
    inv = torch.tensor(np.array(inverse_frequencies(rotary_dim, theta), np.float32),
                       device=positions.device)
    return positions.to(torch.float32)[..., None] * inv


def rope_torch(x4: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim=None,
               interleaved: bool = False, dtype=torch.float64) -> torch.Tensor:
    """RoPE of `x4` (`[B, S, H, D]`) at `positions` (`[S]` or `[B, S]`), in `dtype` (cos and sin
    cast to it, as Hugging Face casts them to the activations' dtype)."""
    d = x4.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    freqs = angles(positions, r, theta)
    if interleaved:
        emb, turn = freqs.repeat_interleave(2, dim=-1), rotate_every_two
    else:
        emb, turn = torch.cat((freqs, freqs), dim=-1), rotate_half
    emb = emb.to(torch.float64)
    cos, sin = emb.cos().to(dtype).unsqueeze(-2), emb.sin().to(dtype).unsqueeze(-2)  # heads
    x4 = x4.to(dtype)
    x_rot, x_pass = x4[..., :r], x4[..., r:]
    return torch.cat((x_rot * cos + turn(x_rot) * sin, x_pass), dim=-1)


def bshd(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The `[B, S, H, D]` view of a `[B, S, H, D]`, `[B, S, H*D]` or `[S, H*D]` tensor."""
    if x.dim() == 2:
        return x.unflatten(-1, (-1, head_dim)).unsqueeze(0)
    return x.unflatten(-1, (-1, head_dim)) if x.dim() == 3 else x


def positions_for(x4: torch.Tensor, pos: int, positions) -> torch.Tensor:
    """The positions a call puts its tokens at: `pos + s`, or those given."""
    if positions is None:
        return pos + torch.arange(x4.shape[1], device=x4.device)
    return positions
