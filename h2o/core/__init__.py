"""Core: the policies, the simulated mask, the evicting cache, the attention function and ``attach``.

Imports torch and transformers only: nothing above it in the package (not assets, tasks, pipeline or bench)."""
