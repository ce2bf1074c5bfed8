"""topk_h2: top-k per query plus the heavy hitters (paper: Table 8, "Top-K + H2").

Each query sees the ``n_heavy`` keys of highest accumulated attention (the heavy part), then the keys of highest
logit *for that query* among the others until it sees the whole budget (``counts.total`` keys, as top-k does): the
two parts never overlap, so a query sees exactly as many keys as under top-k. Like top-k it keeps the whole cache.
"""
from .base import Counts, Policy
from .topk import per_seq, top_rank


class TopKH2(Policy):
    name = "topk_h2"
    evicts = False
    needs_scores = True

    def restrict(self, logits, acc, allowed, counts: Counts):
        hitters = top_rank(acc.expand_as(logits), allowed) < per_seq(counts.heavy, logits)  # (..., q, S)
        first = logits.float().masked_fill(hitters, float("inf"))  # heavy hitters rank first, then by logit
        return allowed & (top_rank(first, allowed) < per_seq(counts.total, logits))  # (..., q, S)
