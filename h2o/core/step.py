"""The eviction step, written once: the sequencing both paths run, as functions over a small state.

A cut (the end of a prompt, of a prefill chunk, or a schedule's cut, :mod:`h2o.core.schedule`) is, in order:

1. :func:`expire`: what left the sliding window of the newest token goes first;
2. :func:`score`: what the rule ranks: the accumulated attention ``acc``, or its score of the held keys
   (``Policy.cut_score``; the prompt's query statistics are the evicting cache's own, ``CutHooks.cut_state``);
3. :func:`kept`: the rule's priority of the held slots (``Policy.priority``), its order hook (``Policy.cut_order``)
   and the slots it keeps (``Policy.keep``: each head's top count, or one top-k over a pooled layer).

A decoding step (one arriving token, :class:`Arrival`) is, in order: :func:`expire` (or :func:`expire_slots` where
the state is the positions); :func:`step_state` (``acc``, or ``Policy.step_score`` of the held older keys); the
rank and the slot dropped (:func:`evict_slot`: the rule's priority, or its decoder's, then
``h2o.core.policies.select_slot``), or for a pooled layer the layer's cut (:func:`pool_keep`); :func:`place` (the
token's position and a fresh score into its slot) or :func:`place_column` (a column-ordered row); then
``Policy.accumulate`` of its attention.

The simulated path runs these over column-ordered rows (:mod:`h2o.core.simulate`, :mod:`h2o.core.schedule_rows`),
the evicting cache over its slots (:mod:`h2o.core.cache`); a rule's accelerators (``Policy.accelerators``) replace
them where declared, each tested equal. State: :class:`Slots`, :class:`Arrival`, :class:`Forward`, :class:`Rows`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .policies import Counts, Policy, select_slot
from .policies.base import Decoder, along_slots, bcast


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


def expire(held: torch.Tensor, pos: torch.Tensor, now: torch.Tensor | None, window: int | None,
           edge: torch.Tensor | None = None) -> torch.Tensor:
    """held (B, H, S) bool less what is out of the sliding ``window`` of the token at ``now`` (B,) (None: as it
    is): a token leaves once ``pos <= now - window``. ``edge`` (B, 1, 1): ``now - window`` already computed (a row
    loop computes every row's at once)."""
    if window is None:
        return held
    return held & (pos > (bcast(now - window) if edge is None else edge))


def expire_slots(pos: torch.Tensor, now: torch.Tensor, window: int) -> None:
    """:func:`expire` where the state is the positions (B, H, S) (-1: empty): the slots of tokens out of the
    ``window`` of the token at ``now`` (B,) become empty, in place."""
    pos.masked_fill_(pos <= bcast(now - window), -1)


def score(policy: Policy, acc: torch.Tensor, keys: torch.Tensor | None, held: torch.Tensor) -> torch.Tensor:
    """What the rule ranks at a cut: ``acc``, or for a rule that reads the held keys (B, H, S, D) its
    ``Policy.cut_score`` (keys None: ``acc``, as :func:`step_state`)."""
    return policy.cut_score(acc, keys, held) if policy.reads_keys and keys is not None else acc


def kept(policy: Policy, s: Slots, state: torch.Tensor, counts: Counts, order: bool = True) -> torch.Tensor:
    """(B, H, S) bool the slots a cut keeps: the rule's priority of ``state`` over the held slots, told to the
    rule's order hook (``Policy.cut_order``: at every cut but the simulated decode loop's deferred one, ``order``
    False, :func:`h2o.core.schedule_rows.cut`), then its selection (``Policy.keep``)."""
    ranked = s.pos.masked_fill(~s.held, -1) if s.ranked is None else s.ranked
    prio = policy.priority(ranked, state, s.now, counts)
    if order:
        policy.cut_order(s.acc, prio, s.pos, s.held, counts)
    return policy.keep(prio, s.pos, s.held, counts)


def spared(counts: Counts, spare, slots: int) -> Counts:
    """``counts`` where the sequences ``spare`` (B,) (bool list or tensor: a schedule's cut not due for them, its
    ``cuts_after`` differing across the batch) keep all ``slots``: their total raised to it."""
    def lift(c: Counts) -> Counts:
        mask = torch.as_tensor(spare, dtype=torch.bool, device=c.total.device)
        total = torch.where(mask, torch.full_like(c.total, slots), c.total)
        return Counts(total=total, heavy=c.heavy, recent=total - c.heavy, length=c.length)
    out = lift(counts)
    out.host = counts.host and lift(counts.host)
    return out


@dataclass
class Arrival:
    """One arriving token's decision over S slots (the cache's, in any order) or columns (a simulated row's, in
    position order: ``ordered``). pos (B, H, S) int64 positions (the cache: -1 where empty); held (B, H, S) bool
    the slots holding a token (None: every slot, then ``room`` is not read); acc (B, H, S[, ...]); now (B,) the
    arriving token's position; ranked (B, H, S) the positions the priority reads (-1: not held); keys
    (B, H, S, D) the held keys of a rule that reads them (None: it ranks ``acc``), older (B, H, S) bool the held
    slots of the tokens before the arriving one (what the key score reads); room: unordered, (B,) or (B, H, 1)
    bool below budget (:func:`select_slot`); ordered, (B, H|1, 1) the key of a free column (-inf: room, +inf:
    full, :func:`column_key`)."""

    pos: torch.Tensor
    held: torch.Tensor | None
    acc: torch.Tensor
    now: torch.Tensor
    ranked: torch.Tensor
    keys: torch.Tensor | None = None
    older: torch.Tensor | None = None
    room: torch.Tensor | None = None
    ordered: bool = False


def step_state(policy: Policy, a: Arrival, counts: Counts) -> torch.Tensor:
    """What a decoding step's priority reads: ``acc``, or for a rule that reads the held keys its
    ``Policy.step_score`` of the held older keys."""
    return a.acc if a.keys is None else policy.step_score(a.acc, a.keys, a.older, a.pos, counts)


def evict_slot(decoder: Decoder, a: Arrival, host: tuple | None = None) -> torch.Tensor:
    """(B, H, 1) int64 the slot the arriving token takes: the step's state (:func:`step_state`) ranked by the
    rule's ``decoder`` (``Decoder.priority``; ``host``: the cache's (tokens, held, room) lists on the host, what a
    stateful decoder reads), then an empty slot where there is room, else the held slot of lowest priority, the
    oldest on ties (:func:`select_slot`; in position order the first minimum of :func:`column_key`, its answer)."""
    state = step_state(decoder.policy, a, decoder.counts)
    prio = decoder.priority(a.ranked, state, a.now, *(host or (None, None, None)))  # (B, H, S)
    if a.ordered:
        return column_key(a.held, prio, a.room).argmin(-1, keepdim=True)
    return select_slot(prio, a.pos, a.held, a.room)


def pool_keep(policy: Policy, a: Arrival, counts: Counts, arriving: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool the slots a pooled layer (``Policy.pooled``: the heads share the budget) keeps once the
    arriving token is in every head: the step's state ranked by the rule's priority, then ``Policy.keep`` over the
    whole layer, the ``arriving`` (B, H, S) bool slots kept."""
    prio = policy.priority(a.ranked, step_state(policy, a, counts), a.now, counts)  # (B, H, S)
    return policy.keep(prio, a.pos, a.held, counts, arriving=arriving)


def place(pos: torch.Tensor, acc: torch.Tensor, slot: torch.Tensor, now: int | torch.Tensor) -> None:
    """The arriving token into ``slot`` (B, H, 1) of the state, in place: its position ``now`` (one for the whole
    batch, or (B,)) into pos (B, H, S), a fresh score into acc (B, H, S[, ...])."""
    pos.scatter_(-1, slot, now if isinstance(now, int) else now.view(-1, 1, 1).expand(slot.shape))
    acc.scatter_(2, along_slots(slot, acc), 0)


def place_column(keep: torch.Tensor, i: int, tok: torch.Tensor, slot: torch.Tensor | None = None) -> None:
    """A column-ordered row's :func:`place`, in place on keep (B, H, T) bool: clears the dropped column ``slot``
    (B, H, 1) (None: none) and sets column ``i`` where its token is real, tok (B, 1) bool."""
    if slot is not None:
        keep.scatter_(-1, slot, False)
    keep.select(2, i).copy_(tok)


def column_key(keep: torch.Tensor, prio: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """The key whose first minimum is :func:`select_slot`'s slot when slots are columns in position order.

    keep (B, H, T) bool held, prio (B, H, T) of the held, fill (B, 1, 1): -inf where the sequence has room (a free
    column is taken: dropping a column that holds nothing changes nothing), +inf where it is full (a held column of
    lowest priority is dropped). ``argmin`` returns the first minimum, i.e. the oldest held token on ties, as
    select_slot's position tie-break does (tested against it)."""
    return torch.where(keep, prio, fill)


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
