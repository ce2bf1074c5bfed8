"""The simulated path's cut, under every schedule (:mod:`h2o.core.schedule`), and the state its row walk
(:func:`h2o.core.simulate.walk`) starts from: :func:`cut` (the one cut over held columns: the prompt's, and each
later one a schedule names, :func:`scheduled_cuts`), :func:`first_rows` (the rows before the walk: their prefix,
their attention accumulated, the prompt's cut) and :func:`compressed_once` (``prefill``'s closed form of the walk:
cut once at the prompt's end, every row at once; tested equal to the walk), each cut the steps of
:mod:`h2o.core.step`, as the evicting cache's.
"""
from __future__ import annotations

import torch

from . import step
from .masks import causal_valid, masked_softmax, positions
from .policies import Policy
from .step import Forward, Rows


def cut(policy: Policy, f: Forward, keep: torch.Tensor, posH: torch.Tensor, acc: torch.Tensor, now: torch.Tensor,
        spare: torch.Tensor | None = None, deferred: bool = False) -> torch.Tensor:
    """(B, Hkv, T) bool the columns a cut keeps of the held ``keep`` (B, Hkv, T) bool (positions ``posH``), judged
    with the token at position ``now`` (B,) in, as the evicting cache's cut (:meth:`h2o.core.cache_cut.CutHooks.cut`)
    in :mod:`h2o.core.step`'s order: what left ``f.window`` goes; the rule's score (:func:`step.score` of ``acc``
    (B, Hkv, T[, ...]) and the held keys ``f.key``, or for a rule that reads the prompt's queries, at the prompt's
    cut, ``query_score`` of their statistics against the held keys and values); then :func:`step.kept` with the
    cut's counts (``Policy.cut_counts``; ``spare`` (B,) bool: the sequences whose cut is not due keep all they hold,
    :func:`step.spared`) and its order hook (``Policy.cut_order``), as every cut of the real path.

    ``deferred``: the decode loop's start past the prompt (:func:`h2o.core.simulate.row_plan`: no sequence's budget
    is full before it), where the prompt's cut is taken. The real path's cut at the prompt's end dropped nothing
    and its decoding steps since took free slots: so the budget as it is (the room ``cut_counts`` leaves is taken)
    and no order hook (it orders what a cut keeps of more than its count; a sliding window's gaps are no drop)."""
    keep = step.expire(keep, posH, now, f.window)  # the window first: what left it is gone before the policy decides
    if policy.reads_queries:  # the prompt rows' query statistics against the held keys and values
        stats = policy.query_stats(f.queries, f.prompt_len, posH[:, 0, :f.prompt_len], now + 1)
        state = policy.query_score(stats, f.key, f.value, posH, keep)
    else:
        state = step.score(policy, acc, f.key, keep)
    counts = f.counts if deferred else policy.cut_counts(f.counts)
    if spare is not None:
        counts = step.spared(counts, spare, keep.shape[-1])
    return step.kept(policy, step.Slots(posH, keep, acc, now), state, counts, order=not deferred)


