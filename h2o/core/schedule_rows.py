"""The simulated path under a schedule that cuts (:mod:`h2o.core.schedule`) other than at every step: ``prefill``
(:func:`compressed_once`, cut once at the prompt's end) and one that cuts again after decoding steps
(:func:`interval_rows`: ``interval``), each cut the steps of :mod:`h2o.core.step`, as the evicting cache's.
"""
from __future__ import annotations

import torch

from . import step
from .masks import causal_valid, masked_softmax, positions, serial, with_sinks
from .policies import Policy
from .policies.base import const
from .step import Forward


def compressed_once(policy: Policy, f: Forward) -> torch.Tensor:
    """``compress="prefill"``: the prompt's rows see their prefix; the cache is cut once to the budget at the end
    of the prompt, as the real path's cut (the window first, then the top ``total`` by priority, the scores of the
    prompt's rows, :meth:`Policy.cut_score` of the ``key`` (B, Hkv, T, D), or ``query_score`` of the prompt's
    ``queries`` against ``key`` and ``value``); every later token is kept, so a later
    row sees what the cut kept and every newer token (inside the window). Without a prompt nothing is cut.
    -> (B, Hkv | 1, 1, T, T) bool."""
    logits, valid, prompt_len, window, key = f.logits, f.valid, f.prompt_len, f.window, f.key
    allowed = causal_valid(valid, window) if f.allowed is None else f.allowed  # (B, 1, 1, T, T)
    if not prompt_len:
        return allowed
    B, T = valid.shape
    Hkv = 1 if logits is None else logits.shape[1]
    col = torch.arange(T, device=valid.device)
    pos = positions(valid)  # (B, T)
    posH = pos[:, None, :].expand(B, Hkv, T)
    keep = (valid & (col < prompt_len))[:, None, :].expand(B, Hkv, T)
    acc = policy.new_state(B, Hkv, T, valid.device)  # (B, Hkv, T) the prompt rows' scores (Policy.new_state)
    now = keep[:, 0].sum(-1) - 1
    if policy.needs_scores:
        probs = masked_softmax(logits[..., :prompt_len, :], allowed[..., :prompt_len, :])  # (B, Hkv, G, P, T)
        rows = logits[..., :prompt_len, :] if policy.reads_logits else probs * valid[:, None, None, :prompt_len, None]
        policy.accumulate_prompt(acc, rows, valid[:, :prompt_len], now[:, None] - pos[:, :prompt_len])
    keep = step.expire(keep, posH, now, window)  # the window first: what left it is gone before the policy decides
    if policy.reads_queries:  # the prompt rows' query statistics against the held keys and values
        stats = policy.query_stats(f.queries, prompt_len, pos[:, :prompt_len], now + 1)
        state = policy.query_score(stats, key, f.value, posH, keep)
    else:
        state = step.score(policy, acc, key, keep)
    keep = step.kept(policy, step.Slots(posH, keep, acc, now), state, f.counts, order=False)
    held = keep[:, :, None, None, :] | (col >= prompt_len)  # (B, Hkv, 1, 1, T)
    return torch.where((col < prompt_len)[:, None], allowed, allowed & held)


def cut_rows(policy: Policy, keep: torch.Tensor, posH: torch.Tensor, acc: torch.Tensor, now: torch.Tensor,
             f: Forward, spare: torch.Tensor | None = None) -> torch.Tensor:
    """A cut over the columns held ``keep`` (B, Hkv, T) bool, judged with the token at position ``now`` (B,) in, as
    the evicting cache's cut (:meth:`h2o.core.cache_cut.CutHooks.cut`): the steps of :mod:`h2o.core.step`.
    ``spare`` (B,) bool: the sequences whose cut is not due (they keep what they hold)."""
    keep = step.expire(keep, posH, now, f.window)
    counts = policy.cut_counts(f.counts)
    if spare is not None:
        counts = step.spared(counts, spare, keep.shape[-1])
    return step.kept(policy, step.Slots(posH, keep, acc, now), step.score(policy, acc, f.key, keep), counts)


