"""Bench: benchmarks only, measurements of time, memory and KV bytes.

- targets.py, task.py: ``make bench`` (``experiment=bench``) and the throughput task of the experiment runner
- throughput.py, variants.py: decode throughput of a policy's evicting cache beside transformers' caches
- every_policy.py: every policy of the registry side by side, in its own timing (``make bench``'s methods section)
- max_batch.py, simulated.py: the largest batch in a memory limit; the simulated forward against eager
- measure.py, launches.py, report.py: memory, bytes held, medians; launches and syncs; ratios and tables
- gpu_check.py (``make gpu-check``), __main__.py (``python -m h2o.bench``: exploratory, printed)

Imports core, cli, store, assets and tasks (the task base class); never parity or pipeline."""
