"""The base of the methods defined only at the end of a prompt (kvpress's presses: snapkv, knorm, keydiff,
expected_attention): the whole budget is scored (no recent window), the timing is ``compress="prefill"`` and
``decode`` is refused in one line (docs/methods.md: their decoding forms are not built).

Selection (:meth:`PrefillOnly.keep`) is kvpress's ``ScorerPress``, ``scores.topk(n)`` over the prompt's
positions per KV head, run as kvpress runs it, so exact ties go the same way (:mod:`.kvpress_select`).
"""
import torch

from .base import Counts, Policy
from .budget import Unsupported
from .kvpress_select import kvpress_topk


class PrefillOnly(Policy):
    compress = "prefill"
    newest_upto = 0  # a prompt of at most this many tokens keeps its newest (kvpress has no rule there)

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget, heavy, recent, heavy_share)
        zero = 0.0 if isinstance(self.budget, float) else 0
        Policy.__init__(self, heavy=self.budget, recent=zero)  # no recent window: the whole budget is scored

    def timed(self, compress: str) -> Policy:
        if compress == "decode":
            raise Unsupported(f"compress=decode: {self.name} is defined at the end of a prompt only (kvpress's "
                              f"rule); allowed: prefill")
        return super().timed(compress)

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        return acc  # (B, H, S) fp32: the score at the cut (:meth:`Policy.cut_score` or the accumulated one)

    def keep(self, prio, pos, valid, counts: Counts, arriving=None) -> torch.Tensor:
        """kvpress's selection at the cut (:func:`kvpress_topk`): (B, H, S) bool."""
        return kvpress_topk(prio, pos, valid, counts.total, self.newest_upto)
