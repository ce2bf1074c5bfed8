"""One evicting layer fed by hand, as real_attention feeds it: the held positions after every decoding step (shared
by the tests of the incremental decoders and of the accelerators against the plain step)."""
from __future__ import annotations

import torch

from h2o.core.cache import EvictingLayer

H, D = 2, 1  # heads, head dim: the keys and values are zeros, only positions and scores matter


def feed(layer, valid: torch.Tensor) -> None:
    """What real_attention does with a forward of valid (B, q) columns: update, positions, cut after a chunk."""
    B, q = valid.shape
    layer.update(torch.zeros(B, H, q, D), torch.zeros(B, H, q, D))
    if layer.n_new:
        layer.register_new(valid[:, -layer.n_new:])
    if q > 1:
        layer.cut()


def held_after_each_step(policy, prompts: list[int], steps: int, chunk_at: int, seed: int):
    """Prefill left-padded prompts, decode ``steps`` tokens (a 3-token chunk at step ``chunk_at``); the held
    positions (B, H, slots) after every step, and the layer. Scores: random integers added to the held tokens
    (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    layer = EvictingLayer(policy)
    T = max(prompts)
    feed(layer, torch.arange(T)[None, :] >= torch.tensor([T - p for p in prompts])[:, None])
    states = []
    for t in range(steps):
        feed(layer, torch.ones(len(prompts), 3 if t == chunk_at else 1, dtype=torch.bool))
        layer.acc += torch.randint(0, 3, layer.acc.shape, generator=g).float() * (layer.pos >= 0)
        states.append(layer.pos.clone())
    return states, layer