def interval_rows(policy: Policy, f: Forward) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A schedule that cuts after decoding steps (``compress="interval"``, :mod:`h2o.core.schedule`): the prompt's
    rows see their prefix and the held set is cut to the budget at the prompt's end; each later row adds its token
    (what left the window goes), sees what is held, adds its attention to the scores, and after the real tokens
    since the prompt its ``cuts_after`` names (every ``interval``) the held set is cut back to the budget
    (:func:`cut_rows`). The first token is the prompt where there is none (the evicting
    cache counts from its first forward). -> (mask (B, Hkv, 1, T, T) bool, every row's attention probabilities
    (B, Hkv, G, T, T) fp32, or None where the rule reads no scores)."""
    valid, P, window = f.valid, f.prompt_len, f.window
    B, T = valid.shape
    allowed = causal_valid(valid, window) if f.allowed is None else f.allowed  # (B, 1, 1, T, T)
    Hkv = 1 if f.logits is None else f.logits.shape[1]
    scored = f.logits is not None and policy.needs_scores
    col = torch.arange(T, device=valid.device)
    pos = positions(valid)  # (B, T)
    posH = pos[:, None, :].expand(B, Hkv, T)
    keep = (valid & (col < P))[:, None, :].expand(B, Hkv, T).clone()
    acc = policy.new_state(B, Hkv, T, valid.device)  # (B, Hkv, T) (Policy.new_state)
    out = allowed.expand(B, Hkv, 1, T, T).clone()  # the prompt's rows: their prefix
    seen = torch.empty_like(f.logits) if scored else None  # (B, Hkv, G, T, T)
    if P:
        now = keep[:, 0].sum(-1) - 1
        if scored:
            first = masked_softmax(f.logits[..., :P, :], allowed[..., :P, :], f.sinks)  # (B, Hkv, G, P, T)
            seen[..., :P, :] = first
            rows = f.logits[..., :P, :] if policy.reads_logits else first * valid[:, None, None, :P, None]
            policy.accumulate_prompt(acc, rows, valid[:, :P], now[:, None] - pos[:, :P])
        keep = cut_rows(policy, keep, posH, acc, now, f)
    first = valid[:, :P].sum(-1, keepdim=True).clamp(min=1)  # (B, 1) the prompt's tokens (none: the first token)
    generated = pos - first + 1  # (B, T) tokens since the prompt
    below = (f.counts.total[:, None] - first).clamp(min=0)  # (B, 1) the room the prompt's cut leaves below budget
    due = valid & (col >= P) & (generated > 0) & policy.schedule.cuts_after(generated, below)  # (B, T) a cut after
    cuts, uneven = due.any(0).tolist(), (due.any(0) & ~due.all(0)).tolist()  # the one host read
    low = const(torch.finfo(torch.float32).min, torch.float32, valid.device)
    sink_row = None if f.sinks is None else f.sinks.view(1, *f.sinks.shape[1:3], 1)  # (1, Hkv, G, 1)
    with serial(valid.device):
        for i in range(P, T):
            tok = valid[:, i]  # (B,)
            step.place_column(keep, i, tok.view(B, 1))
            if window is not None:  # out of the window: gone (a pad row: nothing leaves)
                keep = step.expire(keep, posH, pos[:, i], window)
            row = keep.unsqueeze(2)  # (B, Hkv, 1, T)
            out.select(-2, i).copy_(row)
            if scored:
                p = torch.where(row, f.logits.select(-2, i), low)  # (B, Hkv, G, T)
                p = torch.softmax(p, -1) if sink_row is None else with_sinks(p, sink_row)
                seen.select(-2, i).copy_(p)
                p = p.unsqueeze(-2) * tok.to(p.dtype).view(B, 1, 1, 1, 1)  # (B, Hkv, G, 1, T): pad rows add nothing
                step.accumulate(policy, acc, f.logits[..., i:i + 1, :] if policy.reads_logits else p, tok.view(B, 1))
            if cuts[i]:
                keep = cut_rows(policy, keep, posH, acc, pos[:, i], f, ~due[:, i] if uneven[i] else None)
    return out, seen
