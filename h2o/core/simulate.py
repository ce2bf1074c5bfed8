"""Simulated path: one forward pass in which query row i attends only to what the policy holds at step i.

This is how lm-eval tasks are scored (one forward per request). The full keys stay in memory; the mask is built
row by row with the same eviction step as the evicting cache (:mod:`h2o.core.step`), so feeding the
tokens one by one through :class:`h2o.core.cache.EvictingCache` gives the same logits.

Layout: G = query heads per KV head. logits (B, Hkv, G, T, T); state (B, Hkv, T) per KV head.
With ``prompt_len = P`` the first P columns are a prompt: rows < P see their whole prefix (the real path's
prefill), the state is then cut to the budget and rows >= P are decoding steps. Budget ratios are then taken of
the prompt's length, as in generation; without a prompt, of the sequence's length.
"""
from __future__ import annotations

from functools import partial

import torch

from . import row_kernel, step
from .policies import Policy
from .policies.base import CLOSED_FORM, Decoder, bcast, const, declared
from .masks import causal_valid, in_window, masked_softmax, positions, serial, with_sinks  # noqa: F401 (re-exported)
from .schedule_rows import compressed_once, cut, first_rows, scheduled_cuts
from .step import Forward, LayerCall, Rows, column_key  # noqa: F401 (column_key re-exported)


def grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, Hq, T, D) -> (B, Hkv, G, T, D)."""
    B, Hq, T, D = query.shape
    return query.view(B, n_kv, Hq // n_kv, T, D)


def shaped(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """``x.reshape(shape)`` in one op where ``x`` is contiguous (reshape dispatches a view under it: two)."""
    return x.view(shape) if x.is_contiguous() else x.reshape(shape)


def grouped_scores(q: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q (B, Hkv, G, r, D) @ key (B, Hkv, S, D)^T -> (B, Hkv, G, r, S), the group folded into the rows (one read of K)."""
    B, Hkv, G, r, D = q.shape
    S = key.shape[-2]
    return torch.bmm(shaped(q, B * Hkv, G * r, D), shaped(key, B * Hkv, S, D).transpose(1, 2)).view(B, Hkv, G, r, S)


