"""topk_h2: top-k per query plus the heavy hitters (paper: Table 8, "Top-K + H2").

Each query sees the ``n_heavy`` keys of highest accumulated attention (the heavy part), then the keys of highest
logit *for that query* among the others until it sees the whole budget (``counts.total`` keys, as top-k does): the
two parts never overlap, so a query sees exactly as many keys as under top-k. Like top-k it keeps the whole cache.
"""
import torch

from .base import READ_ROWS, Counts, KernelForm, const
from .topk import TopK, per_seq, top_mask, top_rank


class TopKH2(TopK):
    name = "topk_h2"
    splits = True  # the heavy part first, then top-k up to the whole budget
    reads = frozenset({READ_ROWS})  # the heavy hitters' accumulated attention (each query's logits: its own)

    def restrict(self, logits, acc, allowed, counts: Counts):
        hitters = top_rank(acc.expand_as(logits), allowed) < per_seq(counts.heavy, logits)  # (..., q, S)
        first = logits.float().masked_fill(hitters, float("inf"))  # heavy hitters rank first, then by logit
        return allowed & (top_rank(first, allowed) < per_seq(counts.total, logits))  # (..., q, S)

    decoder = TopK.decoder  # the same decoder: it calls select, which carries this rule

    def kernel_form(self):
        """The row kernel "restrict": the heavy hitters, then each query head's top logits up to the budget."""
        return KernelForm("restrict", lambda counts: torch.stack([counts.total, counts.heavy], -1))

    def select(self, logits, acc, allowed, total: int, heavy: int):
        hitters = top_mask(acc, allowed, heavy)  # (B, Hkv, 1, 1, S): the same for every query head and row
        first = torch.where(hitters, const(float("inf"), logits.dtype, logits.device), logits)
        return top_mask(first, allowed, total)
