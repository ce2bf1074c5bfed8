"""Rotary embeddings for pre-RoPE keys: undo the rotation of a key, quantize, re-apply it on use.

The model rotates a key of column ``p`` (its position in a plain forward) by ``R(p)``: channel pairs
``(i, i + R/2)`` of the first ``R`` channels turn by ``p * inv_freq[i]`` (``rotate_half`` layout of Llama and
GPT-NeoX, partial rotary included). ``rotate(x, cols, inv_freq, -1)`` undoes it, ``+1`` re-applies it.
"""
from __future__ import annotations

import torch

STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")  # frequencies fixed for the whole sequence


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_of(model):
    """The model's rotary embedding module (the first module whose class name ends in ``RotaryEmbedding``)."""
    return next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)


def rotary_inv_freq(model) -> torch.Tensor | None:
    """(R/2,) fp32 inverse frequencies of the model's rotary embedding; None without rotary embeddings."""
    m = rotary_of(model)
    if m is None or not hasattr(m, "inv_freq"):
        return None
    rope_type = getattr(m, "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        from .base import QuantError

        raise QuantError(f"quant.pre_rope=true: rope type {rope_type!r} changes its frequencies with the "
                         f"length; allowed: {', '.join(STATIC_ROPE)} (or quant.pre_rope=false)")
    return m.inv_freq.detach().float()


def rotate(x: torch.Tensor, cols: torch.Tensor, inv_freq: torch.Tensor, sign: int) -> torch.Tensor:
    """x (B, H, S, D), cols (..., S) int broadcastable to (B, H, S) -> x turned by ``sign * cols`` positions."""
    half = inv_freq.numel()
    ang = (sign * cols)[..., None].float() * inv_freq.to(x.device)  # (..., S, R/2)
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
