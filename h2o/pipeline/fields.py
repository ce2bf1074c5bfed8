"""The fields of a run's record (metrics.json), and the one rule for a field that two of its sources name.

A record's fields come from three sources, merged once per run by :func:`record_fields`:

- the **run**: what its config fixes (:meth:`h2o.pipeline.spec.RunSpec.run_fields`: experiment, model, task,
  policy, budget, ..., ``policy_options`` as configured, ``quant``), then what running it measured (:data:`MEASURED`:
  scoring, protocol, n_samples, metrics, wall_s, ...);
- the **policy**: its described options (``Policy.describe()``, called once: ``compress``, ``window``, ``seed``, ...);
- the **task**: its extra fields (``Result.info``: the perplexity task's ``window`` and ``context``, a benchmark's
  ``batch_size``, ...).

The rule, for a name given by more than one source:

1. the task's value wins over the run's and the policy's (the perplexity task's ``window``, 1,152 tokens; a
   benchmark's measured ``batch_size``);
2. the run's value wins over the policy's (``random``'s ``seed``: the record's ``seed`` is the run's, the policy's
   is in ``policy_options``, where every configured option is);
3. where the task's value displaces a different value the policy described, the policy's stays beside it as
   ``policy_<name>`` (SnapKV's observation ``window``, 64, as ``policy_window``); an equal value is one field.

Order: the run's config fields, the policy's options (less those the run names), the run's measured fields, the
``policy_<name>`` fields, then the task's other fields; a field whose value a later source replaces keeps its place.
"""
from __future__ import annotations

# what execute measures (h2o.pipeline.job), after the policy's options in a record
MEASURED = ("scoring", "add_bos_token", "protocol", "n_samples", "metrics", "wall_s", "batch_size", "device", "dtype",
            "resumed_requests")


def record_fields(run: dict, described: dict, measured: dict | None = None, info: dict | None = None) -> dict:
    """The record's fields from the run's config fields ``run``, the policy's ``described`` options, the run's
    ``measured`` fields and the task's ``info``, by the module's rule."""
    measured, info = measured or {}, info or {}
    own = {**run, **measured}  # the run's fields
    options = {k: v for k, v in described.items() if k not in own}  # rule 2
    kept = {f"policy_{k}": v for k, v in options.items() if k in info and info[k] != v}  # rule 3
    return {**run, **options, **measured, **kept, **info}  # rule 1: info last
