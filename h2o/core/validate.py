"""The errors and checks a policy or a model spec raises on a bad value, one line each, before anything loads.

    check(cond, "task.limit=0: expected a positive int or null")   # ConfigError (one line) unless cond

Every bad value raises a :class:`BadInput` (:class:`ConfigError` for config values, ``PolicyError`` for policy
options) whose message is one line naming the value and what is allowed. Command lines turn it into
``error: <the line>`` and exit status 2 (:mod:`h2o.cli.args`); a run's config is checked by
:mod:`h2o.pipeline.spec`.
"""
from __future__ import annotations

import math
from typing import Any

MAX_TOKENS = 2**40  # token counts above this overflow the policies' priority tiers (core/policies/base.TIER)


class BadInput(ValueError):
    """Bad input of any entry point; the message is one line naming the value and what is allowed."""


class ConfigError(BadInput):
    """A bad config value (model, task, root keys, paths)."""


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``cond``."""
    if not cond:
        raise ConfigError(message)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
