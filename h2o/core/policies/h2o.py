"""h2o: heavy hitters plus recent tokens (the paper's policy).

The ``n_recent`` latest tokens (the arriving one included) are never dropped; among the others the token of lowest
accumulated attention is. A token's score is the sum of the attention probabilities it received from every query
so far (the attention actually used, i.e. over the kept tokens), summed over the query heads of its KV head under
grouped-query attention. 20% budget = 10% heavy + 10% recent by default. ``score=mean|decay`` changes what
"heavy" means (:mod:`.score`).

``reference_mask`` reproduces instead the rule of the paper's code for OPT and GPT-NeoX, see its docstring.
"""
import torch

from .base import READ_ROWS, Counts, const, recent_window
from .score import Scored


class H2O(Scored):
    name = "h2o"
    reads = frozenset({READ_ROWS})

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, score="sum", decay=0.99):
        super().__init__(budget, heavy, recent, heavy_share)
        self.set_score(score, decay)

    def priority(self, pos, acc, now, counts: Counts):
        window = recent_window(pos, now, counts.recent)
        score = self.score(pos, acc, now)
        return torch.where(window, const(float("inf"), score.dtype, score.device), score)  # (B, H, S) fp32

    def kernel_form(self):
        """The row kernel: the recent window protected, the lowest score dropped."""
        return self.evict_form()


def reference_mask(logits: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """The paper code's H2O mask for OPT/GPT-NeoX (``local_heavy_hitter_mask``), one sequence, no padding.

    logits (..., T, T) with the causal mask already applied (-inf above the diagonal). Returns (..., T, T) bool.
    Rule: rows ``i < heavy`` see their whole prefix. The score of each key starts as the column sum of the causal
    softmax of rows ``< heavy``. Each later row ``i`` sees the ``heavy - 1`` keys of highest score, itself, and the
    band ``i - recent <= j <= i`` (``recent + 1`` tokens); then the row's softmax over the *unmasked* logits is
    added to the scores and every key outside (top ``heavy - 1``) + itself is zeroed.

    Differences from :class:`H2O`: the scores come from unmasked attention; the heavy set and the band overlap, so
    a row can see fewer or more than ``heavy + recent`` tokens; a zeroed key can come back later; rows before
    ``heavy`` are never restricted; ``heavy = 0`` degenerates (top -1 is an error in the paper's code; here 0).
    """
    T = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)  # (..., T, T)
    i = torch.arange(T, device=logits.device)
    causal = i[None, :] <= i[:, None]
    mask = causal & ((i[None, :] >= i[:, None] - recent) | (i[:, None] < heavy))
    mask = mask.expand_as(probs).clone()
    score = probs[..., :heavy, :].sum(-2)  # (..., T)
    for t in range(heavy, T):
        top = torch.zeros_like(score, dtype=torch.bool)
        if heavy > 1:
            top.scatter_(-1, score.topk(heavy - 1, dim=-1).indices, True)
        top[..., t] = True
        mask[..., t, :] |= top & causal[t]
        score = (score + probs[..., t, :]) * top
    return mask
