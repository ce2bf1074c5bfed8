"""snapkv: the prompt's tokens scored by the attention of its last ``window`` queries (SnapKV, Li et al., arXiv
2404.14469), as kvpress 0.5.5's SnapKVPress defines it (docs/methods.md), at the end of the prompt only.

Score, per sequence with L prompt tokens, for the keys j < L - w (w = ``window``): the attention of the last w
queries (each a softmax over every key it sees, the window included), averaged over those w rows, average-pooled
along positions (``kernel``, stride 1, zero padding ``kernel // 2``, every output divided by ``kernel``; the window
columns are not pooled in), averaged over each KV head's G query heads. The budget includes the window (below).
Defaults: w = 64, kernel = 5 (kvpress's).

Sums over rows and heads and the pooling are linear, so ``acc`` accumulates the window rows' attention summed
over the G heads, divided by ``w * G`` (:meth:`accumulate_prompt`, told each row's place), and the pooling runs
once at the cut (:meth:`priority`), along the held tokens in position order: at a prompt's end they are its
positions (what a sliding window dropped, the oldest, a zero either way; pads and slot order do not matter).

The window's own tokens get kvpress's score, one more than the largest score of the sequence's scored keys (all
its KV heads), so they are all kept while the budget ``n`` is at least ``w``; below, kvpress's ``topk`` chooses
among them (:func:`.kvpress_select.kvpress_topk`). Where kvpress asserts ``L > w``, a prompt of at most ``w``
tokens here is all window: the newest ``n`` are kept. Per-sequence maximum (kvpress: the batch's; the same for
one sequence).

Decoding form (``compress=interval``, ``compress=decode``): the window is the newest ``w`` held tokens and its rows
the newest ``w`` query rows, each row's attention as it computed it over the cache it saw; ``acc`` is then a ring
(B, H, S, w) of those rows (summed over the G heads, / (w G)), summed at the cut or step; the pooling runs along
positions as at a prompt's end (an evicted position is a zero). Under ``interval`` N >= w every window row came
after the last cut, so its attention is over the keys the cut sees (kvpress's DecodingPress recomputes the same
rows; docs/r_kv.md, "snapkv at decoding"). Under ``decode`` the prompt is cut to ``total - 1`` and each arriving
token takes the slot of the lowest-scored older token (kvpress's DecodingPress at interval 1, as knorm's).
"""
import torch
import torch.nn.functional as F

from .base import READ_WINDOW, Counts, PolicyError, bcast
from .prefill import PrefillOnly


