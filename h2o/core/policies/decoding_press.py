"""kvpress's ``DecodingPress(press, compression_interval=1)`` for a per-key press (knorm, keydiff): its decision at
every decoding step, exact ties included.

kvpress presses a layer by ``scores.topk(target)`` over the cache's slots in their order and gathers the kept keys
in ``topk``'s order; the next token is appended after them. Where scores tie exactly (knorm at layer 0: a token
arriving beside a held copy of itself has the same key norm), which key ``topk`` leaves out depends on that slot
order. So the decode timing keeps kvpress's slot order in the state: ``acc`` (B, H, S) holds each held slot's place
in kvpress's row, ``j - n`` for the ``j``-th key ``topk`` returned (``n`` kept), 0 for a token that arrived since
(last; several such: by position, as they were appended). The prompt's cut sets it from kvpress's prefill ``topk``
(:meth:`DecodingOrder.cut_order`, the row by position as :func:`.kvpress_select.kvpress_topk` runs it); each step
where the head is full (the arriving token must evict) runs ``topk(n - 1)`` on the held keys' scores in that order
and the one left out goes (:meth:`DecodingOrder.step_score`). Both paths call the same two hooks (no host read).

The interval timing (``DecodingPress(press, compression_interval=N, target_size=n)``) keeps the same order: each cut
runs ``topk(n)`` on kvpress's row (the kept keys in ``topk``'s order, then the tokens since by position; at the
prompt's cut, positions) and keeps what it returns (:meth:`DecodingOrder.cut_order`).
"""
from __future__ import annotations

import torch

from .base import Counts
from .kvpress_select import rows_by_position
from .prefill import PrefillOnly


class DecodingOrder(PrefillOnly):
    """A press with kvpress's decoding form (``decode_form``): its ``acc`` in the decode timing is kvpress's slot
    order, not attention (the scores read only the keys)."""

    decode_form = True

    def accumulate(self, acc, probs, valid=None) -> None:  # a prompt's rows too (Policy.accumulate_prompt)
        if self.schedule.once:  # attention, as any rule (cut again later: acc is kvpress's slot order)
            super().accumulate(acc, probs, valid)

    def cut_order(self, acc, prio, pos, valid, counts: Counts) -> None:
        """kvpress's prefill press: a sequence that drops keys gets its kept slots' places in ``topk``'s order.
        The interval timing: each cut is ``topk(n)`` on kvpress's row; the slots it leaves out get the priority
        -inf in ``prio`` (in place), so the selection keeps what it returned."""
        if self.schedule.once:  # no slot order to keep (slots stay in position order)
            return
        if self.schedule.cuts_later:  # interval, buffer
            return self.interval_cut(acc, prio, pos, valid, counts)
        host = counts.host or counts  # the cache's numbers on the host: no device read
        rows, index, lengths = rows_by_position(prio, pos, valid, host.seen)  # (B, H, L + 1) the scores by position
        for b, (length, n) in enumerate(zip(lengths, host.total.tolist())):
            if n < length:
                top = rows[b, :, :length].topk(n, dim=-1).indices  # (H, n) columns in topk's order
                place = torch.zeros_like(rows[b])  # (H, L + 1)
                place.scatter_(-1, top, torch.arange(n, dtype=place.dtype, device=place.device).expand_as(top) - n)
                acc[b] = place.gather(-1, index[b]).to(acc.dtype)

    def interval_cut(self, acc, prio, pos, valid, counts: Counts) -> None:
        """acc (B, H, S) places, prio (B, H, S) the cut's scores, valid (B, H, S) held -> acc and prio in place."""
        order = kvpress_row(acc, pos, valid)  # (B, H, S) the held slots in kvpress's order first
        host = counts.host or counts
        held = host.held or valid.sum(-1).amax(-1).tolist()  # (B,) the most any head holds (else one host read)
        for b, (m, n) in enumerate(zip(held, host.total.tolist())):
            if m <= n:  # nothing to drop: kvpress's cache is left as it is
                continue
            row = order[b, :, :m]  # (H, m)
            score = torch.where(valid[b].gather(-1, row), prio[b].gather(-1, row), -torch.inf)
            kept = row.gather(-1, score.topk(n, dim=-1).indices)  # (H, n) slots in topk's order
            mark = torch.zeros_like(valid[b]).scatter_(-1, kept, True)  # (H, S)
            acc[b] = torch.zeros_like(acc[b]).scatter_(-1, kept, torch.arange(n, dtype=acc.dtype,
                                                                            device=acc.device).expand_as(kept) - n)
            prio[b] = torch.where(mark, prio[b], -torch.inf)

    def step_score(self, acc, keys, held, pos, counts: Counts) -> torch.Tensor:
        """(B, H, S) the priority of a decoding step: where a head is full, 0 for the key ``topk(n - 1)`` leaves out
        of kvpress's row and 1 for the others (whose places ``acc`` takes, in place); elsewhere the score."""
        score = self.cut_score(acc, keys, held)  # (B, H, S)
        full = held.sum(-1) >= counts.total[:, None]  # (B, H) the arriving token evicts (decided on the device)
        order = kvpress_row(acc, pos, held)  # (B, H, S) kvpress's row: its slots in order
        out, S = score.clone(), score.shape[-1]
        for b, n in enumerate((counts.host or counts).total.tolist()):  # the budgets as numbers: no device read
            if n < 1:
                continue
            n = min(n, S)  # fewer slots than the budget: no head is full, the answer unused
            row = order[b, :, :n]  # (H, n) the held slots in kvpress's order
            top = score[b].gather(-1, row).topk(n - 1, dim=-1).indices  # (H, n - 1)
            kept = row.gather(-1, top)  # (H, n - 1) slots, in topk's order
            mark = torch.zeros_like(score[b]).scatter_(-1, kept, 1.0)  # (H, S) 0: the one left out (or not held)
            place = acc[b].scatter(-1, kept, torch.arange(n - 1, dtype=acc.dtype, device=acc.device).expand_as(
                kept) - n)
            out[b] = torch.where(full[b][:, None], mark, score[b])
            acc[b] = torch.where(full[b][:, None], place, acc[b])
        return out


def kvpress_row(acc: torch.Tensor, pos: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """(B, H, S) the slots in kvpress's cache order: by place (``acc``), then by position among equal places; the
    slots not held last."""
    by_pos = torch.where(held, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    key = torch.where(held, acc, torch.inf).gather(-1, by_pos)  # places, then positions among equal places
    return by_pos.gather(-1, key.argsort(dim=-1, stable=True))
