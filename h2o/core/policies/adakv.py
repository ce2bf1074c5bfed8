"""adakv: one top-k over all KV heads of a layer, so heads get uneven budgets (Ada-KV, Feng et al., arXiv
2407.11550), as kvpress 0.5.5's ``AdaKVPress``: a wrapper over a score-based policy (``inner``, default
``snapkv``: kvpress's ``AdaKVPress(SnapKVPress())``, its evaluation registry's ``adakv_snapkv``).

Rule at a cut (docs/methods.md): with the inner policy's priorities ``s`` (B, H, S) and its per-head budget ``n``
(the inner's ``counts``, per layer where the inner has per-layer budgets), each head's top ``n_safe =
int(alpha_safeguard * n)`` tokens (at least 1 if alpha_safeguard > 0) are kept whatever their score (kvpress
raises them to the dtype's maximum), then the ``H * n`` highest of the layer's ``H * S`` scores are kept: the
layer keeps as many tokens as the inner policy, shared unevenly by its heads. The scores are compared across
heads as they are (the inner score must be comparable across heads, as kvpress says). Ties: at a cut kvpress's
``topk`` order (:func:`.kvpress_select.kvpress_adakv` runs its ops on its rows); at decoding steps newer first, then
the lower head.

Timings: the inner's, and every one it supports (a prefill-only inner refuses ``compress=decode`` as it does).
``decode``: each arriving token enters every head, then the layer is cut back to ``H * n`` the same way, the
arriving tokens kept (H tokens leave per step, from any heads): heads' counts change step by step.

Storage (both paths agree token for token; the evicting cache really frees memory, where kvpress masks removed
keys with a fake key and frees nothing): a layer's heads are stored padded to the largest head's count, an empty
slot has ``pos = -1`` and is masked (``Policy.pooled``). ``EvictingCache.footprint()`` reports the tokens held and
the bytes stored, padding included.
"""
from __future__ import annotations

import inspect

import torch

from ..schedule import Prefill
from .base import READ_WINDOW, Counts, Policy, PolicyError
from .kvpress_select import kvpress_adakv

# the inner policies' options this wrapper passes on (null in conf/policy/adakv.yaml: the inner's default)
INNER_OPTIONS = ("window", "kernel", "beta", "score", "decay", "seed", "sinks", "n_future_positions", "n_sink",
                 "use_covariance", "use_vnorm", "epsilon", "history", "count")
# keeps everything; the paper code's rule (simulated only, no cut); a rule of the rows' logits with a state of rows
# per slot (r_kv: its scores are not pooled across heads by its reference either); a rule whose state carries a
# history from cut to cut through its order hook, its scores normalised per head (g_kv); a rule bound per layer to a
# model's statistics (triattention: its reference chooses per KV head, pooling nothing); SnapKV-D, which is SnapKV
# at compress=interval interval=1 (Ada-KV over it: inner=snapkv with that schedule)
NOT_INNER = ("full", "h2o_reference", "r_kv", "g_kv", "triattention", "snapkv_d")


def inner_names() -> list[str]:
    """The policies adakv can wrap: every registered evicting policy but full, h2o_reference and itself."""
    return sorted(n for n, c in Policy.registry.items() if c.evicts and not c.pooled and n not in NOT_INNER)


def ranked(keys: list[torch.Tensor]) -> torch.Tensor:
    """Rank from the top (0 = best) along the last dim of the lexicographic order of ``keys`` (each (..., S),
    the most significant first, higher = better): one stable sort per key, the least significant first."""
    S = keys[0].shape[-1]
    order = None
    for key in reversed(keys):
        key = key.to(torch.uint8) if key.dtype == torch.bool else key
        k = key if order is None else key.gather(-1, order)
        step = k.argsort(dim=-1, stable=True)  # ascending
        order = step if order is None else order.gather(-1, step)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(S - 1, -1, -1, device=order.device).expand_as(order))
    return rank


