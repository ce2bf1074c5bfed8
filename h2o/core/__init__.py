"""Core: the policies, the simulated mask, the evicting cache, the attention function, ``attach``, and ``validate``
(the one validation layer every entry point checks its input with).

Imports torch and transformers only: nothing above it in the package (not assets, tasks, pipeline or bench)."""
