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
  Without a prompt the first token is the prompt (the evicting cache counts from its first forward).
* ``buffer`` (TriAttention's slack trigger, ``use_slack_trigger``): cut back to the budget once the cache holds
  ``budget + N`` tokens. Where the prompt fills the budget it is ``interval``; a prompt of ``p < budget`` tokens
  leaves ``room = budget - p``, and the first cut comes ``room + N`` tokens after the prompt, then every ``N``.

Every schedule cuts at the end of the prompt (:mod:`h2o.core.step`: the evicting cache's ``cut``, the simulated
path's rows); ``decode`` alone evicts at decoding steps (:attr:`Schedule.evicts_each_step`); ``prefill`` alone
never cuts again (:attr:`Schedule.once`); any other cuts again after the decoding steps :meth:`Schedule.cuts_after`
names. A schedule is a subclass found by its ``name`` (:data:`Schedule.registry`): one more is one class.
"""
from __future__ import annotations

from typing import ClassVar


class Schedule:
    """A schedule; subclasses set ``name`` and either ``evicts_each_step``, ``once`` or :meth:`cuts_after`.
    ``every``: its option ``interval`` (a schedule that takes one: ``takes_interval``)."""

    name: ClassVar[str] = ""
    evicts_each_step: ClassVar[bool] = False  # an arriving token evicts one held token when the budget is full
    once: ClassVar[bool] = False  # the prompt's cut is the only one: every later token is kept
    takes_interval: ClassVar[bool] = False  # its option ``interval`` (generated tokens between two cuts)
    registry: ClassVar[dict[str, type["Schedule"]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if vars(cls).get("name"):
            Schedule.registry[cls.name] = cls

    def __init__(self, every: int | None = None):
        self.every = every

    @property
    def cuts_later(self) -> bool:
        """Whether it cuts again after decoding steps (neither ``decode`` nor ``prefill``)."""
        return not self.evicts_each_step and not self.once

    def cuts_after(self, generated, room=0):
        """Whether the cache is cut back to the budget after the ``generated``-th token since the prompt attended
        (1-based), the prompt's cut having left ``room`` tokens below the budget (``budget - min(budget, p)`` for a
        prompt of ``p`` tokens, counted as on a layer without a sliding window). Each an int, or int64 tensors of
        them (broadcast): a bool tensor. Default: never. The one place that says when a later cut happens: the
        evicting cache asks it per sequence after each decoding step, the simulated rows per row."""
        return generated < 0

    def held(self, budget: int, context: int | None, fed: int) -> int:
        """Tokens per KV head a global layer holds after ``fed`` tokens (a prompt of ``context`` among them,
        None: none) under a budget of ``budget`` per head: ``decode`` (and ``prefill`` without a prompt) the
        budget, ``prefill`` the prompt's cut plus every later token, a schedule that cuts later its last cut plus
        the tokens since (the first token is the prompt where there is none)."""
        if self.evicts_each_step or (not context and self.once):
            return min(budget, fed)
        first = context or 1
        held = min(budget, first)
        if self.once:
            return held + fed - first
        room = budget - held
        for generated in range(1, fed - first + 1):
            held += 1
            if self.cuts_after(generated, room):
                held = min(budget, held)
        return held

    def describe(self) -> dict:
        """The run's options this schedule adds to a policy's (``decode``, the default, none)."""
        if self.name == "decode":
            return {}
        return {"compress": self.name, **({"interval": self.every} if self.takes_interval else {})}

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.every == self.every

    def __hash__(self) -> int:
        return hash((self.name, self.every))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'' if self.every is None else self.every})"


class Decode(Schedule):
    name = "decode"
    evicts_each_step = True


class Prefill(Schedule):
    name = "prefill"
    once = True


class Interval(Schedule):
    name = "interval"
    takes_interval = True

    def cuts_after(self, generated, room=0):
        return (generated > 0) & (generated % self.every == 0)


class Buffer(Schedule):
    name = "buffer"
    takes_interval = True

    def cuts_after(self, generated, room=0):
        since = generated - room  # tokens since the cache first held the budget
        return (since > 0) & (since % self.every == 0)


def compress_names() -> tuple[str, ...]:
    """The spellings of ``compress``: every schedule's name."""
    return tuple(Schedule.registry)


COMPRESS = ("decode", "prefill", "interval", "buffer")  # the built-in spellings (compress_names: every registered one)


def make_schedule(compress: str, interval=None) -> Schedule:
    """The schedule ``compress`` (:func:`compress_names`) with its option ``interval`` (a schedule that takes one:
    an int >= 1); a bad value is a one-line PolicyError."""
    from .policies.budget import PolicyError  # here: the policies' package imports this module

    cls = Schedule.registry.get(compress) if isinstance(compress, str) else None
    if cls is None:
        raise PolicyError(f"compress={compress!r}: allowed: {', '.join(compress_names())}")
    if not cls.takes_interval:
        if interval is not None:
            raise PolicyError(f"interval={interval!r}: read only with compress=interval (here compress={compress}); "
                              f"allowed: compress=interval, or no interval")
        return cls()
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise PolicyError(f"interval={interval!r}: compress={compress} needs the generated tokens between two cuts; "
                          f"allowed: an int >= 1")
    return cls(interval)
