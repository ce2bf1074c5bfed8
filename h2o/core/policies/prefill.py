"""The base of kvpress's presses (snapkv, knorm, keydiff, expected_attention): the whole budget is scored (no
recent window), the default timing is ``compress="prefill"`` (kvpress's setting).

Selection at a cut (:meth:`PrefillOnly.keep`) is kvpress's ``ScorerPress``, ``scores.topk(n)`` over the prompt's
positions per KV head, run as kvpress runs it, so exact ties go the same way (:mod:`.kvpress_select`).

``compress=decode`` and ``compress=interval`` are refused in one line, except for a press with a decoding form
(``decode_form``: knorm, keydiff, per-key scores; :mod:`.decoding_press`): kvpress's ``DecodingPress(press, compression_interval=1)``. At
each decoding step the arriving token takes the slot of the held key kvpress's ``topk`` leaves out (the lowest
:meth:`Policy.step_score` of the held older keys); a cut keeps ``total - 1`` (:attr:`cut_room`), the next token
taking the free slot (docs/methods.md, "KNorm and KeyDiff at every decoding step").
"""
from typing import ClassVar

import torch

from ..schedule import Prefill, Schedule
from .base import Counts, Policy
from .budget import Unsupported
from .kvpress_select import kvpress_topk


class PrefillOnly(Policy):
    schedule = Prefill()
    newest_upto = 0  # a prompt of at most this many tokens keeps its newest (kvpress has no rule there)
    decode_form: ClassVar[bool] = False  # True: DecodingPress's form at interval 1 (compress=decode)

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget, heavy, recent, heavy_share)
        self.whole_budget()  # no recent window: the whole budget is scored

    def check_schedule(self, schedule: Schedule) -> None:
        if not schedule.once and not self.decode_form:
            raise Unsupported(f"compress={schedule.name}: {self.name} is defined at the end of a prompt only "
                              f"(kvpress's rule, no decoding form); allowed: prefill")

    @property
    def cut_room(self) -> int:
        """1 in the decoding timing: kvpress's prefilling press keeps ``target = total - 1`` tokens, each step
        sees them and itself (:class:`Policy`'s)."""
        return int(self.schedule.evicts_each_step)

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        return acc  # (B, H, S) fp32: the score at the cut or the step (Policy.cut_score, step_score, or acc)

    def keep(self, prio, pos, valid, counts: Counts, arriving=None) -> torch.Tensor:
        """kvpress's selection at the cut (:func:`kvpress_topk`): (B, H, S) bool."""
        return kvpress_topk(prio, pos, valid, counts, self.newest_upto)
