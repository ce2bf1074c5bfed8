"""Score variants of the score-based policies (h2o, h2_only, strided_h2, fixed_h2): what makes a token "heavy".

``score`` (a policy option):

* ``sum`` (the paper's, default): the attention the token received, summed over every query since it arrived.
  It only grows, so in an endless stream old tokens can outrank new ones whatever their current use.
* ``mean``: that sum divided by the steps the token has been held, the arriving step included
  (``now - pos + 1``): a token stays only while it keeps being attended to.
* ``decay``: an exponentially decayed sum, ``score <- decay * score + p`` at each query (``decay`` in (0, 1),
  default 0.99: a query ``1 / (1 - decay)`` = 100 steps back weighs ``1 / e``).

Both paths call the same two hooks, so they stay equal token for token: :meth:`Policy.accumulate` (how a block of
query rows adds to the accumulated state ``acc``; overridden here for ``decay``) and :meth:`Scored.score` (the
heavy-hitter priority read from ``acc``; ``mean`` divides there, so it needs no extra state).
"""
from __future__ import annotations

import torch

from .base import READ_ROWS, Counts, KernelForm, Policy, PolicyError, bcast, const

SCORES = ("sum", "mean", "decay")


def window_params(counts: Counts) -> torch.Tensor:
    """(B, 4) int64 row-kernel parameters of a recent window of ``counts.recent`` tokens (pattern 0)."""
    zero = torch.zeros_like(counts.total)
    return torch.stack([counts.recent, zero, zero, zero], -1)


class Scored(Policy):
    """Base of the score-based policies: the ``score`` and ``decay`` options and their two hooks."""

    reads = frozenset({READ_ROWS})  # every query row's attention, summed (or decayed) into acc

    def set_score(self, score: str = "sum", decay: float = 0.99) -> None:
        if score not in SCORES:
            raise PolicyError(f"score={score!r}: allowed: {', '.join(SCORES)}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise PolicyError(f"decay={decay!r}: must be a number in (0, 1) (the factor per step)")
        self.score_kind, self.decay = score, float(decay)

    def score(self, pos: torch.Tensor, acc: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """(B, H, S) heavy-hitter priority in acc's dtype (fp32) from ``acc`` (B, H, S), positions ``pos`` and
        ``now`` (B,). ``sum`` and ``decay`` read ``acc`` as it is (decay is applied as rows accumulate)."""
        if self.score_kind == "mean":
            return acc / (bcast(now) - pos + 1).clamp(min=1).to(acc.dtype)
        return acc

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        if self.score_kind != "decay":
            return super().accumulate(acc, probs, valid)
        B, _, _, r, _ = probs.shape  # (B, H, G, r, S)
        if valid is None and r == 1:  # a decoding step: the same arithmetic in two ops
            acc.mul_(const(self.decay, acc.dtype, acc.device))
            acc += probs.sum((2, 3))
            return
        v = torch.ones(B, r, dtype=torch.float64, device=acc.device) if valid is None else valid.double()
        after = v.flip(-1).cumsum(-1).flip(-1) - v  # (B, r) real rows after each row
        acc.mul_(bcast(self.decay ** v.sum(-1)).to(acc.dtype))
        acc += (probs * (self.decay ** after).to(probs.dtype)[:, None, None, :, None]).sum((2, 3))

    def evict_form(self, params=window_params, pattern: int = 0) -> KernelForm:
        """The row kernel of these heavy hitters with the protected set ``pattern`` of ``params`` (:class:`KernelForm`;
        default: a recent window, as h2o, h2_only, a pattern without a part), the score options as its fields."""
        return KernelForm("evict", params, pattern=pattern, score=SCORES.index(self.score_kind), decay=self.decay)

    def describe(self) -> dict:
        out = {**super().describe(), "score": self.score_kind}
        return {**out, "decay": self.decay} if self.score_kind == "decay" else out