class AdaKV(Policy):
    name = "adakv"
    pooled = True
    reads = frozenset({READ_WINDOW})  # the default inner's (snapkv); an instance takes its inner's
    schedule = Prefill()  # the default inner's (snapkv); an instance takes its inner's

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, inner: str = "snapkv",
                 alpha_safeguard: float = 0.2, **options):
        from . import make_policy  # the package's factory (this module is imported while it loads)

        allowed = inner_names()
        if not isinstance(inner, str) or inner not in allowed:
            raise PolicyError(f"inner={inner!r}: adakv wraps an evicting policy; allowed: {', '.join(allowed)}")
        a = alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise PolicyError(f"alpha_safeguard={a!r}: the share of its budget each head keeps must be in [0, 1]")
        bad = next((k for k in options if k not in INNER_OPTIONS), None)
        if bad is not None:
            raise PolicyError(f"{bad}: no such option for policy=adakv; allowed: budget, heavy, recent, heavy_share, "
                              f"compress, inner, alpha_safeguard, {', '.join(INNER_OPTIONS)}")
        takes = inspect.signature(Policy.registry[inner].__init__).parameters
        given = {k: v for k, v in options.items() if v is not None}
        bad = next((k for k in given if k not in takes), None)
        if bad is not None:
            own = [k for k in INNER_OPTIONS if k in takes]
            raise PolicyError(f"{bad}={given[bad]!r}: inner={inner} has no option {bad}; allowed with inner={inner}: "
                              f"{', '.join(own) or 'none'} (the others null)")
        self.inner = make_policy(inner, budget=budget, heavy=heavy, recent=recent, heavy_share=heavy_share,
                                 **given)
        self.alpha_safeguard = float(a)
        p = self.inner
        self.heavy, self.recent, self.budget = p.heavy, p.recent, p.budget
        self.splits, self.reads = p.splits, p.reads
        self.schedule = p.schedule

    def timed(self, compress: str, interval: int | None = None) -> Policy:
        """The inner policy's timings (a prefill-only inner refuses decode in its own words)."""
        self.inner.timed(compress, interval)
        self.schedule = self.inner.schedule
        return self

    # the inner's rule: budget, scores, priorities
    def counts(self, length: torch.Tensor) -> Counts:
        return self.inner.counts(length)

    def layer_counts(self, counts: Counts, layer: int, layers: int) -> Counts:
        return self.inner.layer_counts(counts, layer, layers)

    @property
    def is_full(self) -> bool:
        return self.inner.is_full

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        return self.inner.priority(pos, acc, now, counts)

    def new_state(self, B: int, H: int, S: int, device: torch.device) -> torch.Tensor:
        return self.inner.new_state(B, H, S, device)

    def accumulate(self, acc, probs, valid=None) -> None:
        self.inner.accumulate(acc, probs, valid)

    def accumulate_prompt(self, acc, probs, valid, left) -> None:
        self.inner.accumulate_prompt(acc, probs, valid, left)

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        return self.inner.cut_score(acc, keys, held)

    def read_window(self) -> int:
        return self.inner.read_window()

    def query_stats(self, queries, rows, pos, length):  # an inner that reads the prompt's queries (reads_queries)
        return self.inner.query_stats(queries, rows, pos, length)

    def query_score(self, stats, keys, values, pos, held) -> torch.Tensor:
        return self.inner.query_score(stats, keys, values, pos, held)

    # the rule of this wrapper: one top-k over the layer's heads
    def safe(self, total: torch.Tensor) -> torch.Tensor:
        """(B,) tokens each head keeps whatever its scores: ``int(alpha_safeguard * n)`` of its budget ``n``
        (``n >= 1``), at least 1 when ``alpha_safeguard > 0`` (kvpress 0.5.5's floor)."""
        safe = torch.floor(total.double() * self.alpha_safeguard).long()  # float64: Python's float product
        return safe.clamp(min=1) if self.alpha_safeguard > 0 else safe

    def keep(self, prio, pos, valid, counts: Counts, arriving=None) -> torch.Tensor:
        """prio (B, H, S) of the held slots ``valid`` (B, H, S) bool at positions ``pos`` (B, H, S) -> (B, H, S)
        bool the kept ones: each head's top ``n_safe``, then the layer's top ``H * total`` (B,). ``arriving``
        (B, H, S) bool (a decoding step's token): kept first. Slots may be in any order."""
        if arriving is None:  # a cut: kvpress's own ops where it has a rule, so that exact ties go its way
            host, a = counts.host or counts, self.alpha_safeguard  # the host's numbers: no device read
            total = host.total.tolist()
            safe = [max(int(n * a), 1) if a > 0 else int(n * a) for n in total]  # safe(), as Python's floats
            kept, own = kvpress_adakv(prio, pos, valid, total, safe, getattr(self.inner, "newest_upto", 0), host.seen)
            if all(own):
                return kept
            own = torch.tensor(own, device=prio.device).view(-1, 1, 1)
            return torch.where(own, kept, self.keep(prio, pos, valid, counts, torch.zeros_like(valid)))
        B, H, S = prio.shape
        first = valid & arriving  # (a cut that kvpress does not decide: none arriving)
        prio = torch.where(valid, prio, -torch.inf)
        head_rank = ranked([valid, first, prio, pos])  # (B, H, S) within each head
        safe = valid & (head_rank < self.safe(counts.total).view(-1, 1, 1))
        tier = first.long() + safe.long()  # 2: arriving, 1: the safeguard, 0: the rest
        head = torch.arange(H, device=pos.device).view(1, H, 1).expand(B, H, S)
        flat = [x.reshape(B, H * S) for x in (valid, tier, prio, pos, -head)]
        rank = ranked(flat).view(B, H, S)
        return valid & (rank < (H * counts.total).view(-1, 1, 1))

    def check_unused(self, options, prefix: str = "policy.") -> None:
        """The inner policy's checks, on the options it reads."""
        takes = inspect.signature(type(self.inner).__init__).parameters
        self.inner.check_unused({k: v for k, v in options.items() if k in takes and v is not None}, prefix)

    def describe(self) -> dict:
        return {**self.inner.describe(), "policy": self.name, "inner": self.inner.name,
                "alpha_safeguard": self.alpha_safeguard}

    def __repr__(self):
        return f"AdaKV({self.inner!r}, alpha_safeguard={self.alpha_safeguard})"
