"""A Hugging Face transformers backend: `register()` makes `attn_implementation="ferrocupy"` run
every attention layer of a model through `ferrocupy.torch.attention`.

    import ferrocupy.transformers
    ferrocupy.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrocupy")

transformers (and PyTorch) are imported by `register()`, not by importing this module; nothing
else in ferrocupy imports transformers.

What transformers hands an attention function, and what becomes of it here:
- `query` `[B, H, Sq, D]`, `key`/`value` `[B, Hkv, Sk, D]`: passed as `x.transpose(1, 2)`, views in
  ferrocupy's `[B, S, H, D]` layout that `ferrocupy.torch.attention` reads in place; grouped-query
  heads go in as they are (`H % Hkv == 0`), never repeated.
- `attention_mask`: the mask function registered with `AttentionMaskInterface` is transformers'
  own `sdpa_mask`, so the model builds what it builds for `sdpa`: a 4-D bool mask (True: attend)
  that already holds causality, padding (left or right) and any sliding window, or None where the
  plain causal pattern holds. A mask is applied as it is (`attn_mask`), with `causal` and `window`
  off: the mask's query and key positions depend on the cache (a static cache's unwritten slots, a
  sliding layer's offset), which the shapes do not tell. Padding becomes a mask rather than
  `kv_lens`: left padding is not a prefix length, and `kv_lens` has no backward.
- No mask: causal attention where the module (or the `is_causal` argument) is causal. One query
  (a decode step) is the newest token, bottom-right aligned (`causal_offset = Sk - 1`); several
  queries over as many keys are aligned either way; several queries over more keys occur only when
  a static cache was empty (its unwritten slots follow the queries), top-left (`causal_offset =
  0`), as SDPA's `is_causal` reads it. `sliding_window` then becomes `window`: transformers' rule
  `q - sliding_window < k <= q` is ferrocupy's `causal` with `|a - j| < window`.
- `scaling` becomes `scale`; `dropout` (transformers passes it non-zero only in training) becomes
  `dropout_p`, seeded from torch's default generator.
- `softcap` (Gemma 2's `attn_logit_softcapping`) and attention sinks (gpt-oss's `s_aux`, cast to
  float32) go to `ferrocupy.torch.attention`'s `softcap=` and `sinks=` (every backend and
  kernel path takes both).
  `position_bias` (T5-style relative bias) raises NotImplementedError.
- The returned weights are None (as with `sdpa`): `output_attentions=True` needs `eager`.
"""

from __future__ import annotations

__all__ = ["attention_forward", "register"]


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling=None, sliding_window=None, softcap=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature: `(attn_output [B, Sq, H, D], None)`."""
    from .torch import attention

    # gpt-oss passes its learned sinks as s_aux ([H], the model's dtype): one extra logit per
    # head in each row's softmax denominator, ferrocupy's float32 `sinks` (differentiable).
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        sinks = sinks.float()
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            f"ferrocupy's transformers backend takes no position_bias (module "
            f"{type(module).__name__}); use attn_implementation='sdpa' or 'eager'")
    Sq, Sk = query.shape[2], key.shape[2]
    causal = window = offset = 0
    if attention_mask is None:  # a mask holds causality and the window itself (module docstring)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # One query: the newest token (bottom-right). Several: their keys start at position 0
        # (Sk == Sq, or an empty static cache's unwritten slots follow), so top-left.
        offset = Sk - 1 if Sq == 1 else 0
        window = (sliding_window or 0) if causal else 0
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    causal=bool(causal), causal_offset=offset, window=window,
                    dropout_p=float(dropout), attn_mask=attention_mask, scale=scaling,
                    softcap=float(softcap or 0.0), sinks=sinks)
    return out, None


def register(name: str = "ferrocupy") -> None:
    """Register ferrocupy under `name` with `transformers.AttentionInterface` (the attention
    function) and `transformers.AttentionMaskInterface` (SDPA's mask form: a bool mask or None),
    so that `from_pretrained(..., attn_implementation=name)` and `from_config(...)` use it.
    Registering again replaces the earlier entry."""
    import transformers

    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as e:
        raise ImportError(
            f"ferrocupy.transformers.register needs transformers' AttentionInterface, "
            f"AttentionMaskInterface and masking_utils.sdpa_mask (tested with transformers 5.17 "
            f"and 5.25); this is transformers {transformers.__version__}: {e}") from e

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
