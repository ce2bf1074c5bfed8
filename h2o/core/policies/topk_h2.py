"""topk_h2: top-k per query plus the heavy hitters (paper: Table 8, "Top-K + H2").

Each query sees its ``n_recent`` keys of highest logit (the budget's recent part) and the ``n_heavy`` keys of
highest accumulated attention (the heavy part). Like top-k it keeps the whole cache.
"""
from .base import Counts, Policy
from .topk import per_seq, top_rank


class TopKH2(Policy):
    name = "topk_h2"
    evicts = False
    needs_scores = True

    def restrict(self, logits, acc, allowed, counts: Counts):
        top = top_rank(logits, allowed) < per_seq(counts.recent, logits)
        hitters = top_rank(acc.expand_as(logits), allowed) < per_seq(counts.heavy, logits)
        return allowed & (top | hitters)  # (..., q, S)
