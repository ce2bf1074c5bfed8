"""Measurement: resident memory (current and peak), bytes held by a KV cache, device sync, medians.

Used by the throughput and streaming drivers; knows nothing about policies or tasks."""
from __future__ import annotations

import statistics
import threading
import time

import torch
from transformers.cache_utils import Cache

from h2o.assets.resources import rss_bytes  # resident memory now (the streaming task's samples read it too)
from h2o.tasks.batching import cuda_devices


# ------------------------------------------------------------------------------------------ memory

def proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a ``key: N kB`` line of a /proc file (``VmHWM`` in /proc/self/status, ``MemTotal`` in
    /proc/meminfo), or None where the file or line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _hwm_bytes() -> int | None:
    """Peak resident memory since the last reset (Linux ``VmHWM``), or None."""
    return proc_kib_field("/proc/self/status", "VmHWM")


def _reset_hwm() -> bool:
    """Reset this process's peak resident memory (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm_bytes() is not None
    except OSError:
        return False


def release_freed() -> bool:
    """Hand memory freed by earlier runs back to the system (glibc ``malloc_trim``), so that the next run's resident
    growth counts what it needs rather than what the allocator kept; False where there is no glibc."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect(1)
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class PeakRSS:
    """Context manager: ``.peak`` = the process's peak resident memory inside it, ``.start`` = at its start.

    Linux: the kernel's peak (``VmHWM``) is reset on entry and read on exit: exact, and nothing runs meanwhile.
    Elsewhere a thread samples every ``interval`` s (it competes for the GIL: timings get noisier)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        if not _reset_hwm():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, _hwm_bytes() or 0)
        self.peak = max(self.peak, rss_bytes())


def kv_bytes(cache: Cache) -> tuple[int, int]:
    """(bytes of key/value storage held by ``cache``, bytes of the evicting cache's per-slot state).

    Storage bytes: a key tensor that is a view of a larger buffer counts the whole buffer (it keeps it alive);
    a quantized cache adds the sink it keeps as computed and its quantizer's per-model constants (once)."""
    seen: set[int] = set()
    quant = getattr(cache, "quant", None)
    kv, meta = (quant.const_bytes() if quant is not None else 0), 0
    for layer in cache.layers:
        fields = [(getattr(layer, name, None), is_meta) for name, is_meta in
                  (("keys", False), ("values", False), ("pos", True), ("acc", True))]
        for t, is_meta in fields + [(t, False) for t in getattr(layer, "sink", None) or ()]:
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            if is_meta:
                meta += st.nbytes()
            else:
                kv += st.nbytes()
    return kv, meta


def held_tokens(cache: Cache) -> int | None:
    """Tokens an evicting cache holds (slots with a position, over layers, sequences and KV heads: beside the
    bytes stored, which count empty slots of a padded layer too); None for transformers' caches."""
    held = getattr(cache, "held_tokens", None)
    return None if held is None else int(held().sum())


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- GPUs
gpu_devices = cuda_devices  # every CUDA device the model spans (h2o.tasks.batching, which sizes batches by them)


def reset_gpu_peaks(devices) -> None:
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)


def gpu_peak_bytes(devices) -> int | None:
    """Peak allocated bytes summed over ``devices`` since the last reset (None without a GPU)."""
    return sum(torch.cuda.max_memory_allocated(d) for d in devices) if devices else None


class Timer:
    """Seconds of a block: CUDA events on every GPU the model spans (elapsed on the first, after all are done),
    ``perf_counter`` on the CPU. ``.seconds`` after the block."""

    def __init__(self, devices=()):
        self.devices = list(devices)

    def __enter__(self):
        if self.devices:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(self.devices[0]))
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.devices:
            for d in self.devices[1:]:  # the last device's work finishes before the first's end event
                torch.cuda.current_stream(self.devices[0]).wait_stream(torch.cuda.current_stream(d))
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.devices[0]))
            end.synchronize()
            self.seconds = self.start.elapsed_time(end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

