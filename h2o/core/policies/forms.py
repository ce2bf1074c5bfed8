"""The faster forms a rule may declare beside its definition (the accelerators: a closed form, a decoder, the Triton
row kernel's parameters), how the paths find them (:func:`declared`), and the decoder of a cache layer's decoding
steps (:class:`Decoder`). Shapes: :mod:`.base`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .budget import Counts
from .slots import const

@dataclass(frozen=True)
class KernelForm:
    """What the simulated path's Triton row kernel runs for a policy (:mod:`h2o.core.row_kernel`).

    ``kind``: "evict" (the held token of lowest score among those the protected set leaves is dropped) or
    "restrict" (the whole cache kept; heavy hitters, then each query's top logits). ``params(counts)``: per
    sequence int64 (B, 4) for "evict" (window or block, stride or summaries, grid on, protected count) or (B, 2)
    for "restrict" (total, heavy). "evict" only: ``pattern`` the protected set (0: a recent window of
    ``params[:, 0]`` tokens, 1: strided, 2: fixed), ``score`` an index of :data:`.score.SCORES`, ``decay``."""

    kind: str
    params: Callable[[Counts], torch.Tensor]
    pattern: int = 0
    score: int = 0
    decay: float = 0.0


# the methods whose answers are the policy's decisions
RULE = ("priority", "restrict", "score", "accumulate", "accumulate_prompt", "cut_score")
# The accelerators a rule may declare: faster forms of the step (h2o.core.step), each tested equal to it on random
# states (tests/test_accelerators.py): every simulated row at once (``position_only``, :meth:`Policy.held_rows`), a
# decoder that keeps state between decoding steps (:meth:`Policy.decoder`), the simulated path's Triton row kernel
# (:meth:`Policy.kernel_form`). Where a rule declares none, the step runs.
CLOSED_FORM, DECODER, ROW_KERNEL = "closed_form", "decoder", "row_kernel"
ACCELERATORS = (CLOSED_FORM, DECODER, ROW_KERNEL)


def declared(policy, form: str):
    """``policy``'s bound method ``form`` (a faster form of its rule: ``kernel_form``, ``decoder``,
    ``held_rows``), or None if a class below the one that declares it redefines the rule (a subclass that
    changes ``priority`` does not inherit a kernel or a closed form made for its parent's)."""
    mro = type(policy).__mro__
    at = next((c for c in mro if form in vars(c)), None)
    if at is None:
        return None
    for name in RULE:
        rule = next((c for c in mro if name in vars(c)), None)
        if rule is not None and not issubclass(at, rule):
            return None
    return getattr(policy, form)


class Decoder:
    """Priorities of one cache layer's decoding steps. ``priority`` gets the state (pos, acc (B, H, S), now (B,))
    and the host's view of the step, per sequence: ``tok`` the arriving token's position, ``held`` the older tokens
    held, ``room`` below budget (an empty slot is taken, nothing dropped);
    ``placed(slot)`` is told where the arriving token went; ``reset()`` that the slots were rebuilt (a prefill
    chunk, a cut, a new slot)."""

    def __init__(self, policy, counts: Counts):  # policy: a Policy (.base)
        self.policy, self.counts = policy, counts

    def priority(self, pos, acc, now, tok: list[int], held: list[int], room: list[bool]) -> torch.Tensor:
        return self.policy.priority(pos, acc, now, self.counts)

    def placed(self, slot: torch.Tensor) -> None:
        pass

    def restrict(self, logits, acc, allowed: torch.Tensor | None) -> torch.Tensor:
        """A restricting policy's :meth:`Policy.restrict` at a decoding step (``allowed`` None: every slot)."""
        if allowed is None:
            allowed = const(True, torch.bool, logits.device)
        return self.policy.restrict(logits, acc, allowed, self.counts)

    def reset(self) -> None:
        pass
