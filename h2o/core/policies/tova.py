"""tova: the newest query's attention, averaged over the layer's heads (TOVA, Oren et al., arXiv 2401.06104).

Rule (docs/methods.md): when a token must go, the cached token that the newest query attended to least goes, its
attention averaged over every query head of the layer (so all KV heads drop the same position). The score is not
accumulated: each query replaces it. kvpress's TOVAPress applies the same score once at the end of the prompt and
always keeps the prompt's last token; here the token judged as "now" (the prompt's last at the cut) is kept too.

Order of events: the cache decides at step t with query t-1's attention over the tokens query t-1 saw, the new
token taking the freed slot; with this harness's budget ``n`` (the query itself included) that is TOVA's rule for
a cache of ``n - 1`` tokens (TOVA's query sees its cache plus itself, then drops one).

State: ``acc`` (B, Hkv, S) holds the newest valid query row's probabilities, head-averaged, the same for every KV
head.
"""
import torch

from .base import READ_WINDOW, Counts, Policy, bcast, const
from .snapkv import last_row


class TOVA(Policy):
    name = "tova"
    splits = False  # the whole budget is scored
    reads = frozenset({READ_WINDOW})  # the newest row's attention: a window of one row (each decoding row too)

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget, heavy, recent, heavy_share)
        self.whole_budget()  # no recent window: the whole budget is scored

    def read_window(self) -> int:
        return 1

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """acc (B, H, S) <- the last valid row of probs (B, H, G, r, S), averaged over (H, G); a sequence with no
        valid row in this block (left pads) keeps its state."""
        last_row(acc, probs, valid, lambda row: row.mean((1, 2))[:, None, :].expand(acc.shape))  # (B, H, S)

    def priority(self, pos, acc, now, counts: Counts):
        return torch.where(pos == bcast(now), const(float("inf"), acc.dtype, acc.device), acc)  # (B, H, S) fp32
