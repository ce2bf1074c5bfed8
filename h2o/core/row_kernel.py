"""The simulated path's row recurrence of the evicting score-based policies as one Triton kernel per layer (CUDA).

Served: h2o, h2_only (heavy hitters + a recent window), strided_h2, fixed_h2 (heavy hitters + the Sparse Transformer
pattern of the budget's recent part), each with ``score=sum|mean|decay`` (:mod:`h2o.core.policies.score`), and
topk_h2.
One program per (sequence, KV head) walks the rows in registers: when the budget is full, drop the held token of
lowest score among those the policy does not protect (the oldest on ties, as
:func:`h2o.core.policies.select_slot`), add the row's token, write the row's mask, add the row's softmax (summed
over the group's query heads) to the scores. The torch loop (:func:`h2o.core.simulate.row_loop`) stays the CPU path
and the reference; tests run this kernel under ``TRITON_INTERPRET=1`` against it for every policy and score.

Protected tokens (priority ``inf``): h2o's recent window; for strided_h2 / fixed_h2 the ``keep`` held tokens of
highest pattern priority (:class:`h2o.core.policies.combine.WithHeavy`), i.e. by tier (2: the pattern's window or
current block, 1: grid or summary tokens, 0: others), newest first within a tier, found with suffix counts.

topk_h2 (restricting: the whole cache is kept) has its own kernel: per row, the heavy hitters are the top
``heavy`` keys by score, then each query head takes its keys of highest logit up to the budget; a top-k is found by
bisection on the values' int32 image (33 counts over the row), ties in column order as
:func:`h2o.core.policies.topk.top_rank`.

What runs is what a policy declares (:meth:`h2o.core.policies.Policy.kernel_form`: the kernel, its protected set
and its per-sequence parameters); a policy that walks rows without a kernel form runs the torch loop, on CUDA with
a one-line notice (:func:`notice`; ``make gpu-check`` lists the coverage, :func:`coverage`).

Choice: ``H2O_ROW_KERNEL=auto`` (default: Triton on CUDA for the policies that declare a form, else the torch
loop), ``triton``, ``torch``.
"""
from __future__ import annotations

import os
import warnings

import torch

from .policies import Policy
from .policies.base import ROW_KERNEL, KernelForm, declared

CHOICES = ("auto", "triton", "torch")

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch loop serves
    triton = None