def grouped_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs (B, Hkv, G, r, S) @ value (B, Hkv, S, D) -> (B, Hkv, G, r, D), one read of V."""
    B, Hkv, G, r, S = probs.shape
    D = value.shape[-1]
    return torch.bmm(shaped(probs, B * Hkv, G * r, S), shaped(value, B * Hkv, S, D)).view(B, Hkv, G, r, D)


def scores(q: torch.Tensor, key: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """q (B, Hkv, G, r, D), key (B, Hkv, S, D) -> fp32 scaled logits (B, Hkv, G, r, S).

    q is scaled before the product and half-precision inputs are multiplied in fp32: a raw q.k above 65504 would
    be inf in fp16 (LLaMA and GPT-NeoX scale after the product). ``softcap`` (Gemma-2's attention logit
    soft-capping): ``tanh(x / c) * c`` of the scaled logits, before any mask, as transformers does."""
    if q.dtype != torch.float32:
        q, key = q.float(), key.float()
    logits = grouped_scores(q * const(scaling, torch.float32, q.device), key)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def closed(policy: Policy, window: int | None) -> bool:
    """Whether a position-only policy's rows come in closed form (:func:`closed_form`, the accelerator it
    declares, ``Policy.accelerators``) on a layer with this ``window``: always without one; with one only where
    the form stays exact (``Policy.window_closed_form``), else the row loop serves."""
    return CLOSED_FORM in policy.accelerators() and (window is None or policy.window_closed_form)


def forward_plan(policy: Policy, valid: torch.Tensor, prompt_len: int = 0, window: int | None = None
                 ) -> tuple[torch.Tensor | None, tuple[int, bool] | None]:
    """What every layer of a forward with this sliding ``window`` (None: a global layer) shares, built once per
    forward and window by the attention function: (the mask of a policy that does not read the scores (full,
    position-only in closed form), (B, 1, 1, T, T), else None; the row plan of the others (:func:`row_plan`), or
    for a whole-forward rule (the paper code's) its :meth:`Policy.mask_plan`, else None)."""
    if policy.whole_forward:
        return None, policy.mask_plan(valid)
    if policy.is_full:
        return causal_valid(valid, window), None
    if closed(policy, window):
        allowed = causal_valid(valid, window) if prompt_len else None
        return policy_allowed(policy, None, allowed, valid, prompt_len, window=window), None
    return None, row_plan(policy, valid, prompt_len)


def reference_length(valid: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B,) the length budget ratios are taken of: the prompt's tokens, or the sequence's without a prompt."""
    return valid[:, :prompt_len].sum(-1) if prompt_len else valid.sum(-1)


def row_plan(policy: Policy, valid: torch.Tensor, prompt_len: int) -> tuple[int, bool]:
    """(first row the row recurrence walks, whether a walked row can be a pad), on the host.

    The Triton kernel walks every row from the prompt on (below a budget a row evicts nothing; the kernel reads
    that per row on the device): no host read. The torch loop starts at the first row where a sequence's budget
    is full (the rows before it are done at once) and skips the pad weighting where no walked row is a pad: one
    host read per forward (free on the CPU), shared by the layers. A sliding window only delays the first
    eviction (fewer tokens are held), so the rows before ``start`` still evict nothing. A schedule that cuts later
    walks every row from the prompt on (its cuts come after the rows it names)."""
    T = valid.shape[1]
    if not policy.evicts or not policy.schedule.evicts_each_step or row_kernel.use_kernel(policy, valid.device):
        return min(prompt_len, T), True
    counts = policy.counts(reference_length(valid, prompt_len))
    filled = (valid.long().cumsum(-1) <= counts.total[:, None]).sum(-1)  # (B,) columns before a full cache
    start = filled.min().clamp(min=prompt_len, max=T)
    padded = (~valid & (torch.arange(T, device=valid.device) >= start)).any()
    code = int(start * 2 + padded)  # the one read: both at once
    return code // 2, bool(code % 2)


def simulated_attention(policy: Policy, query, key, value, valid, scaling: float, call: LayerCall | None = None):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D), valid (B, T) bool -> out (B, T, Hq, D), probs (B, Hq, T, T).

    ``call`` (:class:`h2o.core.step.LayerCall`): ``prompt_len``; ``plan``: what :func:`forward_plan` built for this
    forward and window (None: built here); ``window``: the layer's sliding window (a token leaves the layer's cache
    once it is out of the window, before the policy decides: the policy applies to the tokens inside it);
    ``softcap``: see :func:`scores`; ``sinks``: see :func:`masked_softmax`; ``layer``: (this layer's index, the
    model's layers), for per-layer budgets; ``queries``: the forward's queries before RoPE
    (:class:`h2o.core.prerope.Queries`) for a policy that reads them."""
    call = call or LayerCall()
    window, sinks = call.window, call.sinks
    mask, rows = call.plan if call.plan is not None else (None, None)
    probs = None
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    logits = scores(grouped(query, Hkv), key, scaling, call.softcap)  # (B, Hkv, G, T, T)
    reference = policy.whole_forward  # a mask over the whole forward (the paper code's rule), not a cache's
    if mask is not None and not reference:
        allowed = mask
    else:
        allowed = causal_valid(valid, window)  # (B, 1, 1, T, T)
        if reference:
            allowed = allowed & policy.forward_mask(logits, allowed, rows or policy.mask_plan(valid))
        elif not policy.is_full:
            allowed, probs = policy_attention(policy, logits, allowed, valid, call.prompt_len, rows, call,
                                              (key, value))
    if probs is None:
        probs = masked_softmax(logits, allowed, sinks)  # (B, Hkv, G, T, T)
    out = grouped_values(probs if value.dtype == probs.dtype else probs.to(value.dtype), value)  # (B, Hkv, G, T, D)
    return out.reshape(B, Hq, T, D).transpose(1, 2), probs.reshape(B, Hq, T, T)


def policy_allowed(policy: Policy, logits, allowed, valid, prompt_len: int, rows: tuple | None = None,
                   window: int | None = None) -> torch.Tensor:
    """(B, Hkv, G|1, T, T) bool mask of what each row sees under ``policy`` (logits unused if position-only in
    closed form). ``rows``: the forward's :func:`row_plan` (None: made here). ``allowed`` must include the
    sliding ``window`` where there is one (:func:`causal_valid`)."""
    return policy_attention(policy, logits, allowed, valid, prompt_len, rows, LayerCall(window=window))[0]


def policy_attention(policy: Policy, logits, allowed, valid, prompt_len: int, rows: tuple | None = None,
                     call: LayerCall | None = None, kv: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(:func:`policy_allowed`'s mask, and where the torch row loop computes them anyway, every row's attention
    probabilities (B, Hkv, G, T, T) fp32, equal to ``masked_softmax(logits, mask, sinks)`` (None otherwise)): the
    layer then skips a second softmax over the whole T x T. ``call`` (:class:`h2o.core.step.LayerCall`): the
    layer's ``window``, ``sinks`` (then the torch loop serves: the kernel's softmax has none), ``layer`` (index,
    layers) for a per-layer budget (:meth:`Policy.layer_counts`) and the prompt's ``queries``
    (:class:`h2o.core.prerope.Queries`, ``Policy.reads_queries``); ``kv``: the layer's (key, value)
    (B, Hkv, T, D), for a score of the keys (:meth:`Policy.cut_score`) or of the queries against both."""
    call = call or LayerCall()
    window = call.window
    key, value = kv if kv is not None else (None, None)
    T = valid.shape[1]
    counts = policy.counts(reference_length(valid, prompt_len))
    if call.layer is not None:
        counts = policy.layer_counts(counts, *call.layer)
    f = Forward(logits, allowed, valid, prompt_len, counts, window, call.sinks, key, value, call.queries)
    if policy.evicts and policy.schedule.once:  # the walk's closed form under a schedule that cuts once
        return compressed_once(policy, f), None
    if policy.schedule.evicts_each_step and closed(policy, window):
        held = closed_form(policy, valid, counts, max(prompt_len - 1, 0), window)  # (B, 1, 1, T, T)
        if not prompt_len:
            return held, None
        return torch.where(torch.arange(T, device=valid.device)[:, None] < prompt_len, allowed, held), None
    if not policy.evicts and not policy.needs_scores:  # top-k: a pure function of each row's logits
        decoding = (torch.arange(T, device=logits.device) >= prompt_len)[:, None]  # (T, 1)
        return torch.where(decoding, policy.restrict(logits, None, allowed, counts), allowed), None
    # rows < start need no eviction: the prompt, and (torch loop) the steps before any sequence's budget is full
    return walk(policy, f, *(rows if rows is not None else row_plan(policy, valid, prompt_len)))


def walk(policy: Policy, f: Forward, start: int, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row walk under any schedule, from the state at row ``start`` (:func:`first_rows`: the rows before it, the
    prompt's cut): the Triton kernel where it serves (``decode``, :func:`h2o.core.row_kernel.use_kernel`; no sink
    logits), else :func:`row_loop`. ``padded``: see :func:`row_plan`. -> (mask (B, Hkv, G|1, T, T) bool, every
    row's attention probabilities (B, Hkv, G, T, T) fp32 where the torch loop computes them for a rule that reads
    the scores, else None)."""
    valid = f.valid
    f.allowed = causal_valid(valid, f.window) if f.allowed is None else f.allowed  # (B, 1, 1, T, T)
    B, T = valid.shape
    Hkv, G = (1, 1) if f.logits is None else f.logits.shape[1:3]
    kernel = f.sinks is None and policy.schedule.evicts_each_step and row_kernel.use_kernel(policy, valid.device)
    r = first_rows(policy, f, start, seen=not kernel)
    r.padded, r.out = padded, f.allowed.expand(B, Hkv, G if not policy.evicts else 1, T, T).clone()
    if kernel:  # one fused kernel per layer (CUDA)
        row_kernel.score_rows(policy, f, r)
        return r.out, None
    with serial(valid.device):
        row_loop(policy, f, r)
    return r.out, r.seen


def closed_form(policy: Policy, valid: torch.Tensor, counts, first: int, window: int | None = None
                ) -> torch.Tensor:
    """(B, 1, 1, T, T) bool rows of a position-only policy, all at once (:meth:`Policy.held_rows`): row i sees
    token i and what the cache holds then. A pad row sees what the token before it saw (the cache does not change
    on a pad), as in :func:`row_loop`. ``window``: only for :func:`closed` policies."""
    pos = positions(valid)  # (B, T)
    now = pos.cummax(-1).values  # (B, T): the newest token at each row, -1 before the first
    rows = declared(policy, "held_rows") or partial(Policy.held_rows, policy)  # the closed form of this rule
    held = rows(pos, now, counts, first, *(() if window is None else (window,)))  # (B, T, T)
    itself = (pos[:, None, :] == now[:, :, None]) & valid[:, None, :]
    return (held | itself)[:, None, None]


def row_loop(policy: Policy, f: Forward, r: Rows) -> None:
    """Rows ``r.start``..T-1, one step each under any schedule: the window's expiry, the token placed (``decode``:
    evicting a column, :mod:`h2o.core.step`'s decoding step; else every token kept until a cut), the row's mask (or
    restriction), softmax and accumulation, then the cut (:func:`cut`) where the schedule names the row
    (:func:`scheduled_cuts`). ``r.padded`` False: no row from ``start`` on is a pad (their weighting is skipped).
    ``r.seen`` (B, Hkv, G, T, T): each row's attention probabilities are written there (policies that read the
    scores). ``f.window``: under ``decode`` the budget is then full where a (sequence, KV head) still holds
    ``total`` tokens (its own count: the window frees slots head by head). ``f.sinks``: :func:`masked_softmax`'s.
    ``f.key`` (B, Hkv, T, D): the held older keys ranked by ``Policy.step_score`` (a rule that reads them).
    ``r.cut_at``: the prompt's length where its cut left a slot free (``Policy.cut_room``): the first real row from
    there takes it. ``f.logits`` None: a rule of positions alone (the mask only).

    A :attr:`~h2o.core.policies.Policy.pooled` policy (Ada-KV) adds the row's token to every head, then cuts the
    whole layer back to its budget (:meth:`~h2o.core.policies.Policy.keep`, the token kept), as the cache does.
    Otherwise the eviction is :func:`h2o.core.policies.select_slot`'s decision in column order (:func:`column_key`): one
    ``where`` and one ``argmin`` per row. Per-row inputs are laid out row-major once, so each row reads them with
    one ``select`` (this loop issues every op of the CPU path: for h2o ~39 aten ops per row, views included,
    counted with torch.profiler)."""
    logits, valid, counts, window, sinks = f.logits, f.valid, f.counts, f.window, f.sinks
    keys = f.key if policy.evicts and policy.reads_keys else None  # (B, Hkv, T, D) for Policy.step_score
    pos, posH, keep, acc, out, start, padded, seen, cut_at = (r.pos, r.posH, r.keep, r.acc, r.out, r.start, r.padded,
                                                              r.seen, r.cut_at)
    B, T = valid.shape
    evicting = policy.evicts and policy.schedule.evicts_each_step  # an arriving token evicts (decode)
    scored = logits is not None and policy.needs_scores
    due, cuts = scheduled_cuts(policy, f, pos) if not policy.schedule.evicts_each_step else (None, None)
    before = valid.long().cumsum(-1) - valid.long()  # (B, T) tokens before each column; the cache holds min(., K)
    rooms = (before < counts.total[:, None]) | ~valid  # (B, T) below budget (or a pad: nothing to evict)
    if 0 < cut_at < T:  # the rows after the cut with no real token between: the free slot is theirs
        rooms |= (torch.arange(T, device=valid.device) >= cut_at) & (before == before[:, cut_at:cut_at + 1])
    inf = const(float("inf"), torch.float32, valid.device)
    fills = torch.where(rooms, -inf, inf).t().contiguous().view(T, B, 1, 1)  # (T, B, 1, 1) key of a free column
    toks = valid.t().contiguous()  # (T, B): row i's token is real
    now = pos.t().contiguous()  # (T, B)
    if scored:
        weights = toks.to(logits.dtype).view(T, B, 1, 1, 1, 1)  # (T, B, 1, 1, 1, 1): pad rows add nothing
        low = const(torch.finfo(torch.float32).min, logits.dtype, logits.device)
    gone = const(-1, torch.int64, valid.device)
    sink_row = None if sinks is None else sinks.view(1, *sinks.shape[1:3], 1)  # (1, Hkv, G, 1)
    if window is not None:
        edge = (pos - window).t().contiguous().view(T, B, 1, 1)  # (T, B, 1, 1): row i keeps positions > edge
        limit = bcast(counts.total)  # (B, 1, 1)
        pads = ~toks.view(T, B, 1, 1)
    dec = Decoder(policy, counts)  # the rule's priority as it is (the cache's decoders are tested equal)
    a = step.Arrival(posH, None, acc, None, None, keys, ordered=True)  # the step's state, each row's fields below
    for i in range(start, T):
        tok = toks[i].view(B, 1)  # (B, 1)
        if window is not None:  # out of the window: gone before the policy decides (a pad row: nothing leaves)
            keep = step.expire(keep, posH, None, window, edge[i])
        if not evicting:  # every token kept until a cut (a restricting rule: each row restricts what is held)
            step.place_column(keep, i, tok)
        elif policy.pooled:  # the token enters every head, then the layer is cut back to its budget
            step.place_column(keep, i, tok)
            arriving = posH == now[i].view(B, 1, 1)
            a.held, a.now, a.ranked = keep, now[i], torch.where(keep, posH, gone)
            a.older = None if keys is None else keep & ~arriving
            keep.copy_(step.pool_keep(policy, a, counts, arriving))
        else:
            fill = fills[i] if window is None else torch.where(
                (keep.sum(-1, keepdim=True) < limit) | pads[i], -inf, inf)  # (B, Hkv, 1): room per head
            # the state as the cache sees it: -1 = not held
            a.held, a.older, a.now, a.ranked, a.room = keep, keep, now[i], torch.where(keep, posH, gone), fill
            step.place_column(keep, i, tok, step.evict_slot(dec, a))  # (B, Hkv, 1) the column dropped
        if policy.evicts:
            row = keep.unsqueeze(2)  # (B, Hkv, 1, T)
        else:
            row = policy.restrict(logits[..., i:i + 1, :], acc[:, :, None, None, :],
                                  keep[:, :, None, None, :], counts)[..., 0, :]  # (B, Hkv, G, T)
        out.select(-2, i).copy_(row)
        if scored:  # masked_softmax of the row, in place of its two ops
            p = torch.where(row, logits.select(-2, i), low)  # (B, Hkv, G, T)
            p = torch.softmax(p, -1) if sink_row is None else with_sinks(p, sink_row)
            if seen is not None:
                seen.select(-2, i).copy_(p)
            p = p.unsqueeze(-2)  # (B, Hkv, G, 1, T)
            if policy.reads_logits:
                policy.accumulate(acc, logits[..., i:i + 1, :], tok)
            else:
                policy.accumulate(acc, p * weights[i] if padded else p, tok if padded else None)
        if cuts and cuts[i]:  # the schedule's cut after this row (3: some sequences' only, the others spared)
            keep = cut(policy, f, keep, posH, acc, now[i], ~due[:, i] if cuts[i] == 3 else None)
