"""The one abstraction of the harness: a cache policy.

A policy answers "which cached tokens may this query see". It does so in one of two ways:

* an *evicting* policy (``evicts = True``) keeps at most ``budget`` tokens per (sequence, KV head). When a new
  token arrives and the cache is full, the shared step :func:`select_slot` drops the cached token of lowest
  :meth:`Policy.priority`; the new token then takes its place. The simulated mask (one forward pass) and the
  evicting cache (generation) both call that same step on the same state, so they agree token for token.
* a *restricting* policy (``evicts = False``, top-k) keeps the whole cache and limits each query to some keys
  (:meth:`Policy.restrict`).

State shapes used everywhere (S = cache slots, or sequence positions in the simulated path):
    pos   (B, H, S) int64  position of the token in its own sequence (pads excluded), -1 for an empty/pad slot
    acc   (B, H, S) fp32   accumulated attention the token received (summed over a KV head's query heads)
    now   (B,)      int64  position of the token that is arriving (the state is judged as if it were in)
    counts            per-sequence token counts of the budget, each (B,) int64 (see :class:`Counts`)

A budget part is a ratio of the reference length (float, 0 < r <= 1: the scored sequence in lm-eval, the prompt
in generation; ``n = floor(r * L)`` as in the paper) or an absolute token count (int >= 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..validate import MAX_TOKENS, BadInput

BudgetPart = float | int
TIER = float(2**40)  # priority tiers: tier * TIER + position, exact in float64 (positions < 2**40)


class PolicyError(BadInput):
    """Bad policy input: the message is one line naming the value and what is allowed."""


def check_part(name: str, value) -> BudgetPart:
    """Validate one budget part: a ratio in (0, 1] (0 allowed for heavy/recent parts) or a token count >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"{name}={value!r}: expected a ratio in (0, 1] or a token count (int >= 1)")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise PolicyError(f"{name}={value}: a ratio must be in (0, 1]; use an int for an absolute token count")
    if isinstance(value, int) and not 0 <= value <= MAX_TOKENS:
        raise PolicyError(f"{name}={value}: a token count must be in [0, 2**40]")
    return value


def to_count(part: BudgetPart, length: torch.Tensor) -> torch.Tensor:
    """Tokens of a budget part for sequences of ``length`` (B,): ``floor(r * L)`` for a ratio, else the count."""
    if isinstance(part, float):
        return torch.floor(part * length.double() + 1e-9).long()  # 1e-9: 0.29 * 100 is 28.999999999999996
    return torch.full_like(length, part)


@dataclass
class Counts:
    """Per-sequence budget in tokens, each (B,) int64. ``total`` includes the query token itself."""

    total: torch.Tensor
    heavy: torch.Tensor
    recent: torch.Tensor
    length: torch.Tensor  # the reference length the ratios were taken of


