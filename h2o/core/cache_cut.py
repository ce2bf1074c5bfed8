"""The evicting layer's cut: at the end of a prompt (or of a prefill chunk, or a schedule's cut) the layer keeps the
budget (less the policy's ``cut_room``) by what the policy ranks (:meth:`CutHooks.cut_state`) and frees the rest, in
:mod:`h2o.core.step`'s order; a cut a rule decides itself (:meth:`CutHooks.keep_only`); a decoding step's eviction
(:meth:`CutHooks.freed_slot`, the slots held after it: :meth:`CutHooks.held_after_step`). Mixed into
:class:`h2o.core.cache.EvictingLayer` (shapes there).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from . import step
from .policies import PolicyError
from .policies.base import Decoder, along_slots, bcast


class CutHooks:
    """The layer's cut (state shapes: :mod:`h2o.core.cache`)."""

    def cut(self, spare: list[bool] | None = None):
        """After a prefill (chunk): keep the budget, free the rest. Slots are in position order here. A sliding
        layer first drops what is out of the last token's window, then the budget applies to what is left.
        ``spare``: per sequence, True where the schedule's cut is not due (it keeps what it holds)."""
        if self.window is not None:
            step.expire_slots(self.pos, self.n_tok - 1, self.window)
        valid = self.pos >= 0
        if self.limited():
            counts, room = self.policy.cut_counts(self.counts), self.policy.cut_room  # room: left for the next
            if spare is not None:
                counts = step.spared(counts, spare, self.pos.shape[-1])
            held = self.host_held if self.window is None and not self.policy.pooled else None  # each head's
            counts = replace(counts, host=counts.host and replace(counts.host, seen=self.host_tok, held=held))
            slots = step.Slots(self.pos, valid, self.acc, self.n_tok - 1, ranked=self.pos)  # pos: -1 not held
            keep = step.kept(self.policy, slots, self.cut_state(valid), counts)  # (B, H, S) (h2o.core.step)
            if self.policy.pooled:  # heads hold uneven counts: the largest
                return self.pool_compact(keep, bool(self.generated))
            totals = counts.host.total.tolist() if spare is not None else self.host_total
            self.host_held = [min(h, max(t - room, 0)) for h, t in zip(self.host_held, totals)]
        else:
            keep = valid
        if self.window is not None:  # an upper bound: the window may have freed more on some heads
            self.host_held = [min(h, self.window) for h in self.host_held]
        self.compact(keep, max(self.host_held))

    def prompt_ends(self, cut: bool = True) -> None:
        """A prompt (chunk) has been seen, in one order: the schedule counts from here (no token generated; per
        sequence, the room the prompt's cut leaves below the budget: :meth:`h2o.core.schedule.Schedule.cuts_after`),
        the prompt's cut (``cut``: not after a first forward of one token) where the layer cuts, and a schedule that
        cuts once keeps every later token."""
        self.generated = 0
        self.below = [max(t - n, 0) for t, n in zip(self.host_total, self.host_tok)]
        if cut and (self.limited() or self.window is not None):  # a budget that drops tokens, or a sliding window
            self.cut()
        self.compressed = self.policy.schedule.once

    def scheduled_cut(self) -> None:
        """After a decoding step: a schedule that cuts later (interval, buffer) cuts each sequence it names now
        (the others keep what they hold); the host's numbers alone decide."""
        self.generated += 1
        if self.limited() and self.policy.schedule.cuts_later:
            due = [bool(self.policy.schedule.cuts_after(self.generated, r)) for r in self.below]
            if any(due):
                self.cut(spare=None if all(due) else [not d for d in due])

    def pool_compact(self, keep: torch.Tensor, decoding: bool) -> None:
        """A pooled layer keeps ``keep`` (B, H, S) bool in ``max(host_held)`` slots: its largest head's count, read
        at a prompt's cut; in a decoding step an upper bound, the count sent to the host without a wait."""
        count = keep.sum(-1).amax(-1)  # (B,)
        if decoding:
            if self.fullest_buf is None or self.fullest_buf.shape != count.shape:
                self.fullest_buf = torch.empty(count.shape, dtype=count.dtype, pin_memory=count.is_cuda)
            self.fullest_buf.copy_(count, non_blocking=True)
            self.sent = [torch.cuda.current_stream(count.device).record_event()] if count.is_cuda else []
        else:
            self.host_held, self.sent = count.tolist(), None
        self.compact(keep, max(self.host_held))

    def fullest(self) -> list[int]:
        """``host_held``; a pooled layer's sent count read (no wait: each forward ends with a host read) and its
        slots shrunk to it, at the next forward or where a record reads the storage."""
        if self.sent is not None:
            for event in self.sent:
                event.synchronize()
            self.host_held, self.sent = self.fullest_buf.tolist(), None
            if max(self.host_held) < self.pos.shape[-1]:  # the slots shrink (else nothing to drop)
                self.compact(self.pos >= 0, max(self.host_held))
        return self.host_held

    @contextmanager
    def narrowed(self, c: int):
        """``acc`` seen as its first ``c`` slots while a block of rows that sees no later slot is added (the hooks
        add in place: the view writes into the whole state)."""
        whole = self.acc
        self.acc = whole[:, :, :c]
        try:
            yield
        finally:
            self.acc = whole

    def unpadded(self) -> bool:
        """Whether every new column of this forward is a real token (the host counts: no read)."""
        return all(n - b == self.q for n, b in zip(self.host_tok, self.tok_before))

    def rows_within(self, w: int) -> torch.Tensor:
        """(q,) bool: this forward's rows among some sequence's last ``w`` real rows (a window rule's rows)."""
        left = (self.n_tok - 1)[:, None] - self.pos[:, 0, -self.q:]  # (B, q) tokens after each row
        return (self.valid & (left >= 0) & (left < w)).any(0)

    def keep_only(self, keep: torch.Tensor) -> None:
        """Keep the slots ``keep`` (B, H, S) bool, free the rest: a cut a rule decides outside the step (kvzip's
        replay); one host read (the heads' counts decide the storage)."""
        self.host_held = keep.sum(-1).amax(-1).tolist()
        self.compact(keep, max(self.host_held))

    def compact(self, keep: torch.Tensor, S: int) -> None:
        """Keep the slots ``keep`` (B, H, S') bool, each head's kept slots first in their order, in ``S`` slots
        (at least the largest head's count; a head holding fewer is padded with empty slots, ``pos = -1``). Where
        ``S`` is every slot (some head keeps them all) the slots stay and the dropped ones are emptied in place."""
        if S == keep.shape[-1]:
            self.pos = torch.where(keep, self.pos, -1)
            return
        order = keep.long().argsort(dim=-1, descending=True, stable=True)[..., :S]  # kept slots first, in order
        order = order.sort(-1).values
        self.pos = torch.where(keep.gather(-1, order), self.pos.gather(-1, order), -1)
        self.acc = self.acc.gather(2, along_slots(order, self.acc))
        idx = order[..., None]
        self.keys = self.keys.gather(-2, idx.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(-2, idx.expand(-1, -1, -1, self.values.shape[-1]))

    def cut_state(self, valid: torch.Tensor) -> torch.Tensor:
        """(B, H, S) what the priority reads at a cut, valid (B, H, S) the held slots: ``acc``, a score of the held
        keys (:meth:`Policy.cut_score`), or of the prompt's query statistics against the held keys and values
        (``Policy.reads_queries``; used once: the statistics are dropped)."""
        if self.policy.reads_queries:
            if self.queries is None:
                raise PolicyError(f"policy={self.policy.name}: this cut has no query statistics (a prefill forked "
                                  f"from another policy's cache); allowed: the prompt through this policy's cache")
            stats, self.queries = self.queries, None
            return self.policy.query_score(stats, *self.read(), self.pos, valid)
        return step.score(self.policy, self.acc, self.read()[0] if self.policy.reads_keys else None, valid)

    def held_after_step(self, evicts: bool, pooled: bool) -> list[int]:
        """Per sequence, the slots held once a decoding token is in (an upper bound on a sliding-window or pooled
        layer, whose heads differ): one more, or (a rule that evicts at each step) one more only below the budget;
        on a sliding-window layer at most the window (and the budget, or what was held plus the token, under a
        schedule that cuts later)."""
        if pooled or (self.window is None and not evicts):
            return [h + 1 for h in self.host_held]
        if self.window is None:
            return [h + (h < t) for h, t in zip(self.host_held, self.host_total)]
        if evicts or not self.limited():  # held: min(tokens, window, budget if it evicts)
            return [min(n + 1, self.window, t if evicts else n + 1) for n, t in zip(self.host_tok, self.host_total)]
        return [min(h + 1, self.window) for h in self.host_held]  # a schedule that cuts later: held plus the token

    def freed_slot(self) -> torch.Tensor:
        """(B, H, 1) the slot a rule that evicts at each step gives the arriving token (:func:`step.evict_slot`): an
        empty one below the budget, else the held one of lowest priority. A global layer's room is its host
        counts' (no device read); a sliding-window layer's heads differ, so its room is counted per head."""
        S = self.keys.shape[-2]
        if self.window is None:
            room = [h < t for h, t in zip(self.host_held, self.host_total)]
            every = all(h == S for h in self.host_held)  # no empty slot: then room is not read
            if not every and self.room_list != room:
                self.room_list, self.room = room, torch.tensor(room, device=self.pos.device)
            a, host = self.arrival(None if every else self.pos >= 0, self.room), (self.host_tok, self.host_held, room)
        else:
            held = self.pos >= 0  # (B, H, S)
            room = held.sum(-1, keepdim=True) < bcast(self.counts.total)  # (B, H, 1)
            a, host = self.arrival(held, room), (self.host_tok, self.host_held, None)
        slot = step.evict_slot(self.decoding(), a, host)  # (B, H, 1)
        self.decoder.placed(slot)
        return slot

    def arrival(self, held: torch.Tensor | None, room: torch.Tensor | None,
                older: torch.Tensor | None = None) -> step.Arrival:
        """The decoding step's state over the slots (:class:`h2o.core.step.Arrival`): held (B, H, S) bool (None:
        every slot), room, older (B, H, S) bool the slots before the arriving token (None: every held one); the
        held keys as attention reads them for a rule that reads keys."""
        keys = scored = None
        if self.policy.reads_keys:
            keys, scored = self.read()[0], self.pos >= 0 if held is None else held
            scored = scored if older is None else scored & older
        return step.Arrival(self.pos, held, self.acc, self.n_tok, self.pos, keys, scored, room)

    def decoding(self):
        """The policy's form for this layer's decoding steps (:meth:`Policy.decoder`), made once per budget. On a
        sliding-window layer an evicting policy's priority as it is (the stateful forms count on the host what
        the window changes on the device)."""
        if self.decoder is None:
            if self.window is not None and self.policy.evicts:
                self.decoder = Decoder(self.policy, self.counts)
            else:
                self.decoder = self.policy.decoding(self.counts, self.host_counts)
        return self.decoder
