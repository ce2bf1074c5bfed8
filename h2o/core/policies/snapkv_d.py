"""snapkv_d: SnapKV re-applied at every decoding step (SnapKV-D), as the minghui-liu/kvpress fork ("Hold Onto That
Thought", arXiv 2512.12008) runs its ``SnapKVPress`` through ``BasePress.forward_hook`` and ``ScorerPress``'s
``compress_prefilling`` / ``compress_decoding`` (docs/methods.md, "SnapKV-D").

The fork's rule, per layer and KV head, with a budget of ``n`` tokens (its ``cache_budget``) and ``w`` = ``window``:

* **at the prompt's end** (a prompt of more than ``n`` tokens): SnapKV's score, as :mod:`.snapkv` (kvpress 0.5.5):
  the last ``w`` query rows' attention on the keys before them, averaged over the rows, average-pooled along
  positions (``kernel``), averaged over each KV head's G query heads; the window's ``w`` tokens kept; the top ``n``.
* **after every decoding token has attended** (the cache then holds ``n + 1``; no cut while it holds at most ``n``):
  the same score over the held tokens in order, read from **one** attention row, the one of the token that just
  attended (its eager weights, a softmax over every held token, itself included): the window is the newest ``w``
  held tokens, the older ones are pooled along the held tokens; the top ``n`` kept, so one token goes.

So the schedule is ``compress=interval`` with ``interval=1`` (the cut after the token attended, the cache breathing
between ``n`` and ``n + 1``; the same cuts as ``compress=buffer`` with ``interval=1``), the default here; any other
schedule runs the same score at its cuts (``prefill``: snapkv's cut; ``decode``: each arriving token takes the slot
of the lowest score by the previous token's row).

State: ``acc`` (B, H, S) fp32: at the prompt's cut the window rows' attention summed over the G heads, / (w G)
(snapkv's :meth:`accumulate_prompt`); each decoding row replaces it by its own attention summed over the G heads,
/ G. The priority pools it along the held tokens in position order (:meth:`SnapKV.held_score`; at a prompt's end
the same as along positions).

Where this differs from the fork (docs/methods.md): the fork keeps its cache in ``topk``'s order (scores
descending), so at the next step its "newest ``w``" are the last ``w`` slots of that order (the new token and the
``w - 1`` lowest-scored survivors) and its pooling reads slot neighbours; here the held tokens are read in position
order (the fork with its kept slots re-sorted by position keeps the same tokens: h2o/parity/snapkv_d.py). The window
is padded with the largest score + 1 (the fork: the batch's largest score itself, a tie that its ``topk`` breaks
only when ``n <= w``). The fork asserts more than ``w`` held tokens at each cut (``n >= w``); here a sequence of at
most ``w`` held tokens is all window and keeps its newest (the window's scores rise with position). A forward of
several tokens after the prompt adds its last ``w`` rows' mean to the state (the fork: replaces the state by it; it
generates one token at a time).
"""
import torch

from ..schedule import Interval
from .base import READ_WINDOW
from .snapkv import SnapKV, last_row, window_on_top

INTERVAL = 1  # the fork's: a cut after every decoding token (compress=interval where none is given)


class SnapKVD(SnapKV):
    name = "snapkv_d"
    reads = frozenset({READ_WINDOW})  # the prompt's last ``window`` rows, then each decoding row
    schedule = Interval(INTERVAL)  # the fork's: after each decoding token attended, back to the budget
    default_interval = INTERVAL  # where a schedule that takes an interval is given none

    def __init__(self, budget=512, heavy=None, recent=None, heavy_share=0.5, window: int = 64, kernel: int = 5):
        super().__init__(budget, heavy, recent, heavy_share, window, kernel)

    def rings(self) -> bool:
        return False  # acc (B, H, S): the prompt window's mean, then the newest row's attention

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """acc (B, H, S) <- the last real row of probs (B, H, G, r, S), summed over G / G (the fork's one row at a
        decoding step); valid (B, r) bool (None: all real); a sequence with no real row keeps its state."""
        last_row(acc, probs, valid, lambda row: row.sum(2) / probs.shape[2])

    def priority(self, pos, acc, now, counts):
        """pos (B, H, S) (-1: not held), acc (B, H, S) -> (B, H, S) fp32: the held tokens older than the newest
        ``w`` pooled along the held tokens, the newest ``w`` above them, newer higher (a budget below the window,
        where the fork asserts, keeps the newest: in any slot order, a sliding layer's too)."""
        score, scored = self.held_score(pos, acc)
        prio = window_on_top(score, scored)  # (B, H, S)
        return torch.where(scored, prio, prio + pos.clamp(min=0).to(prio.dtype))