class Policy:
    """Base class. Subclasses set ``name`` and override :meth:`priority` (evicting) or :meth:`restrict`."""

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True  # False: keeps the whole cache and restricts each query (top-k)
    needs_scores: ClassVar[bool] = False  # True: uses accumulated attention ``acc``
    quant = None  # the KV quantizer the policy's cache stores with (h2o.core.quant; set by the run's `quant`)
    registry: ClassVar[dict[str, type["Policy"]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.name:
            Policy.registry[cls.name] = cls

    def __init__(self, budget: BudgetPart = 1.0, heavy: BudgetPart | None = None,
                 recent: BudgetPart | None = None, heavy_share: float = 0.5):
        if (heavy is None) != (recent is None):
            raise PolicyError(f"heavy={heavy}, recent={recent}: give both or neither (then budget is split)")
        if heavy is None:
            budget = check_part("budget", budget)
            if budget == 0:
                raise PolicyError("budget=0: a budget must be > 0 (ratio in (0, 1] or token count >= 1)")
            if isinstance(heavy_share, bool) or not isinstance(heavy_share, (int, float)) \
                    or not 0.0 <= heavy_share <= 1.0:
                raise PolicyError(f"heavy_share={heavy_share!r}: expected a number in [0, 1]")
            if isinstance(budget, float):
                heavy, recent = budget * heavy_share, budget - budget * heavy_share
            else:
                heavy = int(round(budget * heavy_share))
                recent = budget - heavy
        heavy, recent = check_part("heavy", heavy), check_part("recent", recent)
        if type(heavy) is not type(recent):
            raise PolicyError(f"heavy={heavy!r}, recent={recent!r}: use two ratios or two token counts")
        if isinstance(heavy, float) and heavy + recent > 1.0 + 1e-9:
            raise PolicyError(f"heavy + recent = {heavy + recent:g}: must be <= 1")
        if heavy + recent == 0:
            raise PolicyError("heavy = recent = 0: the budget must be > 0")
        self.heavy, self.recent = heavy, recent
        self.budget = heavy + recent

    # ----------------------------------------------------------------- budget
    def counts(self, length: torch.Tensor) -> Counts:
        """Budget in tokens for reference lengths ``length`` (B,). At least the query itself is kept."""
        heavy, recent = to_count(self.heavy, length), to_count(self.recent, length)
        total = torch.clamp(heavy + recent, min=1)
        return Counts(total=total, heavy=heavy, recent=total - heavy, length=length)

    @property
    def is_full(self) -> bool:
        """True when the policy never drops anything (full cache, or a 100% ratio budget)."""
        return isinstance(self.budget, float) and self.budget >= 1.0 - 1e-9

    # ------------------------------------------------------- evicting policies
    def priority(self, pos: torch.Tensor, acc: torch.Tensor, now: torch.Tensor, counts: Counts) -> torch.Tensor:
        """(B, H, S) float64, higher = keep. Called on valid slots only; ties are broken towards older tokens."""
        raise NotImplementedError(f"{type(self).__name__} is not an evicting policy")  # abstract

    # ---------------------------------------------------- restricting policies
    def restrict(self, logits: torch.Tensor, acc: torch.Tensor, allowed: torch.Tensor,
                 counts: Counts) -> torch.Tensor:
        """Restrict queries: logits (B, Hkv, G, q, S), acc (B, Hkv, 1, 1, S), allowed (bool, broadcastable) -> bool.

        G is the number of query heads per KV head (1 without grouped-query attention).
        """
        raise NotImplementedError(f"{type(self).__name__} is not a restricting policy")  # abstract

    def describe(self) -> dict:
        return {"policy": self.name, "budget": self.budget, "heavy": self.heavy, "recent": self.recent}

    def __repr__(self):
        return f"{type(self).__name__}(heavy={self.heavy}, recent={self.recent})"


# ---------------------------------------------------------------- shared helpers
def bcast(x: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1) to broadcast against (B, H, S)."""
    return x[:, None, None]


def recent_window(pos: torch.Tensor, now: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool: the ``size`` most recent positions counting the arriving token ``now`` itself."""
    return pos > bcast(now - size)


def select_slot(prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """The eviction step shared by both paths: which slot the arriving token takes, (B, H, 1) int64.

    Where the sequence still has ``room`` (B,) below its budget, an empty slot (``valid`` False) is taken.
    Otherwise the valid slot of lowest priority is dropped, the oldest one on ties, so the answer does not
    depend on the order of slots (the evicting cache fills slots in place, the simulated mask by position).
    """
    inf = float("inf")
    key = torch.where(valid, prio.double(), torch.where(bcast(room), -inf, inf))
    tie = key == key.amin(-1, keepdim=True)
    oldest = torch.where(tie, pos, torch.iinfo(torch.int64).max)
    return oldest.argmin(-1, keepdim=True)


def keep_top(prio: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool: the ``keep`` (B,) highest-priority valid slots, newer first on ties.

    Slots must be in position order (true at the end of a prefill in both paths).
    """
    key = torch.where(valid, prio.double(), -float("inf"))
    order = key.argsort(dim=-1, stable=True)  # ascending; on ties the older slot comes first
    rank_from_top = torch.empty_like(order)
    S = key.shape[-1]
    rank_from_top.scatter_(-1, order, torch.arange(S - 1, -1, -1, device=key.device).expand_as(order))
    return (rank_from_top < bcast(keep)) & valid
