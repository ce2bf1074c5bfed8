"""snapkv: the prompt's tokens scored by the attention of its last ``window`` queries (SnapKV, Li et al., arXiv
2404.14469), as kvpress 0.5.5's SnapKVPress defines it (docs/methods.md), at the end of the prompt only.

Score, per sequence with L prompt tokens, for the keys j < L - w (w = ``window``): the attention of the last w
queries (each a softmax over every key it sees, the window included), averaged over those w rows, average-pooled
along positions (``kernel``, stride 1, zero padding ``kernel // 2``, every output divided by ``kernel``; the window
columns are not pooled in), averaged over each KV head's G query heads. The budget includes the window (below).
Defaults: w = 64, kernel = 5 (kvpress's).

Sums over rows and heads and the pooling are linear, so ``acc`` accumulates the window rows' attention summed
over the G heads, divided by ``w * G`` (:meth:`accumulate_prompt`, told each row's place), and the pooling runs
once at the cut (:meth:`priority`), by position (pads and slot order do not matter).

The window's own tokens get kvpress's score, one more than the largest score of the sequence's scored keys (all
its KV heads), so they are all kept while the budget ``n`` is at least ``w``; below, kvpress's ``topk`` chooses
among them (:func:`.kvpress_select.kvpress_topk`). Where kvpress asserts ``L > w``, a prompt of at most ``w``
tokens here is all window: the newest ``n`` are kept. Per-sequence maximum (kvpress: the batch's; the same for
one sequence).
"""
import torch
import torch.nn.functional as F

from .base import READ_WINDOW, Counts, PolicyError, bcast
from .prefill import PrefillOnly


class SnapKV(PrefillOnly):
    name = "snapkv"
    reads = frozenset({READ_WINDOW})  # the attention of the prompt's last ``window`` rows
    token_options = ("window",)  # the observation window: at most the model's positions

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

    def accumulate_prompt(self, acc, probs, valid, left) -> None:
        """acc (B, H, S) += the rows of the last ``window`` (left < window) of probs (B, H, G, r, S), / (w G)."""
        G = probs.shape[2]
        rows = (left >= 0) & (left < self.window)  # (B, r)
        if valid is not None:
            rows &= valid
        acc += torch.einsum("bhgrs,br->bhs", probs, rows.to(probs.dtype)) / (self.window * G)

    def priority(self, pos, acc, now, counts: Counts):
        """pos (B, H, S) (-1: not held), acc (B, H, S), now (B,) the prompt's last position -> (B, H, S) fp32."""
        B, H, S = pos.shape
        start = bcast(now + 1 - self.window)  # (B, 1, 1) the first window position
        scored = (pos >= 0) & (pos < start)  # (B, H, S) the keys before the window
        L = int(pos.max()) + 1 if pos.numel() else 0  # positions 0..L-1 (one host read per cut)
        dense = acc.new_zeros(B, H, L + 1)  # (B, H, L + 1) by position; the last column takes what is not scored
        dense.scatter_(-1, torch.where(scored, pos, L), torch.where(scored, acc, 0.0))
        pad = self.kernel // 2
        pooled = F.avg_pool1d(dense[..., :L].reshape(B * H, 1, L), self.kernel, 1, pad).view(B, H, L)
        score = pooled.gather(-1, pos.clamp(min=0))  # (B, H, S)
        top = torch.where(scored, score, -torch.inf).amax((1, 2), keepdim=True)  # (B, 1, 1)
        top = torch.where(torch.isfinite(top), top, 0.0) + 1  # a prompt of at most w tokens: all window
        return torch.where(scored, score, top)

    def describe(self):
        return {**super().describe(), "window": self.window, "kernel": self.kernel}
