"""When an evicting rule runs: the schedule, composed with any rule (``make_policy(name, compress=...)``).

The rule (a policy) says which held tokens to keep; the schedule says when it is asked. Spelled ``compress``
everywhere (Hydra ``+policy.compress=interval +policy.interval=4``, lm-eval ``--model_args compress=interval,
interval=4``, ``make_policy("h2o", compress="interval", interval=4)``):

* ``decode`` (the default of most rules): the budget held at every step; the arriving token evicts one held token
  when the budget is full, before it attends (the cache then holds ``budget`` tokens, the arriving one included).
* ``prefill`` (kvpress's protocol): cut to the budget once, at the end of the prompt; every later token kept.
* ``interval`` (kvpress's ``DecodingPress(press, compression_interval=N, target_size=budget)``; R-KV's buffer is the
  same shape): cut to the budget at the end of the prompt, then every ``N`` generated tokens, after the ``N``-th
  one attended: between cuts nothing is evicted, so the cache breathes between ``budget`` and ``budget + N``.
  Without a prompt every token counts as generated (the first cut after the ``N``-th token).

Every schedule cuts at the end of the prompt (a cut: :mod:`h2o.core.cache_cut` in the evicting cache,
:func:`h2o.core.simulate.cut_rows` in the simulated path); ``decode`` alone evicts at decoding steps; ``interval``
alone cuts again after a decoding step (:meth:`Schedule.cuts_after`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

COMPRESS = ("decode", "prefill", "interval")  # the spellings of ``compress``


@dataclass(frozen=True)
class Schedule:
    """``name``: its ``compress`` spelling; ``every``: generated tokens between two cuts (``interval`` only)."""

    name: str = "decode"
    every: int | None = None
    steps_evict: ClassVar[dict[str, bool]] = {"decode": True, "prefill": False, "interval": False}

    @property
    def evicts_each_step(self) -> bool:
        """Whether an arriving token evicts one held token when the budget is full (``decode``)."""
        return self.steps_evict[self.name]

    @property
    def once(self) -> bool:
        """Whether the prompt's cut is the only one (``prefill``): every later token is kept."""
        return self.name == "prefill"

    def cuts_after(self, generated: int) -> bool:
        """Whether the cache is cut back to the budget after the ``generated``-th token since the last cut
        attended (1-based): every ``every`` tokens under ``interval``, never otherwise."""
        return self.every is not None and generated > 0 and generated % self.every == 0

    def held(self, budget: int, context: int | None, fed: int) -> int:
        """Tokens per KV head a global layer holds after ``fed`` tokens (a prompt of ``context`` among them, None:
        none) under a budget of ``budget`` per head: ``decode`` (and every schedule without a prompt but
        ``interval``) the budget, ``prefill`` the prompt's cut plus every later token, ``interval`` the last cut
        plus the tokens since (the first token is the prompt where there is none)."""
        if self.name == "decode" or (not context and self.name != "interval"):
            return min(budget, fed)
        first = context or 1
        cut = min(budget, first)
        if self.once:
            return cut + fed - first
        since = fed - first
        return min(budget, cut + self.every * (since // self.every)) + since % self.every

    def describe(self) -> dict:
        """The run's options this schedule adds to a policy's (``decode``, the default, none)."""
        if self.name == "decode":
            return {}
        return {"compress": self.name, **({"interval": self.every} if self.every is not None else {})}


def make_schedule(compress: str, interval=None) -> Schedule:
    """The schedule ``compress`` (:data:`COMPRESS`) with its option ``interval`` (``interval`` only: an int >= 1);
    a bad value is a one-line PolicyError."""
    from .policies.budget import PolicyError  # here: the policies' package imports this module

    if compress not in COMPRESS:
        raise PolicyError(f"compress={compress!r}: allowed: {', '.join(COMPRESS)}")
    if compress != "interval":
        if interval is not None:
            raise PolicyError(f"interval={interval!r}: read only with compress=interval (here compress={compress}); "
                              f"allowed: compress=interval, or no interval")
        return Schedule(compress)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise PolicyError(f"interval={interval!r}: compress=interval needs the generated tokens between two cuts; "
                          f"allowed: an int >= 1")
    return Schedule("interval", interval)
