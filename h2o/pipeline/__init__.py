"""Pipeline: configs to runs (spec, sweep, run, jobs, Slurm) and the wandb mirror; the records themselves are
written through store.

Imports tasks, bench, store, core, cli and assets; analysis/ imports none of the package."""
