"""Simulated path: one forward pass in which query row i attends only to what the policy holds at step i.

This is how lm-eval tasks are scored (one forward per request). The full keys stay in memory; the mask is built
row by row with the same eviction step as the evicting cache (:func:`h2o.core.policies.select_slot`), so feeding the
tokens one by one through :class:`h2o.core.cache.EvictingCache` gives the same logits.

Layout: G = query heads per KV head. logits (B, Hkv, G, T, T); state (B, Hkv, T) per KV head.
With ``prompt_len = P`` the first P columns are a prompt: rows < P see their whole prefix (the real path's
prefill), the state is then cut to the budget and rows >= P are decoding steps. Budget ratios are then taken of
the prompt's length, as in generation; without a prompt, of the sequence's length.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .policies import Policy, keep_top, select_slot
from .policies.h2o import H2O, reference_mask


def positions(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool non-pad -> (B, T) int64 position of each token in its own sequence, -1 for pads."""
    return torch.where(valid, valid.long().cumsum(-1) - 1, -1)


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over allowed keys; a row with none allowed is uniform (finite, like transformers' eager)."""
    logits = logits.float().masked_fill(~allowed, torch.finfo(torch.float32).min)
    return torch.softmax(logits, dim=-1)


@contextmanager
def serial(device: torch.device):
    """One CPU thread for loops of tiny ops: waking a second thread costs more than each op (measured 40x)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, Hq, T, D) -> (B, Hkv, G, T, D)."""
    B, Hq, T, D = query.shape
    return query.view(B, n_kv, Hq // n_kv, T, D)


def grouped_scores(q: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q (B, Hkv, G, r, D) @ key (B, Hkv, S, D)^T -> (B, Hkv, G, r, S), the group folded into the rows (one read of K)."""
    B, Hkv, G, r, D = q.shape
    return (q.reshape(B, Hkv, G * r, D) @ key.transpose(-1, -2)).view(B, Hkv, G, r, -1)


def grouped_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs (B, Hkv, G, r, S) @ value (B, Hkv, S, D) -> (B, Hkv, G, r, D), one read of V."""
    B, Hkv, G, r, S = probs.shape
    return (probs.reshape(B, Hkv, G * r, S) @ value).view(B, Hkv, G, r, -1)


def simulated_attention(policy: Policy, query, key, value, valid, scaling: float,
                        prompt_len: int = 0, semantics: str = "h2o"):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D), valid (B, T) bool -> out (B, T, Hq, D), probs (B, Hq, T, T)."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    q = grouped(query, Hkv)  # (B, Hkv, G, T, D)
    logits = grouped_scores(q, key).float() * scaling  # (B, Hkv, G, T, T)
    idx = torch.arange(T, device=query.device)
    allowed = (idx[None, :] <= idx[:, None]) & valid[:, None, None, None, :]  # (B, 1, 1, T, T) causal + padding
    if semantics == "reference":
        allowed = allowed & reference_allowed(policy, logits, allowed, valid)
    elif not policy.is_full:
        allowed = policy_allowed(policy, logits, allowed, valid, prompt_len)
    probs = masked_softmax(logits, allowed)  # (B, Hkv, G, T, T)
    out = grouped_values(probs.to(value.dtype), value)  # (B, Hkv, G, T, D)
    return out.reshape(B, Hq, T, D).transpose(1, 2), probs.reshape(B, Hq, T, T)


def reference_allowed(policy: Policy, logits, allowed, valid):
    """The paper code's rule (``h2o.core.policies.h2o.reference_mask``), one unpadded sequence at a time."""
    if not isinstance(policy, H2O) or not bool(valid.all()):
        raise ValueError(f"semantics=reference: needs policy h2o/h2_only on unpadded input, got {policy.name}")
    counts = policy.counts(valid.sum(-1))
    heavy, recent = int(counts.heavy[0]), int(counts.recent[0])
    causal_logits = logits.masked_fill(~allowed, -float("inf"))
    return reference_mask(causal_logits, heavy, recent)


def policy_allowed(policy: Policy, logits, allowed, valid, prompt_len: int) -> torch.Tensor:
    """(B, Hkv, G|1, T, T) bool mask of what each row sees under ``policy``."""
    B, Hkv, G, T, _ = logits.shape
    pos = positions(valid)  # (B, T)
    ref_len = valid[:, :prompt_len].sum(-1) if prompt_len else valid.sum(-1)
    counts = policy.counts(ref_len)
    if not policy.evicts and not policy.needs_scores:  # top-k: a pure function of each row's logits
        rows = (torch.arange(T, device=logits.device) >= prompt_len)[:, None]  # (T, 1) decoding rows
        return torch.where(rows, policy.restrict(logits, None, allowed, counts), allowed)

    # rows < start need no eviction: the prompt, and the steps before any sequence's budget is full
    filled = (valid.long().cumsum(-1) <= counts.total[:, None]).sum(-1)  # (B,) columns before a full cache
    start = prompt_len if not policy.evicts else max(prompt_len, int(filled.min()))
    start = min(start, T)
    posH = pos[:, None, :].expand(B, Hkv, T)
    keep = (valid & (torch.arange(T, device=valid.device) < start))[:, None, :].expand(B, Hkv, T).clone()
    probs = masked_softmax(logits[..., :start, :], allowed[..., :start, :]) * valid[:, None, None, :start, None]
    acc = probs.new_zeros(B, Hkv, T)  # (B, Hkv, T) accumulated attention
    policy.accumulate(acc, probs.sum(2), valid[:, :start])
    if policy.evicts and start > 0:  # the cut at the end of the prefill, judged with the last token in
        now = keep[:, 0].sum(-1) - 1
        keep = keep_top(policy.priority(posH.masked_fill(~keep, -1), acc, now, counts), keep, counts.total)

    out = allowed.expand(B, Hkv, G if not policy.evicts else 1, T, T).clone()
    with serial(logits.device):
        row_loop(policy, logits, valid, pos, posH, counts, keep, acc, out, start)
    return out


def row_loop(policy, logits, valid, pos, posH, counts, keep, acc, out, start):
    """Rows start..T-1, one step each: evict (or restrict), add the token, accumulate its attention."""
    T = logits.shape[-1]
    before = valid.long().cumsum(-1) - valid.long()  # (B, T) tokens before each column; the cache holds min(., K)
    rooms = (before < counts.total[:, None]) | ~valid  # (B, T) below budget (or a pad: nothing to evict)
    padded = not bool(valid[:, start:].all())
    for i in range(start, T):
        tok = valid[:, i]  # (B,)
        if policy.evicts:
            room = rooms[:, i]
            held = posH.masked_fill(~keep, -1)  # the state as the cache sees it: -1 = not held
            slot = select_slot(policy.priority(held, acc, pos[:, i], counts), held, keep, room)
            keep.scatter_(-1, slot, False)
            keep[:, :, i] = tok[:, None]
            row = keep[:, :, None, :]  # (B, Hkv, 1, T)
        else:
            keep[:, :, i] = tok[:, None]
            row = policy.restrict(logits[..., i:i + 1, :], acc[:, :, None, None, :],
                                  keep[:, :, None, None, :], counts)[..., 0, :]  # (B, Hkv, G, T)
        out[..., i, :] = row
        if policy.needs_scores:
            p = masked_softmax(logits[..., i, :], row)  # (B, Hkv, G, T)
            p = p.sum(2)[:, :, None, :]  # (B, Hkv, 1, T)
            policy.accumulate(acc, p * tok[:, None, None, None] if padded else p, tok[:, None] if padded else None)