class SnapKV(PrefillOnly):
    name = "snapkv"
    reads = frozenset({READ_WINDOW})  # the attention of the prompt's last ``window`` rows
    token_options = ("window",)  # the observation window: at most the model's positions
    decode_form = True  # the newest rows at decoding (interval, decode)

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, window: int = 64, kernel: int = 5):
        super().__init__(budget, heavy, recent, heavy_share)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PolicyError(f"window={window!r}: the observation window must be an int >= 1")
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"kernel={kernel!r}: the pooling kernel must be an odd int >= 1")
        self.window, self.kernel = window, kernel
        self.newest_upto = window  # a prompt of at most w tokens is all window (kvpress asserts L > w)

    def read_window(self) -> int:
        return self.window

    def rings(self) -> bool:
        """Whether ``acc`` is the ring of the newest rows (a decoding form) rather than the prompt's window sum."""
        return not self.schedule.once

    def new_state(self, B: int, H: int, S: int, device: torch.device) -> torch.Tensor:
        if not self.rings():
            return super().new_state(B, H, S, device)
        return torch.zeros(B, H, S, self.window, dtype=torch.float32, device=device)  # (B, H, S, w)

    def accumulate(self, acc, probs, valid=None) -> None:
        """A decoding form: the ring acc (B, H, S, w) <- its newest ``w`` real rows and those of probs
        (B, H, G, r, S) (summed over G, / (w G)), rows in order; valid (B, r) bool (None: all real)."""
        if not self.rings():
            return super().accumulate(acc, probs, valid)
        push_rows(acc, probs.sum(2).transpose(-1, -2) / (self.window * probs.shape[2]), valid)

    def accumulate_prompt(self, acc, probs, valid, left) -> None:
        """acc (B, H, S) += the rows of the last ``window`` (left < window) of probs (B, H, G, r, S), / (w G)."""
        if self.rings():
            return self.accumulate(acc, probs, valid)
        rows = (left >= 0) & (left < self.window)  # (B, r)
        if valid is not None:
            rows &= valid
        acc += torch.einsum("bhgrs,br->bhs", probs, rows.to(probs.dtype)) / (self.window * probs.shape[2])

    def priority(self, pos, acc, now, counts: Counts):
        """pos (B, H, S) (-1: not held), acc (B, H, S) (a decoding form: its ring (B, H, S, w)) -> (B, H, S)
        fp32."""
        score, scored = self.held_score(pos, acc.sum(-1) if acc.dim() == 4 else acc)
        return window_on_top(score, scored)

    def held_score(self, pos, acc):
        """The window is the newest ``w`` held tokens; the older held ones are pooled along the held tokens in
        position order (at a prompt's end, along its positions) -> (score, scored) (B, H, S)."""
        B, H, S = pos.shape
        held = pos >= 0
        scored = held & (newest_rank(pos) >= self.window)  # (B, H, S) the held keys older than the window
        order = torch.where(scored, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)  # scored first
        line = torch.where(scored.gather(-1, order), acc.gather(-1, order), 0.0)  # (B, H, S), zeros after them
        pooled = F.avg_pool1d(line.view(B * H, 1, S), self.kernel, 1, self.kernel // 2).view(B, H, S)
        return torch.empty_like(pooled).scatter_(-1, order, pooled), scored

    def describe(self):
        return {**super().describe(), "window": self.window, "kernel": self.kernel}


def window_on_top(score: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """score (B, H, S) of the ``scored`` (B, H, S) bool keys -> (B, H, S): the others (the window) at one more than
    the sequence's largest score (all its KV heads; kvpress's ``max``, + 1), so they are kept while the budget is."""
    top = torch.where(scored, score, -torch.inf).amax((1, 2), keepdim=True)  # (B, 1, 1)
    top = torch.where(torch.isfinite(top), top, 0.0) + 1  # a prompt of at most w tokens: all window
    return torch.where(scored, score, top)


def newest_rank(pos: torch.Tensor) -> torch.Tensor:
    """pos (B, H, S) (-1: not held) -> (B, H, S) int64 each slot's rank by position from the newest held (0), the
    slots not held last."""
    newest = torch.where(pos >= 0, pos, -1).argsort(dim=-1, descending=True, stable=True)  # (B, H, S)
    ranks = torch.arange(pos.shape[-1], device=pos.device).expand_as(newest)
    return torch.empty_like(newest).scatter_(-1, newest, ranks)


def last_row(acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None, reduce) -> None:
    """acc (B, H, S) <- ``reduce`` of the last real row (B, H, G, S) of probs (B, H, G, r, S), in place; valid
    (B, r) bool (None: all real); a sequence with no real row in this block (left pads) keeps its state."""
    B, H, G, r, S = probs.shape
    if valid is None:
        acc.copy_(reduce(probs[:, :, :, -1]))
        return
    idx = torch.where(valid, torch.arange(r, device=valid.device), -1).amax(-1)  # (B,) last real row, -1: none
    row = probs.gather(3, idx.clamp(min=0).view(B, 1, 1, 1, 1).expand(B, H, G, 1, S))[:, :, :, 0]
    acc.copy_(torch.where(bcast(idx >= 0), reduce(row), acc))


def push_rows(ring: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None) -> None:
    """ring (B, H, S, w) <- its newest ``w`` entries after ``rows`` (B, H, S, r) are appended in order, only the real
    ones (valid (B, r) bool; None: all), in place (the oldest first)."""
    B, H, S, w = ring.shape
    r = rows.shape[-1]
    real = torch.ones(B, w + r, dtype=torch.bool, device=ring.device)  # (B, w + r) the old entries, then these
    if valid is not None:
        real[:, w:] = valid
    newer = real.flip(-1).long().cumsum(-1).flip(-1)  # (B, w + r) real entries from each on
    take = (~(real & (newer <= w))).long().argsort(dim=-1, stable=True)[:, :w]  # (B, w) the newest w, in order
    both = torch.cat([ring, rows.to(ring.dtype)], -1)  # (B, H, S, w + r)
    ring.copy_(both.gather(-1, take[:, None, None, :].expand(B, H, S, w)))
