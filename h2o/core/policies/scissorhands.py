"""scissorhands: persistence of importance over a history window (Scissorhands, Liu et al., arXiv 2305.17118).

The rule, its defaults (``history`` w = 400 queries, ``window`` r = 10 tokens) and where they come from, what is
built here in both paths (one eviction per arriving token, ``m = 1``; priority ``-I_j``, ``+inf`` for the arriving
token and the ``min(window, total - 1)`` before it; ``t_i`` the tokens of nonzero weight; under GQA each query head
one observation; the state (B, Hkv, S, w) uint8, the last ``w`` steps' counts), the variant ``count="important"``
and the timings (``decode``, the paper's; ``prefill``; no Triton row kernel): docs/methods.md, "Scissorhands".
"""
import torch

from .base import READ_WINDOW, Counts, Policy, PolicyError, bcast, const
from .snapkv import push_rows

COUNTS = ("unimportant", "important")


class Scissorhands(Policy):
    name = "scissorhands"
    splits = False  # the whole budget is scored, the recent window is an option in tokens
    # the state holds the last ``history`` steps' marks, each from its own row: a prompt's older rows leave it
    reads = frozenset({READ_WINDOW})
    token_options = ("history", "window")  # queries, tokens: at most the model's positions

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, history: int = 400, window: int = 10,
                 count: str = "unimportant"):
        super().__init__(budget, heavy, recent, heavy_share)
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise PolicyError(f"history={history!r}: the history window must be an int >= 1 (queries)")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise PolicyError(f"window={window!r}: the recent window must be an int >= 0 (tokens)")
        if count not in COUNTS:
            raise PolicyError(f"count={count!r}: allowed: {', '.join(COUNTS)}")
        self.whole_budget()  # no budget split: the window is in tokens
        self.history, self.window, self.count = history, window, count

    def new_state(self, B, H, S, device):
        return torch.zeros(B, H, S, self.history, dtype=torch.uint8, device=device)  # (B, H, S, w)

    def read_window(self) -> int:
        return self.history

    def marks(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (B, H, G, r, S) -> (B, H, S, r) uint8: per row, the query heads for which the token was unimportant
        (``0 < p`` and ``p * t < 1``, ``t`` the row's tokens of nonzero weight), or important (``p * t >= 1``)."""
        if probs.shape[2] > 255:
            raise PolicyError(f"scissorhands: {probs.shape[2]} query heads per KV head; at most 255 (uint8 counts)")
        seen = probs > 0
        below = probs * seen.sum(-1, keepdim=True) < 1  # (B, H, G, r, S)
        hit = seen & below if self.count == "unimportant" else seen & ~below
        return hit.sum(2, dtype=torch.uint8).transpose(-1, -2)

    def accumulate(self, acc, probs, valid=None) -> None:
        """acc (B, H, S, w) <- the last ``w`` steps of (acc's steps, then the valid rows of probs (B, H, G, r, S))."""
        rows = self.marks(probs)  # (B, H, S, r)
        if valid is None:  # every row is a step (a decoding token, an unpadded block)
            acc.copy_(torch.cat([acc, rows], -1)[..., -acc.shape[-1]:])
        else:
            push_rows(acc, rows, valid)

    def priority(self, pos, acc, now, counts: Counts):
        """pos (B, H, S), acc (B, H, S, w), now (B,) -> (B, H, S) fp32: -(steps unimportant in the window), or
        +(steps important); ``+inf`` for the arriving token ``now`` and the ``window`` tokens before it."""
        n = acc.sum(-1, dtype=torch.float32)  # (B, H, S) exact: at most 255 * w < 2**24
        score = -n if self.count == "unimportant" else n
        window = (counts.total - 1).clamp(max=self.window)  # (B,) at least one held token left to drop
        recent = pos >= bcast(now - window)
        return torch.where(recent, const(float("inf"), score.dtype, score.device), score)

    def describe(self):
        out = {**super().describe(), "history": self.history, "window": self.window}
        return out if self.count == "unimportant" else {**out, "count": self.count}
