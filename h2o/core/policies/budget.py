"""A policy's budget: its parts (a ratio of the reference length or a token count), their validation, and the
per-sequence token counts every path reads (:class:`Counts`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..validate import MAX_TOKENS, BadInput

BudgetPart = float | int


class PolicyError(BadInput):
    """Bad policy input: the message is one line naming the value and what is allowed."""


class Unsupported(PolicyError):
    """A combination that does not exist, each value valid alone (a compression timing a method or task does not
    define): one line and exit status 2 for a single run; a sweep lists such a job as refused and runs the others."""


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
    # the same counts as CPU tensors (read without a device sync), kept by the evicting cache (None: none kept); at
    # its cut, the host counts' tokens seen and the most any head holds per sequence (None: read from the slots)
    host: "Counts | None" = field(default=None, repr=False, compare=False)
    seen: list | None = field(default=None, repr=False, compare=False)
    held: list | None = field(default=None, repr=False, compare=False)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.total, self.heavy, self.recent, self.length

    def map(self, fn) -> "Counts":
        """``fn`` applied to each field (a device move, a batch selection)."""
        return Counts(*(fn(x) for x in self.fields()))

    def repeat(self, n: int) -> "Counts":
        """Each sequence's counts ``n`` times in a row: (B,) -> (B * n,), to judge n states of one sequence at once."""
        return self.map(lambda x: x[:, None].expand(-1, n).reshape(-1))