if triton is not None:
    @triton.jit
    def suffix(x):
        """Per column: how many of ``x`` (int32 0/1) are at or after it."""
        return tl.sum(x, 0) - tl.cumsum(x, 0) + x

    @triton.jit
    def program_state(keep_ptr, acc_ptr, H, T, BLOCK: tl.constexpr):
        """This program's (sequence, KV head) and its state after row start-1: bh, b, h, the columns, which are
        in the sequence, ``keep`` (BLOCK,) bool and ``acc`` (BLOCK,) fp32."""
        bh = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inb = cols < T
        keep = tl.load(keep_ptr + bh * T + cols, mask=inb, other=0) != 0
        acc = tl.load(acc_ptr + bh * T + cols, mask=inb, other=0.0)
        return bh, bh // H, bh % H, cols, inb, keep, acc

    @triton.jit
    def row_softmax(x, seen, inb):
        """fp32 softmax of a row's logits ``x`` over its ``seen`` columns (an unseen one: the fp32 minimum, as
        :func:`h2o.core.simulate.masked_softmax`; past the sequence: 0)."""
        x = tl.where(inb, tl.where(seen, x, -3.4028234663852886e38), float("-inf"))
        e = tl.exp(x - tl.max(x, 0))
        return e / tl.sum(e, 0)

    @triton.jit
    def score_rows_kernel(logits_ptr, keep_ptr, acc_ptr, out_ptr, pos_ptr, valid_ptr, room_ptr, par_ptr,
                          H, T, G, start, decay, window, s_b, s_h, s_g, s_r,
                          BLOCK: tl.constexpr, SCORE: tl.constexpr, PATTERN: tl.constexpr, WINDOW: tl.constexpr):
        """WINDOW (a sliding-window layer of ``window``): the held tokens out of the row's window leave first;
        the budget is full where this KV head still holds ``total`` tokens (room_ptr (B,) holds the totals)."""
        bh, b, h, cols, inb, keep, acc = program_state(keep_ptr, acc_ptr, H, T, BLOCK)
        pos = tl.load(pos_ptr + b * T + cols, mask=inb, other=-1)
        recent = tl.load(par_ptr + b * 4)  # h2o: the window; pattern: its window (strided) or block size (fixed)
        size = tl.load(par_ptr + b * 4 + 1)  # strided: the grid's stride; fixed: summary tokens per block
        grid_on = tl.load(par_ptr + b * 4 + 2)  # strided: the grid holds tokens (heavy part > 0)
        n_keep = tl.load(par_ptr + b * 4 + 3)  # pattern: held tokens it protects while a token arrives
        for i in range(start, T):
            tok = tl.load(valid_ptr + b * T + i) != 0
            if WINDOW:  # a pad row (position -1) loses nothing
                keep = keep & (pos > tl.load(pos_ptr + b * T + i) - window)
                full = tok & (tl.sum(keep.to(tl.int64), 0) >= tl.load(room_ptr + b))
            else:
                full = tl.load(room_ptr + b * T + i) == 0
            if full:  # full: drop the lowest unprotected held token, oldest on ties
                now = tl.load(pos_ptr + b * T + i)
                if PATTERN == 0:
                    protected = pos > now - recent
                else:
                    if PATTERN == 1:
                        win = pos > now - recent
                        special = ((pos % size) == 0) & (grid_on != 0)
                    else:
                        win = (pos // recent) == (now // recent)
                        special = (pos % recent) >= recent - size
                    t2 = (keep & win).to(tl.int32)
                    t1 = (keep & special & ~win).to(tl.int32)
                    t0 = (keep & ~special & ~win).to(tl.int32)
                    left1 = tl.maximum(n_keep - tl.sum(t2, 0), 0)
                    left0 = tl.maximum(left1 - tl.sum(t1, 0), 0)
                    protected = (((t2 != 0) & (suffix(t2) <= n_keep)) | ((t1 != 0) & (suffix(t1) <= left1))
                                 | ((t0 != 0) & (suffix(t0) <= left0)))
                score = acc
                if SCORE == 1:  # mean: per step held, the arriving step included
                    score = acc / tl.maximum(now - pos + 1, 1).to(tl.float32)
                key = tl.where(keep & ~protected, score, float("inf"))
                low = tl.min(key, 0)
                victim = tl.min(tl.where(keep & (key == low), cols, BLOCK), 0)
                victim = tl.where(low < float("inf"), victim, BLOCK)  # nothing evictable: nothing dropped
                keep = keep & (cols != victim)
            keep = keep | ((cols == i) & tok)
            tl.store(out_ptr + (bh * T + i) * T + cols, keep.to(tl.int8), mask=inb)
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for g in range(G):
                x = tl.load(logits_ptr + b * s_b + h * s_h + g * s_g + i * s_r + cols, mask=inb, other=0.0)
                total += row_softmax(x, keep, inb)
            if SCORE == 2:  # decay: a pad row neither decays nor adds
                acc = tl.where(tok, acc * decay + total, acc)
            else:
                acc += total * tok.to(tl.float32)
        tl.store(acc_ptr + bh * T + cols, acc, mask=inb)

    @triton.jit
    def top(x, allowed, k, cols):
        """The ``k`` allowed columns of highest fp32 ``x``, earlier first on ties (:func:`top_rank`): the k-th
        value found by bisection on its order-preserving int32 image, then the ties taken in column order."""
        bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # + 0.0: -0.0 becomes 0.0, a tie as in torch
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotonic in x as a signed integer
        key = tl.where(allowed, key, -(1 << 40))
        lo = (-(1 << 31)) + 0 * k  # largest t with count(key >= t) >= k, when there is one
        hi = (1 << 31) - 1 + 0 * k
        for _ in range(33):
            mid = lo + (hi - lo + 1) // 2
            enough = tl.sum((key >= mid).to(tl.int64), 0) >= k
            lo = tl.where(enough & (lo < hi), mid, lo)
            hi = tl.where(enough | (lo >= hi), hi, mid - 1)
        above = key > lo
        tie = (key == lo).to(tl.int64)
        return above | ((tie != 0) & (tl.cumsum(tie, 0) <= k - tl.sum(above.to(tl.int64), 0)))

    @triton.jit
    def topk_rows_kernel(logits_ptr, keep_ptr, acc_ptr, out_ptr, valid_ptr, pos_ptr, par_ptr, H, T, G, start,
                         window, s_b, s_h, s_g, s_r, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
        """topk_h2: the whole cache (its window on a sliding layer) is kept; each row and query head sees the
        ``heavy`` keys of highest score, then its keys of highest logit up to ``total``."""
        bh, b, h, cols, inb, keep, acc = program_state(keep_ptr, acc_ptr, H, T, BLOCK)
        total_k = tl.load(par_ptr + b * 2).to(tl.int64)
        heavy_k = tl.load(par_ptr + b * 2 + 1).to(tl.int64)
        if WINDOW:
            pos = tl.load(pos_ptr + b * T + cols, mask=inb, other=-1)
        for i in range(start, T):
            tok = tl.load(valid_ptr + b * T + i) != 0
            keep = (keep & (cols != i)) | ((cols == i) & tok)
            if WINDOW:
                keep = keep & (pos > tl.load(pos_ptr + b * T + i) - window)
            hitters = top(acc, keep, heavy_k, cols)
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for g in range(G):
                x = tl.load(logits_ptr + b * s_b + h * s_h + g * s_g + i * s_r + cols, mask=inb, other=0.0)
                row = top(tl.where(hitters, float("inf"), x), keep, total_k, cols)
                tl.store(out_ptr + ((bh * G + g) * T + i) * T + cols, row.to(tl.int8), mask=inb)
                total += row_softmax(x, row, inb)
            acc += total * tok.to(tl.float32)
        tl.store(acc_ptr + bh * T + cols, acc, mask=inb)


def form_of(policy: Policy) -> KernelForm | None:
    """The kernel form the policy declares for its rule (:func:`declared`), or None."""
    make = declared(policy, "kernel_form")
    return make() if make is not None else None


def supports(policy: Policy) -> bool:
    """Whether the policy declares the kernel as its accelerator (``Policy.accelerators``: h2o, h2_only,
    strided_h2, fixed_h2 with any score, topk_h2)."""
    return ROW_KERNEL in policy.accelerators()


NOTICED: set[str] = set()  # policies told once per process that the torch loop serves them on CUDA


def notice(policy: Policy) -> None:
    """The one-line notice, once per policy: a score-based policy without a kernel form runs the torch row loop
    on CUDA (a few ops per row and layer: slower, the same results)."""
    if policy.name not in NOTICED:
        NOTICED.add(policy.name)
        warnings.warn(f"policy={policy.name}: no Triton row kernel form declared (Policy.kernel_form); the "
                      f"simulated path runs the torch row loop on CUDA", RuntimeWarning, stacklevel=3)


def use_kernel(policy: Policy, device: torch.device) -> bool:
    """Whether the simulated path's row recurrence of ``policy`` runs as the Triton kernel on ``device``
    (called for policies that walk rows: score-based evicting ones and topk_h2; sliding layers included)."""
    choice = os.environ.get("H2O_ROW_KERNEL", "auto")
    if choice not in CHOICES:
        raise ValueError(f"H2O_ROW_KERNEL={choice!r}: allowed: {', '.join(CHOICES)}")
    if choice == "torch":
        return False
    if not supports(policy):
        if choice == "triton":
            raise ValueError(f"H2O_ROW_KERNEL=triton: the kernel implements {', '.join(covered())} (the "
                             f"policies declaring Policy.kernel_form), not {policy.name}")
        if device.type == "cuda":
            notice(policy)
        return False
    if choice == "triton":
        if triton is None:
            raise ValueError("H2O_ROW_KERNEL=triton: triton is not installed (pip install 'triton==3.9.*')")
        return True
    return triton is not None and device.type == "cuda"


def walks_rows(policy: Policy) -> bool:
    """Whether the simulated path walks the rows of ``policy`` (the torch loop or this kernel): score-based
    evicting policies without a closed form, and restricting ones that read the scores."""
    if policy.is_full or policy.position_only:
        return False
    return policy.evicts or policy.needs_scores


def covered() -> list[str]:
    """The registered policies (default options) whose rows the kernel runs."""
    return [name for name, cls in sorted(Policy.registry.items()) if supports(cls(budget=0.2))]


def coverage() -> list[str]:
    """One line per registered policy that walks rows (default options, a 20% budget): the kernel, or the
    torch loop."""
    lines = []
    for name, cls in sorted(Policy.registry.items()):
        policy = cls(budget=0.2)
        if walks_rows(policy):
            form = form_of(policy)
            lines.append(f"{name}: Triton row kernel ({form.kind})" if form is not None else
                         f"{name}: no kernel form declared, the torch row loop serves it on CUDA")
    return lines


def score_rows(policy: Policy, f, r) -> None:
    """In place, rows ``r.start``..T-1 (``f``, ``r``: :class:`h2o.core.step.Forward`, :class:`h2o.core.step.Rows`):
    ``r.out`` (B, Hkv, 1, T, T) bool rows, ``r.acc`` (B, Hkv, T) fp32 scores, ``r.keep`` (B, Hkv, T) bool the state
    after row start-1. ``f.logits`` (B, Hkv, G, T, T) fp32, ``f.valid``/``r.pos`` (B, T). ``f.window``: a
    sliding-window layer's (as :func:`h2o.core.simulate.row_loop`)."""
    logits, valid, pos, counts, keep, acc, out, start, window = (f.logits, f.valid, r.pos, f.counts, r.keep, r.acc,
                                                                r.out, r.start, f.window)
    B, H, G, T, _ = logits.shape
    if start >= T:
        return
    form = form_of(policy)
    logits, acc_c = logits.contiguous(), acc.contiguous()
    keep8, valid8, pos = keep.to(torch.int8).contiguous(), valid.to(torch.int8).contiguous(), pos.contiguous()
    par = form.params(counts).contiguous()  # (B, 4) or (B, 2)
    if form.kind == "restrict":  # out (B, Hkv, G, T, T): a row per query head
        rows = torch.zeros(B, H, G, T, T, dtype=torch.int8, device=logits.device)
        topk_rows_kernel[(B * H,)](logits, keep8, acc_c, rows, valid8, pos, par, H, T, G, start, window or 0,
                                   *logits.stride()[:4], BLOCK=triton.next_power_of_2(T), WINDOW=window is not None)
        out[..., start:, :] = rows[..., start:, :].bool()
    else:
        if window is None:  # (B, T) int8: below budget (or a pad) at each row
            before = valid.long().cumsum(-1) - valid.long()
            room = ((before < counts.total[:, None]) | ~valid).to(torch.int8).contiguous()
        else:  # (B,) the budgets: the kernel counts what each head holds
            room = counts.total.contiguous()
        rows = torch.zeros(B, H, T, T, dtype=torch.int8, device=logits.device)
        score_rows_kernel[(B * H,)](logits, keep8, acc_c, rows, pos, valid8, room, par, H, T, G, start,
                                    float(form.decay), window or 0, *logits.stride()[:4],
                                    BLOCK=triton.next_power_of_2(T), SCORE=form.score, PATTERN=form.pattern,
                                    WINDOW=window is not None)
        out[:, :, 0, start:] = rows[:, :, start:].bool()
    acc.copy_(acc_c)
