"""Queries before the rotary embedding, for a policy that reads them (``Policy.reads_queries``: expected_attention).

The attention function is handed the queries after RoPE. RoPE turns each channel pair ``(i, i + r/2)`` of the first
``r`` channels by a known angle, so the query before it is recovered exactly from the ``(cos, sin)`` the module
applied: a forward pre-hook on each attention module (:class:`RopeTap`) keeps the ``position_embeddings`` that
transformers passes it, and :meth:`Queries.before_rope` turns the queries back. Why this and not kvpress's
recomputation ``W_q x`` from the layer's hidden states (``get_prerope_query_states``): the projection's layout
differs per architecture (fused qkv in GPT-NeoX, q_norm in Gemma-3 and Qwen-3, ...), the rotation is the same
for every RoPE model, and what comes back is the query the model attended with (q_norm included), exact up to
rounding. The cos and sin carry the rope's attention scaling ``a`` (YaRN): ``cos^2 + sin^2 = a^2`` is divided out.
Partial rotary (GPT-NeoX's ``rotary_pct``): the channels past ``r`` were not turned and pass as they are.

The rotation at other positions (a policy's future ones) comes from the model's own rotary module, called as the
model calls it (with the layer's type where the rotary keeps one per type: Gemma-3's sliding and global layers).

Refused at attach in one line (:func:`rope_taps`): no rotary module, or an attention module that is not given
``position_embeddings`` (OPT, GPT-2: no RoPE); a rope type whose frequencies change with the length (dynamic NTK);
a layout other than rotate-half (the two halves of cos differ: interleaved RoPE) or a rotary wider than a head.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .policies import PolicyError
from .quant.rope import STATIC_ROPE, rotary_of

PROBE = (0, 1, 7, 100)  # positions of the layout check at attach


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., r) -> (..., r): ``[-x2, x1]`` (the rotate-half layout of Llama, GPT-NeoX, Gemma, Mistral, Qwen)."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


@dataclass
class Queries:
    """One forward's queries after RoPE (B, Hq, T, D) with the (cos, sin) (B | 1, T, r) the module applied to
    them, and the layer's rotary (:meth:`RopeTap.at`) for other positions."""

    post: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    tap: "RopeTap"

    def before_rope(self, rows: int) -> torch.Tensor:
        """(B, Hq, rows, D) the first ``rows`` queries before RoPE, in at least fp32: the inverse rotation
        ``x = (cos y - sin rotate_half(y)) / (cos^2 + sin^2)`` on the first r channels, the rest as they are."""
        y = self.post[..., :rows, :]
        y = y.to(torch.promote_types(y.dtype, torch.float32))
        cos, sin = (t[:, None, :rows].to(y.dtype) for t in (self.cos, self.sin))  # (B | 1, 1, rows, r)
        r = cos.shape[-1]
        turned = y[..., :r]
        back = (turned * cos - rotate_half(turned) * sin) / (cos * cos + sin * sin)
        return back if r == y.shape[-1] else torch.cat([back, y[..., r:]], -1)


class RopeTap:
    """One attention module's rotary embedding: the (cos, sin) it was given in the current forward (kept by
    :meth:`capture`, a forward pre-hook) and the model's rotary module for any positions."""

    def __init__(self, rotary, module):
        self.rotary, self.module = rotary, module
        params = inspect.signature(rotary.forward).parameters
        types = getattr(module.config, "layer_types", None)
        self.kind = (types[module.layer_idx],) if "layer_type" in params and types else ()  # Gemma-3
        self.signature = inspect.signature(module.forward)
        self.applied: tuple[torch.Tensor, torch.Tensor] | None = None

    def capture(self, module, args, kwargs) -> None:
        """Forward pre-hook (with kwargs): keep the forward's ``position_embeddings``."""
        applied = kwargs.get("position_embeddings")
        if applied is None and args:
            applied = self.signature.bind_partial(*args, **kwargs).arguments.get("position_embeddings")
        self.applied = applied

    def queries(self, post: torch.Tensor) -> Queries:
        """The forward's queries (B, Hq, T, D) after RoPE with what unrotates them."""
        if self.applied is None:
            raise RuntimeError(f"layer {self.module.layer_idx}: the attention module was not given "
                               f"position_embeddings in this forward; the queries cannot be turned back")
        cos, sin = self.applied
        return Queries(post, cos, sin, self)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, N) int64 -> (cos, sin) (B, N, r) fp32, as the model's rotary computes them."""
        probe = torch.zeros((), dtype=torch.float32, device=positions.device)  # sets the dtype and device only
        cos, sin = self.rotary(probe, positions, *self.kind)
        return cos.float(), sin.float()


def rope_taps(model, modules, policy_name: str) -> dict[int, RopeTap]:
    """{layer index: :class:`RopeTap`} for the attention ``modules``, hooks not yet registered; PolicyError in
    one line where the queries before RoPE cannot be had (module doc)."""
    kind = getattr(modules[0].config, "model_type", type(model).__name__)

    def refuse(why: str) -> PolicyError:
        return PolicyError(f"policy={policy_name}: model_type={kind} {why}; allowed: a model with rotary embeddings "
                           f"in rotate-half layout (Llama, Mistral, Qwen, Gemma, GPT-NeoX)")

    rotary = rotary_of(model)
    takes = all("position_embeddings" in inspect.signature(m.forward).parameters for m in modules)
    if rotary is None or not takes:
        raise refuse("has no rotary embedding (its queries carry no rotation to undo)")
    rope_type = getattr(rotary, "rope_type", "default")
    types = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
    dynamic = sorted(t for t in types if t not in STATIC_ROPE)
    if dynamic:
        raise refuse(f"has rope type {dynamic[0]!r}, whose frequencies change with the length (the rotation of "
                     f"the future positions is not fixed; allowed types: {', '.join(STATIC_ROPE)})")
    taps = {m.layer_idx: RopeTap(rotary, m) for m in modules}
    device = next(model.parameters()).device
    for i, tap in taps.items():
        cos, _ = tap.at(torch.tensor([PROBE], device=device))  # (1, len(PROBE), r)
        r, h = cos.shape[-1], cos.shape[-1] // 2
        m = tap.module
        head = getattr(m, "head_dim", None) or getattr(m, "head_size", None) or \
            m.config.hidden_size // m.config.num_attention_heads
        if r % 2 or r > head or not torch.equal(cos[..., :h], cos[..., h:]):
            raise refuse(f"layer {i}: its rotary is not in rotate-half layout over at most a head "
                         f"({r} channels of {head})")
    return taps