def first_rows(policy: Policy, f: Forward, start: int, seen: bool = True) -> Rows:
    """The row walk's state at row ``start`` (:class:`h2o.core.step.Rows`, ``out`` not built): the rows before it
    see their prefix (``f.allowed``); a rule that reads the scores adds their attention (B, Hkv, G, start, T) to
    ``acc`` (B, Hkv, T[, ...]) (``Policy.new_state``), the prompt's as a prompt's (``Policy.accumulate_prompt``,
    told each row's place; where the decode loop starts past the prompt, all of them as rows,
    ``Policy.accumulate``), and keeps them in ``seen`` (B, Hkv, G, T, T) where asked; then the prompt's :func:`cut`
    (``deferred`` past the prompt). ``cut_at``: the prompt's length where its cut left a slot
    free (``Policy.cut_room``)."""
    logits, valid, P = f.logits, f.valid, f.prompt_len
    B, T = valid.shape
    Hkv = 1 if logits is None else logits.shape[1]
    pos = positions(valid)  # (B, T)
    posH = pos[:, None, :].expand(B, Hkv, T)
    keep = (valid & (torch.arange(T, device=valid.device) < start))[:, None, :].expand(B, Hkv, T).clone()
    acc = policy.new_state(B, Hkv, T, valid.device)  # (B, Hkv, T) (Policy.new_state)
    r = Rows(pos, posH, keep, acc, None, start)
    now = keep[:, 0].sum(-1) - 1  # (B,) the newest token before ``start``
    deferred = start > P  # the decode loop starts past the prompt (row_plan): the prompt's cut is taken there
    if logits is not None and policy.needs_scores:
        first = masked_softmax(logits[..., :start, :], f.allowed[..., :start, :], f.sinks)  # (B, Hkv, G, start, T)
        rows = logits[..., :start, :] if policy.reads_logits else first * valid[:, None, None, :start, None]
        if deferred:  # every row before the start as a decoding row (one sum)
            policy.accumulate(acc, rows, valid[:, :start])
        elif start:
            policy.accumulate_prompt(acc, rows, valid[:, :start], now[:, None] - pos[:, :start])
        if seen:
            r.seen = torch.empty_like(logits)  # (B, Hkv, G, T, T) every row's attention probabilities
            r.seen[..., :start, :] = first
    if policy.evicts and start > 0:  # the prompt's cut, judged with its last token in
        r.keep = cut(policy, f, keep, posH, acc, now, deferred=deferred)
        r.cut_at = P if start == P and policy.cut_room else 0  # a prompt's cut leaves a slot free
    return r


def scheduled_cuts(policy: Policy, f: Forward, pos: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The rows after which a schedule that cuts later cuts (:meth:`h2o.core.schedule.Schedule.cuts_after`, told the
    real tokens since the prompt; the first token is the prompt where there is none, as the evicting cache counts
    from its first forward), pos (B, T) -> (due (B, T) bool per sequence, per row 0 (none), 2 (every sequence's)
    or 3 (some sequences': the others are spared)): the one host read."""
    valid, P = f.valid, f.prompt_len
    first = valid[:, :P].sum(-1, keepdim=True).clamp(min=1)  # (B, 1) the prompt's tokens (none: the first token)
    generated = pos - first + 1  # (B, T) tokens since the prompt
    below = (f.counts.total[:, None] - first).clamp(min=0)  # (B, 1) the room the prompt's cut leaves below budget
    col = torch.arange(valid.shape[1], device=valid.device)
    due = valid & (col >= P) & (generated > 0) & policy.schedule.cuts_after(generated, below)  # (B, T)
    return due, (due.any(0).long() * 2 + (due.any(0) & ~due.all(0))).tolist()


def compressed_once(policy: Policy, f: Forward) -> torch.Tensor:
    """``compress="prefill"``'s closed form of the row walk (:func:`h2o.core.simulate.walk` under a schedule that
    cuts once): the prompt's rows see their prefix; the cache is cut once to the budget at the end of the prompt
    (:func:`first_rows`: the prompt rows' scores, :meth:`Policy.cut_score` of the ``key`` (B, Hkv, T, D), or
    ``query_score`` of the prompt's ``queries`` against ``key`` and ``value``); every later token is kept, so a
    later row sees what the cut kept and every newer token (inside the window). Equal to the walk on every row of a
    real token (a pad row's output is not read; on a sliding layer the walk's pad row sees what the last real row
    held). Without a prompt nothing is cut. -> (B, Hkv | 1, 1, T, T) bool."""
    f.allowed = causal_valid(f.valid, f.window) if f.allowed is None else f.allowed  # (B, 1, 1, T, T)
    P = f.prompt_len
    if not P:
        return f.allowed
    col = torch.arange(f.valid.shape[1], device=f.valid.device)
    held = first_rows(policy, f, P, seen=False).keep[:, :, None, None, :] | (col >= P)  # (B, Hkv, 1, 1, T)
    return torch.where((col < P)[:, None], f.allowed, f.allowed & held)
