"""h2o_reference: the paper code's H2O mask rule for OPT and GPT-NeoX (:func:`.h2o.reference_mask`).

Same budget and heavy/recent split as :class:`.h2o.H2O`, another rule: the scores come from unmasked attention,
the heavy set and the recent band overlap, rows before ``heavy`` are never restricted (see ``reference_mask``).
Simulated only (one pass over one unpadded sequence at a time); the sum score only.

``semantics=reference`` with policy h2o or h2_only is a second spelling of this policy (:func:`as_reference`).
The simulated path applies the rule through :meth:`H2OReference.mask_plan` and :meth:`H2OReference.forward_mask`.
"""
import torch

from ..schedule import Schedule
from .base import READ_ROWS, PolicyError, Unsupported
from .h2_only import H2Only
from .h2o import H2O, reference_mask


class H2OReference(H2O):
    name = "h2o_reference"
    reads = frozenset({READ_ROWS})  # simulated only: the unmasked rows of every query

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget, heavy, recent, heavy_share)

    def mask_plan(self, valid: torch.Tensor) -> tuple[int, int]:
        """(heavy, recent) in tokens for the paper code's rule, checked once per forward: one host read (is the
        input unpadded); the counts are taken of the length T on the host."""
        if not bool(valid.all()):
            raise ValueError("policy=h2o_reference (semantics=reference): needs unpadded input, one sequence at a "
                             "time")
        counts = self.counts(torch.tensor([valid.shape[1]]))  # (1,) on the CPU: no device read
        return counts.heavy.tolist()[0], counts.recent.tolist()[0]

    def forward_mask(self, logits, allowed, plan: tuple[int, int]) -> torch.Tensor:
        """The paper code's rule (:func:`.h2o.reference_mask`), one unpadded sequence at a time; ``plan``: the
        forward's :meth:`mask_plan`."""
        return reference_mask(logits.masked_fill(~allowed, -float("inf")), *plan)

    def check_schedule(self, schedule: Schedule) -> None:
        if schedule.cuts_later:  # one mask over one forward: no decoding steps to schedule
            raise Unsupported(f"compress={schedule.name}: h2o_reference is the paper code's mask over one forward "
                              f"(no decoding form); allowed: decode")


def as_reference(policy) -> H2OReference:
    """The paper code's rule on ``policy``'s heavy/recent split: h2o and h2_only (score sum), or an h2o_reference
    as it is; any other policy is a one-line PolicyError (the one guard of the rule's scope)."""
    if isinstance(policy, H2OReference):
        return policy
    if type(policy) not in (H2O, H2Only) or policy.score_kind != "sum":
        got = policy.name if type(policy) not in (H2O, H2Only) else f"{policy.name} score={policy.score_kind}"
        raise PolicyError(f"semantics=reference: the paper code's mask rule exists for policy h2o or h2_only with "
                          f"score=sum only (got {got}); it is the policy h2o_reference")
    return H2OReference(heavy=policy.heavy, recent=policy.recent).timed(policy.compress, policy.interval)
