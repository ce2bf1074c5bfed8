"""The eviction step, written once: the sequencing both paths run, as functions over a small state.

A cut (the end of a prompt, of a prefill chunk, or a schedule's cut, :mod:`h2o.core.schedule`) is, in order:

1. :func:`expire`: what left the sliding window of the newest token goes first;
2. :func:`score`: what the rule ranks: the accumulated attention ``acc``, or its score of the held keys
   (``Policy.cut_score``; the prompt's query statistics are the evicting cache's own, ``CutHooks.cut_state``);
3. :func:`kept`: the rule's priority of the held slots (``Policy.priority``), its order hook (``Policy.cut_order``)
   and the slots it keeps (``Policy.keep``: each head's top count, or one top-k over a pooled layer).

The simulated path runs it over column-ordered rows (:mod:`h2o.core.simulate`), the evicting cache over its slots
(:mod:`h2o.core.cache_cut`); the decoding step (one arriving token) adds the slot choice
(``h2o.core.policies.select_slot``) and its accelerators (``Policy.decoder``, ``Policy.held_rows``, the Triton row
kernel), each tested equal to the step.

State (S = slots or columns): :class:`Slots` (positions, the held ones, ``acc``, the newest token); a simulated
forward's inputs :class:`Forward`; its row recurrence's :class:`Rows`; what transformers passes a layer beside
queries, keys and values :class:`LayerCall`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .policies import Counts, Policy
from .policies.base import bcast


@dataclass
class Slots:
    """The held state at a cut: pos (B, H, S) int64 positions (as ``Policy.keep`` reads them for ties), held
    (B, H, S) bool, acc (B, H, S[, ...]) the rule's state per slot, now (B,) the newest token's position; ranked
    (B, H, S): the positions the priority reads, -1 where not held (None: ``pos`` masked here)."""

    pos: torch.Tensor
    held: torch.Tensor
    acc: torch.Tensor
    now: torch.Tensor
    ranked: torch.Tensor | None = None


def expire(held: torch.Tensor, pos: torch.Tensor, now: torch.Tensor, window: int | None) -> torch.Tensor:
    """held (B, H, S) bool less what is out of the sliding ``window`` of the token at ``now`` (B,) (None: as it
    is): a token leaves once ``pos <= now - window``."""
    return held if window is None else held & (pos > bcast(now - window))


def score(policy: Policy, acc: torch.Tensor, keys: torch.Tensor | None, held: torch.Tensor) -> torch.Tensor:
    """What the rule ranks at a cut: ``acc``, or for a rule that reads the held keys (B, H, S, D) its
    ``Policy.cut_score``."""
    return policy.cut_score(acc, keys, held) if policy.reads_keys else acc


def kept(policy: Policy, s: Slots, state: torch.Tensor, counts: Counts, order: bool = True) -> torch.Tensor:
    """(B, H, S) bool the slots a cut keeps: the rule's priority of ``state`` over the held slots, told to the
    rule's order hook (``order``: a prompt's cut, ``Policy.cut_order``), then its selection (``Policy.keep``)."""
    ranked = s.pos.masked_fill(~s.held, -1) if s.ranked is None else s.ranked
    prio = policy.priority(ranked, state, s.now, counts)
    if order:
        policy.cut_order(s.acc, prio, s.pos, s.held, counts)
    return policy.keep(prio, s.pos, s.held, counts)


@dataclass
class Forward:
    """One simulated forward as a layer's mask reads it: logits (B, Hkv, G, T, T) fp32 (None: a rule that reads
    no scores, the mask alone), allowed (B, 1, 1, T, T) bool causal, padding and window (None: built here), valid
    (B, T) bool, the prompt's columns, the layer's budget, sliding window, sink logits, keys and values
    (B, Hkv, T, D) (a rule that reads them) and the prompt's queries before RoPE (``Policy.reads_queries``)."""

    logits: torch.Tensor | None
    allowed: torch.Tensor | None
    valid: torch.Tensor
    prompt_len: int
    counts: Counts
    window: int | None = None
    sinks: torch.Tensor | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    queries: Any = None


@dataclass
class Rows:
    """The simulated row recurrence's state: pos (B, T) each column's position (-1: a pad), posH (B, Hkv, T) the
    same per KV head, keep (B, Hkv, T) bool held, acc (B, Hkv, T[, ...]), out (B, Hkv, G|1, T, T) bool the rows'
    masks (written), start the first row walked, padded (a walked row may be a pad), seen (B, Hkv, G, T, T) every
    row's attention (written; None: not kept), cut_at the prompt's length where its cut left a slot free (0:
    none)."""

    pos: torch.Tensor
    posH: torch.Tensor
    keep: torch.Tensor
    acc: torch.Tensor
    out: torch.Tensor
    start: int
    padded: bool = True
    seen: torch.Tensor | None = None
    cut_at: int = 0


@dataclass
class LayerCall:
    """What one layer's attention is given beside queries, keys and values: the prompt's columns (simulated), the
    forward's shared plan (simulated), the layer's sliding window, logit soft-cap, sink logits, (index, layers) and
    the forward's queries before RoPE (:class:`h2o.core.prerope.Queries`)."""

    prompt_len: int = 0
    plan: tuple | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    layer: tuple[int, int] | None = None
    queries: Any = None
