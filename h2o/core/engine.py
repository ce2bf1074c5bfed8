"""What tasks, benchmarks and the pipeline ask of a run's eviction: one small interface over a policy (its rule and
its schedule), so that nothing outside ``h2o.core`` reads a policy's flags.

* :func:`drops_tokens`: the rule drops tokens from the cache (an evicting rule), not a restricting one (top-k keeps the
  whole cache and limits each query); the record's ``evicts`` field.
* :func:`keeps_all`: nothing is ever dropped (full, or a 100% ratio budget): the run equals full.
* :func:`compresses_once`: the prompt is cut once at its end and every later token kept (``compress=prefill``,
  a budget below 100%).
* :func:`held_budget`: the tokens per KV head a cache keeps after a prompt (or window) of ``length`` tokens.
* :func:`held_by_formula`: whether the tokens held follow from the budget alone (every head alike and no
  sliding window that an ``interval`` schedule's cuts would leave holding fewer); else measure the evicting cache.
* :func:`whole_forward`, :func:`as_paper_rule`: the paper code's H2O rule (a mask over one whole forward,
  :mod:`h2o.core.policies.h2o_reference`), under its name :data:`PAPER_RULE`; this is the one module outside
  ``h2o.core.policies`` that names it.
* :func:`no_simulated_form` (kvzip: why), :func:`reading_rows` (full for a shared prefill whose forks rank).
* the schedule's answers: :func:`appends_after_prompt` (every later token kept after the prompt's cut),
  :func:`held_after` (the tokens a global layer holds after ``fed`` tokens), :func:`schedule_options` (what the
  schedule adds to the run's options); :func:`rows_read` (what the rule accumulates of attention rows).
* :func:`calibration`: whether the rule reads a model's offline statistics (triattention), found before loading.
"""
from __future__ import annotations

import torch

from .policies import Policy
from .policies.base import READ_ROWS
from .policies.h2o_reference import as_reference

PAPER_RULE = "h2o_reference"  # the paper code's H2O mask rule's policy name (simulated only)


def drops_tokens(policy: Policy) -> bool:
    """Whether the rule drops tokens (an evicting rule; False: a restricting one, top-k)."""
    return bool(policy.evicts)


def keeps_all(policy: Policy) -> bool:
    """Whether the policy never drops anything (full, or a 100% ratio budget): its run is full's."""
    return bool(policy.is_full)


def compresses_once(policy: Policy) -> bool:
    """Whether the prompt is cut once at its end and every later token kept (``compress=prefill``; an evicting
    rule below 100%)."""
    return policy.evicts and policy.schedule.once and not policy.is_full


def held_budget(policy: Policy, length: int) -> int:
    """Tokens per KV head kept after a prompt of ``length`` tokens (the budget, or ``length`` where nothing is
    dropped)."""
    return length if policy.is_full else int(policy.counts(torch.tensor([length])).total[0])


def layer_budget(policy: Policy, reference: int, layer: int, layers: int, most: int) -> int:
    """Layer ``layer``'s budget (of ``layers``) in tokens per KV head for a reference length (the arriving token
    counted); ``most`` where nothing is dropped."""
    if policy.is_full:
        return most
    return int(policy.layer_counts(policy.counts(torch.tensor([reference])), layer, layers).total[0])


def held_by_formula(policy: Policy, windows: list[int | None]) -> bool:
    """Whether the tokens each layer holds follow from its budget and schedule alone (layers' sliding
    ``windows``): False for a rule whose heads share a budget (Ada-KV: the storage is padded to the largest head,
    which depends on the scores) and for ``interval`` on a sliding layer (what leaves the window between cuts
    depends on what was kept): measure the evicting cache there."""
    if policy.is_full:
        return True
    if policy.pooled:
        return False
    return policy.schedule.evicts_each_step or policy.schedule.once or all(w is None for w in windows)


def whole_forward(policy: Policy) -> bool:
    """Whether the rule is a mask over one whole forward (the paper code's, :data:`PAPER_RULE`): simulated only,
    one unpadded sequence at a time."""
    return bool(policy.whole_forward)


def as_paper_rule(policy: Policy) -> Policy:
    """The paper code's rule on ``policy``'s heavy/recent split (its second spelling, ``semantics=reference``); a
    policy outside its scope is a one-line PolicyError."""
    return as_reference(policy)


def no_simulated_form(policy: Policy) -> str | None:
    """Why the rule has no simulated (one-pass) form (kvzip replays the context after it), or None."""
    return policy.real_only


def reading_rows(policy: Policy) -> Policy:
    """``policy`` (full) reading every prompt row's attention in its prefill (``READ_ROWS``); returns it."""
    policy.reads = frozenset({READ_ROWS})
    return policy


def appends_after_prompt(policy: Policy) -> bool:
    """Whether every token after the prompt's cut is kept (``compress=prefill``): the continuation may go in one
    forward."""
    return policy.schedule.once


def held_after(policy: Policy, budget: int, context: int | None, fed: int) -> int:
    """Tokens per KV head a global layer holds after ``fed`` tokens (a prompt of ``context`` among them, None: none)
    under a budget of ``budget`` per head, by the schedule (:meth:`h2o.core.schedule.Schedule.held`)."""
    return policy.schedule.held(budget, context, fed)


def schedule_options(policy: Policy) -> dict:
    """What the schedule adds to the run's options (``compress``, ``interval``; none for ``decode``)."""
    return policy.schedule.describe()


def rows_read(policy: Policy, logits, probs):
    """What the rule's ``accumulate`` is given of attention rows: their ``logits`` (``READ_LOGITS``: r_kv, g_kv) or
    their ``probs`` (a parity script driving a rule's hooks by hand)."""
    return logits if policy.reads_logits else probs


def calibration(policy: Policy) -> bool:
    """Whether the rule reads a model's offline statistics (triattention: ``python -m h2o.assets.triattention``), which
    a run finds (or refuses in one line) before its model loads."""
    return bool(getattr(policy, "needs_calibration", False))
