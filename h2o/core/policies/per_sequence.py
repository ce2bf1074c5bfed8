"""PerSequence: one evicting policy per sequence of a batch, so that several policies stream one text in one
forward (their weights are read once per step). Not registered by name: built from policies,
``PerSequence([make_policy("h2o", budget=96), make_policy("streaming_llm", budget=96)])``.

Each hook runs each policy on its sequence's slice of the state; the shared eviction step does the rest.
"""
from __future__ import annotations

import torch

from .base import Counts, Policy, PolicyError


class PerSequence(Policy):
    per_sequence = True  # its state belongs to sequence b of the batch: a reordered batch would mix the rules

    def __init__(self, policies: list[Policy]):
        if not policies or not all(p.evicts and not p.is_full for p in policies):
            raise PolicyError("PerSequence: needs evicting policies with a budget (not full, not top-k)")
        odd = next((p for p in policies if p.new_state(1, 1, 1, torch.device("cpu")).dim() != 3), None)
        if odd is not None:  # the batch shares one (B, H, S) state tensor
            raise PolicyError(f"PerSequence: {odd.name} keeps its own state per slot; allowed: policies whose state "
                              f"is the accumulated attention")
        keyed = next((p for p in policies if p.reads_keys or p.reads_queries), None)
        if keyed is not None:  # its step and cut read the keys (or the prompt's queries), which no hook here passes
            raise PolicyError(f"PerSequence: {keyed.name} ranks the held keys; allowed: policies whose state is the "
                              f"accumulated attention")
        if len({str(p.budget) for p in policies}) != 1:
            raise PolicyError(f"PerSequence: budgets {[p.budget for p in policies]} differ; give one budget")
        self.policies = list(policies)
        self.heavy, self.recent, self.budget = policies[0].heavy, policies[0].recent, policies[0].budget
        self.reads = frozenset().union(*(p.reads for p in policies))
        self.name = "+".join(p.name for p in policies)

    @property
    def needs_scores(self) -> bool:
        return any(p.needs_scores for p in self.policies)  # random's rows too (random_order's docstring)

    def counts(self, length: torch.Tensor) -> Counts:
        parts = [p.counts(length[b:b + 1]) for b, p in enumerate(self.policies)]
        return Counts(*(torch.cat([getattr(c, f) for c in parts]) for f in ("total", "heavy", "recent", "length")))

    def priority(self, pos, acc, now, counts: Counts):
        return torch.cat([p.priority(pos[b:b + 1], acc[b:b + 1], now[b:b + 1], counts.map(lambda x: x[b:b + 1]))
                          for b, p in enumerate(self.policies)])  # (B, H, S)

    def accumulate(self, acc, probs, valid=None):
        for b, p in enumerate(self.policies):  # in place on each sequence's view of acc
            p.accumulate(acc[b:b + 1], probs[b:b + 1], None if valid is None else valid[b:b + 1])

    def read_window(self) -> int:
        return max(p.read_window() for p in self.policies)

    def __repr__(self):
        return f"PerSequence({self.policies})"

