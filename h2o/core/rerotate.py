"""Positions inside the cache, for any policy: key re-rotation (StreamingLLM's numbering; kvpress's
``KeyRerotationPress`` wraps any scorer the same way).

After each forward, the tokens a layer holds are numbered 0..n-1 in text order and the next forward's tokens get
n, n+1, ...; so no position ever exceeds the budget plus a chunk. Keys are cached after the rotary embedding, and
rotary embeddings are rotations, R(p + d) k = R(d) R(p) k: every kept key whose number changed (a token before
it was evicted) is rotated by the change d (negative) with the model's own inverse frequencies. Each key is
rotated once from the key as it entered the cache, never cumulatively: repeated half-precision rotations drift
(bf16: 26% mean relative error after 1,000 shifts).

:class:`KeyRerotation` is the state of one layer (the evicting layer owns it when its cache is built with
``rerotate=``, and applies it after its policy's eviction at the end of each forward, whatever the policy).
"""
from __future__ import annotations

import torch

from .quant.rope import STATIC_ROPE, rotary_of, rotate


class KeyShifter:
    """Moves cached (already rotated) keys by ``delta`` positions: R(p + d) k = R(d) R(p) k."""

    def __init__(self, model):
        rot = rotary_of(model)
        if not hasattr(rot, "inv_freq"):  # None too
            raise ValueError(f"positions='cache' needs a rotary model; {type(model).__name__} has no rotary embedding "
                             f"(use positions='true')")
        rope_type = getattr(rot, "rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise ValueError(f"positions='cache': rope type {rope_type!r} changes its frequencies with the length; "
                             f"allowed: {', '.join(STATIC_ROPE)} (or positions='true')")
        self.inv_freq = rot.inv_freq.detach().float()  # (R/2,): the first R dims of a head are rotated

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys (B, H, S, D), delta (B, H, S) int -> keys moved by delta positions (a new tensor), computed in
        fp32 and rounded once to the keys' dtype."""
        return rotate(keys, delta, self.inv_freq, 1).to(keys.dtype)


class KeyRerotation:
    """One layer's numbering: which key each held token entered with, and at which number."""

    def __init__(self, shifter: KeyShifter):
        self.shifter = shifter
        self.prev: torch.Tensor | None = None  # (B, H, n) sorted true positions held after the last forward
        self.entered: tuple | None = None  # (keys (B, H, n, D) as they entered, their number then), sorted
        self.n = 0  # tokens held per KV head (equal across heads); the next forward starts at number n

    def renumber(self, pos: torch.Tensor, keys: torch.Tensor, first_new, held: int | None = None) -> torch.Tensor:
        """After a forward whose first token had true position ``first_new`` (an int or (B,)): pos (B, H, S) true
        positions held (-1 empty), keys (B, H, S, D) -> the keys at numbers 0..n-1 (``held``: n, None: read)."""
        valid, n = pos >= 0, held
        if n is None:
            counts = valid.sum(-1)
            n = int(counts.max())
            if int(counts.min()) != n:
                raise RuntimeError(f"heads hold different numbers of tokens ({counts.tolist()})")
        first_new = torch.as_tensor(first_new, device=pos.device).view(-1, 1, 1)
        new = pos >= first_new
        entry_keys, entry = keys, torch.where(new, self.n + pos - first_new, 0)  # number at entry
        if self.prev is not None:  # a kept old token: its key and number as it entered, found by position
            old = torch.searchsorted(self.prev, pos.clamp(min=0).contiguous()).clamp(max=self.n - 1)
            prev_keys, prev_entry = self.entered
            idx = old[..., None].expand(-1, -1, -1, prev_keys.shape[-1])
            entry_keys = torch.where(new[..., None], keys, prev_keys.gather(-2, idx))
            entry = torch.where(new, entry, prev_entry.gather(-1, old))
        key = torch.where(valid, pos, torch.iinfo(torch.int64).max)
        sorted_pos, order = key.sort(-1)
        rank = order.argsort(-1)  # the inverse permutation: each slot's rank in position order
        delta = torch.where(valid, rank - entry, 0)
        first = order[..., :n]
        self.entered = (entry_keys.gather(-2, first[..., None].expand(-1, -1, -1, entry_keys.shape[-1])),
                        entry.gather(-1, first))
        self.prev, self.n = sorted_pos[..., :n].contiguous(), n
        return self.shifter.rotate(entry_keys, delta)  # once from the entered key, in fp32


def held_alike(rotations: list[KeyRerotation]) -> int:
    """The tokens every layer holds (RuntimeError naming the first layer that holds another number)."""
    held = rotations[0].n
    for i, rot in enumerate(rotations):
        if rot.n != held:
            raise RuntimeError(f"layer {i} holds {rot.n} tokens, layer 0 {held}")
    return held
