"""Bench: measurement (time, memory, KV bytes) and the throughput, simulated-forward and streaming drivers.

Imports core, cli, assets and tasks (the task base class); never pipeline."""
