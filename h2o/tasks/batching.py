"""Batch size: a fixed number or ``auto`` (sized to the accelerator's free memory), and how it was chosen.

``task.batch_size`` is a positive int, ``auto``, or, for multiple choice (lm-eval's spelling), ``auto:N``: lm-eval
sorts the requests longest first and sizes the batch again at N evenly spaced points, so shorter requests get
larger batches. The size used and how it was chosen go to metrics.json (``batch_size``, ``batch_sizing``).

``auto`` on CUDA (free memory, then one check; rule ``cuda_memory``): run one batch of the task's longest input at
batch 1 and take the memory it added at its peak (``torch.cuda.max_memory_allocated``) as the cost of one
sequence; the batch is ``HEADROOM`` x the free memory (``torch.cuda.mem_get_info`` plus what torch's allocator
holds unused) / that cost, capped at ``MAX_BATCH`` (lm-eval's ``max_batch_size``) and the number of items; that
batch is run once as a check and halved on out-of-memory until it fits. A model spread over several GPUs
(``device_map``) is sized by its tightest GPU.
``auto`` on a CPU (rule ``cpu_default``): ``CPU_BATCH``, capped the same way, nothing probed: host memory is
rarely the limit and batching past a few sequences buys a CPU little time.

A batch size never changes a number: scoring rows are padded and masked per sequence (tested: batch 1 and
``auto`` give the same metrics). Sampled generation draws per batch, so a sampled summarization run depends on it.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch

from h2o.core.validate import ConfigError, is_int

BatchSize = Any  # a positive int, "auto" or "auto:N": checked by check_batch_size (a one-line error naming both)
HEADROOM = 0.9  # of the free memory the batch may take
MAX_BATCH = 64  # the largest auto batch (lm-eval's max_batch_size default)
CPU_BATCH = 8  # auto on a CPU


def check_batch_size(value: Any, name: str = "task.batch_size", schedule: bool = False) -> None:
    """ConfigError unless ``value`` is a positive int, ``auto`` or (``schedule``: lm-eval tasks) ``auto:N``."""
    if (is_int(value) and value > 0) or value == "auto":
        return
    if schedule and isinstance(value, str) and value.startswith("auto:") and value[5:].isdigit() and int(value[5:]) > 0:
        return
    allowed = "a positive int, auto" + (", auto:N (N >= 1 sizings as the requests get shorter)" if schedule else "")
    raise ConfigError(f"{name}={value!r}: allowed: {allowed}")


def from_text(value: Any) -> Any:
    """A command line's batch size: ``"4"`` -> 4; anything else unchanged (checked by :func:`check_batch_size`)."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


@dataclass
class Sizing:
    """A batch size and how it was chosen (metrics.json ``batch_sizing``)."""

    size: int
    rule: str  # fixed | cuda_memory | cpu_default | one_at_a_time
    how: str  # one line: the numbers behind it

    def record(self) -> dict:
        return {"size": self.size, "rule": self.rule, "how": self.how}


def record(requested: Any, sizings: list[Sizing]) -> dict:
    """metrics.json fields: ``batch_size`` (the first size used; None if nothing ran, e.g. every request came
    from the cache) and ``batch_sizing`` {requested, rule, sizes, how}."""
    sizes = [s.size for s in sizings]
    return {"batch_size": sizes[0] if sizes else None,
            "batch_sizing": {"requested": requested, "rule": sizings[0].rule if sizings else None, "sizes": sizes,
                             "how": "; ".join(s.how for s in sizings)}}


def cuda_devices(model) -> list:
    """Every CUDA device holding a parameter or buffer of ``model`` (several with a device_map), by index."""
    found = {t.device for t in list(model.parameters()) + list(model.buffers()) if t.device.type == "cuda"}
    return sorted(found, key=lambda d: d.index or 0)


def choose(requested: Any, model, step: Callable[[int], Any], n_items: int, max_batch: int = MAX_BATCH,
           mem=None) -> Sizing:
    """The batch size for ``requested`` (an int: itself; ``auto``: see the module docstring). ``step(b)`` runs the
    task's most expensive batch of ``b`` items (the longest input); ``mem`` is ``torch.cuda`` (a stand-in in
    tests)."""
    if is_int(requested):
        return Sizing(requested, "fixed", f"task.batch_size={requested}")
    cap = max(1, min(max_batch, n_items))
    devices = cuda_devices(model)
    if not devices:
        return Sizing(min(CPU_BATCH, cap), "cpu_default", f"auto on the CPU: {CPU_BATCH} (nothing probed), "
                                                          f"at most {cap} (max {max_batch}, {n_items} items)")
    if mem is None:
        import torch

        mem = torch.cuda
    return from_free_memory(step, devices, cap, mem)


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def fits(step: Callable[[int], Any], size: int, mem) -> bool:
    """Whether ``step(size)`` runs without running out of memory (the memory is released either way)."""
    try:
        step(size)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is an answer; anything else is raised
        if not is_oom(exc):
            raise
        del exc
        gc.collect()  # the traceback's frames may still hold the failed batch's tensors
        mem.empty_cache()
        return False
    mem.empty_cache()
    return True


def from_free_memory(step: Callable[[int], Any], devices: list, cap: int, mem) -> Sizing:
    """The ``cuda_memory`` rule: measured cost of one sequence, free memory, one checked batch, halved on OOM."""
    gc.collect()
    mem.empty_cache()
    base = {d: mem.memory_allocated(d) for d in devices}
    for d in devices:
        mem.reset_peak_memory_stats(d)
    step(1)  # an out-of-memory error here: even one sequence does not fit; the run fails with it
    per = {d: max(mem.max_memory_allocated(d) - base[d], 1) for d in devices}
    mem.empty_cache()
    free = {d: mem.mem_get_info(d)[0] + mem.memory_reserved(d) - mem.memory_allocated(d) for d in devices}
    tight = min(devices, key=lambda d: free[d] / per[d])
    estimate = max(1, int(HEADROOM * free[tight] / per[tight]))
    size, halved = min(estimate, cap), []
    while size > 1 and not fits(step, size, mem):
        halved.append(size)
        size //= 2
    how = (f"auto on {tight}: {HEADROOM} x {free[tight] / 2**30:.2f} GiB free / {per[tight] / 2**20:.1f} MiB per "
           f"sequence (batch 1 measured) = {estimate}, at most {cap}"
           + (f", out of memory at {', '.join(map(str, halved))}" if halved else "") + f": {size}")
    return Sizing(size, "cuda_memory", how)


def to_left_padding(inps: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and (B,) lengths -> left-padded ids (B, T) and their attention mask (B, T) bool."""
    T = inps.shape[1]
    shift = T - lengths  # (B,)
    src = (torch.arange(T, device=inps.device)[None, :] - shift[:, None]).clamp(min=0)  # (B, T)
    mask = torch.arange(T, device=inps.device)[None, :] >= shift[:, None]
    return torch.where(mask, inps.gather(1, src), 0), mask


def from_left_padding(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Left-padded logits (B, T, V) -> right-padded (B, T, V) (pad positions hold what was shifted in)."""
    T = logits.shape[1]
    src = (torch.arange(T, device=logits.device)[None, :] + (T - lengths)[:, None]) % T  # (B, T)
    return logits.gather(1, src[:, :, None].expand(-1, -1, logits.shape[-1]))
