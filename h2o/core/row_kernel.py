"""The simulated path's row recurrence of h2o / h2_only as one Triton kernel per layer (CUDA).

One program per (sequence, KV head) walks the rows in registers: evict the lowest-priority held token (the H2O
priority: accumulated attention, the recent window protected; the oldest on ties, as
:func:`h2o.core.policies.select_slot`), add the row's token, write the row's mask, add the row's softmax (summed
over the group's query heads) to the scores. The torch loop (:func:`h2o.core.simulate.row_loop`) stays the CPU path
and the reference; tests run this kernel under ``TRITON_INTERPRET=1`` against it.

Choice: ``H2O_ROW_KERNEL=auto`` (default: Triton on CUDA for h2o/h2_only, else the torch loop), ``triton``, ``torch``.
"""
from __future__ import annotations

import os

import torch

from .policies import Policy
from .policies.h2o import H2O

CHOICES = ("auto", "triton", "torch")

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch loop serves
    triton = None

if triton is not None:
    @triton.jit
    def h2o_rows_kernel(logits_ptr, keep_ptr, acc_ptr, out_ptr, pos_ptr, valid_ptr, room_ptr, recent_ptr,
                        H, T, G, start, s_b, s_h, s_g, s_r, BLOCK: tl.constexpr):
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        cols = tl.arange(0, BLOCK)
        inb = cols < T
        keep = tl.load(keep_ptr + bh * T + cols, mask=inb, other=0) != 0
        acc = tl.load(acc_ptr + bh * T + cols, mask=inb, other=0.0)
        pos = tl.load(pos_ptr + b * T + cols, mask=inb, other=-1)
        recent = tl.load(recent_ptr + b)
        for i in range(start, T):
            tok = tl.load(valid_ptr + b * T + i) != 0
            if tl.load(room_ptr + b * T + i) == 0:  # full: drop the held token of lowest priority, oldest on ties
                now = tl.load(pos_ptr + b * T + i)
                key = tl.where(keep & (pos <= now - recent), acc, float("inf"))
                low = tl.min(key, 0)
                victim = tl.min(tl.where(keep & (key == low), cols, BLOCK), 0)
                victim = tl.where(low < float("inf"), victim, BLOCK)  # nothing evictable: nothing dropped
                keep = keep & (cols != victim)
            keep = keep | ((cols == i) & tok)
            tl.store(out_ptr + (bh * T + i) * T + cols, keep.to(tl.int8), mask=inb)
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for g in range(G):
                x = tl.load(logits_ptr + b * s_b + h * s_h + g * s_g + i * s_r + cols, mask=inb, other=0.0)
                x = tl.where(inb, tl.where(keep, x, -3.4028234663852886e38), float("-inf"))
                e = tl.exp(x - tl.max(x, 0))
                total += e / tl.sum(e, 0)
            acc += total * tok.to(tl.float32)
        tl.store(acc_ptr + bh * T + cols, acc, mask=inb)


def supports(policy: Policy) -> bool:
    """The kernel implements the H2O priority with the paper's summed score only (h2o, h2_only; score=sum)."""
    return (isinstance(policy, H2O) and type(policy).priority is H2O.priority
            and getattr(policy, "score_kind", "sum") == "sum")


def use_kernel(policy: Policy, device: torch.device) -> bool:
    choice = os.environ.get("H2O_ROW_KERNEL", "auto")
    if choice not in CHOICES:
        raise ValueError(f"H2O_ROW_KERNEL={choice!r}: allowed: {', '.join(CHOICES)}")
    if choice == "torch" or not supports(policy):
        if choice == "triton":
            score = getattr(policy, "score_kind", None)
            raise ValueError(f"H2O_ROW_KERNEL=triton: the kernel implements h2o and h2_only with score=sum, "
                             f"not {policy.name} (score={score})")
        return False
    if choice == "triton":
        if triton is None:
            raise ValueError("H2O_ROW_KERNEL=triton: triton is not installed (pip install 'triton==3.9.*')")
        return True
    return triton is not None and device.type == "cuda"


def h2o_rows(logits, valid, pos, counts, keep, acc, out, start: int) -> None:
    """In place, rows start..T-1: ``out`` (B, Hkv, 1, T, T) bool rows, ``acc`` (B, Hkv, T) fp32 scores, ``keep``
    (B, Hkv, T) bool the state after row start-1. logits (B, Hkv, G, T, T) fp32, valid/pos (B, T)."""
    B, H, G, T, _ = logits.shape
    if start >= T:
        return
    logits = logits.contiguous()
    before = valid.long().cumsum(-1) - valid.long()
    room = ((before < counts.total[:, None]) | ~valid).to(torch.int8).contiguous()  # (B, T)
    rows = torch.zeros(B, H, T, T, dtype=torch.int8, device=logits.device)
    acc_c = acc.contiguous()
    h2o_rows_kernel[(B * H,)](logits, keep.to(torch.int8).contiguous(), acc_c, rows, pos.contiguous(),
                              valid.to(torch.int8).contiguous(), room, counts.recent.contiguous(),
                              H, T, G, start, *logits.stride()[:4], BLOCK=triton.next_power_of_2(T))
    out[:, :, 0, start:] = rows[:, :, start:].bool()
    acc.copy_(acc_c)
