"""The base of the methods defined only at the end of a prompt (kvpress's presses: snapkv, knorm, keydiff): the
whole budget is scored (no recent window), the timing is ``compress="prefill"`` and ``decode`` is refused in one
line (docs/methods.md: their decoding forms are not built).

Selection is kvpress's ``ScorerPress``: ``scores.topk(n)`` over the prompt's positions, per KV head. Where scores
tie exactly at the budget's edge (knorm at layer 0: RoPE is a rotation, so every occurrence of a token has the same
key norm; snapkv's window below its size), which tokens stay is ``torch.topk``'s choice, a function of the whole
row's comparisons. :func:`kvpress_first` therefore runs ``topk`` on the row kvpress builds (the scores by
position) and ranks what it returns above everything else: the same tokens as kvpress on the same device (for a
model whose scores kvpress computes in the same dtype: fp32 here, the keys' dtype there)."""
import torch

from .base import Counts, Policy
from .budget import Unsupported


def by_position(pos: torch.Tensor, prio: torch.Tensor) -> torch.Tensor:
    """pos (B, H, S) (-1: not held), prio (B, H, S) -> (B, H, L) the priorities by position, -inf where not held;
    L = the largest position + 1 (one host read)."""
    B, H, _ = pos.shape
    L = int(pos.max()) + 1 if pos.numel() else 0
    dense = prio.new_full((B, H, L + 1), -torch.inf)  # the last column takes what is not held
    dense.scatter_(-1, torch.where(pos >= 0, pos, L), prio)
    return dense[..., :L]


def kvpress_first(pos: torch.Tensor, prio: torch.Tensor, now: torch.Tensor, counts: Counts,
                  skip: list[bool] | None = None) -> torch.Tensor:
    """(B, H, S) priorities with kvpress's choice on top: per sequence, ``topk(n)`` (n = ``counts.total``) of its
    row of ``prio`` by position (positions 0..now), those slots raised to +inf. ``skip`` (B,): sequences left as
    they are (then ``keep_top``'s order applies, newer first on ties)."""
    rows = by_position(pos, prio)  # (B, H, L)
    chosen = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)  # (B, H, L)
    for b, (length, n) in enumerate(zip((now + 1).tolist(), counts.total.tolist())):
        if n < length and not (skip and skip[b]):
            chosen[b].scatter_(-1, rows[b, :, :length].topk(n, dim=-1).indices, True)
    top = chosen.gather(-1, pos.clamp(min=0)) & (pos >= 0)  # (B, H, S)
    return torch.where(top, torch.inf, prio)


class PrefillOnly(Policy):
    compress = "prefill"

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget, heavy, recent, heavy_share)
        zero = 0.0 if isinstance(self.budget, float) else 0
        Policy.__init__(self, heavy=self.budget, recent=zero)  # no recent window: the whole budget is scored

    def timed(self, compress: str) -> Policy:
        if compress == "decode":
            raise Unsupported(f"compress=decode: {self.name} is defined at the end of a prompt only (kvpress's "
                              f"rule); allowed: prefill")
        return super().timed(compress)

    def scores(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        """The score at the cut (:meth:`Policy.cut_score` or the accumulated one), (B, H, S) fp32, as kvpress's
        press scores (before its per-head ``topk``: what adakv ranks across a layer's heads)."""
        return acc

    def ties_kept_newest(self, now: torch.Tensor) -> list[bool] | None:
        """(B,) the sequences whose cut breaks ties newer first instead of by kvpress's ``topk`` (None: none)."""
        return None

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        """:meth:`scores`, kvpress's ``topk`` choice first."""
        return kvpress_first(pos, self.scores(pos, acc, now, counts), now, counts, self.ties_kept_newest(now))
