"""Will the model's weights fit? Checked before anything loads, from ``params`` in conf/model/*.yaml (no hub).

    check_fits_here(spec)        # h2o-run: the weights vs this machine's RAM (CPU) or its GPUs' memory (CUDA)
    check_fits_request(spec)     # a Slurm launch: the weights vs what ``model.resources`` asks for

Weight bytes = ``params`` x the size of the dtype the model loads in (``auto``: fp32 on the CPU, bf16 on CUDA).
The weights alone are a lower bound of what a run needs (activations and the KV cache come on top), so a refusal
is certain, a pass is not a promise. ``params: null`` (unknown) skips the check. Also: this process's resident
memory now (:func:`rss_bytes`, read by the measurements and the streaming task).
"""
from __future__ import annotations

import os
from pathlib import Path

from h2o.core.validate import ConfigError

GB = 1e9
CARD_GB = 80  # the GPU card conf/model's resources assume (conf/cluster.yaml: constraint a100|h100, 80 GB)
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def dtype_bytes(dtype: str, cuda: bool) -> tuple[int, str]:
    """(bytes per weight, dtype name) of ``model.dtype`` on the device the run uses."""
    from h2o.assets.models import _DTYPES

    if dtype == "auto":
        return (2, "bf16, auto on CUDA") if cuda else (4, "fp32, auto on the CPU")
    return BYTES[str(_DTYPES[dtype]).replace("torch.", "")], dtype


def weights(spec, cuda: bool) -> tuple[float, str]:
    """(bytes, "65.7e9 params x 2 bytes, fp16") of the model's weights on the device the run uses."""
    size, name = dtype_bytes(spec.dtype, cuda)
    return spec.params * size, f"{spec.params / 1e9:.3g}e9 params x {size} bytes, {name}"


def host_memory() -> int:
    """Bytes of RAM this process may use: the physical memory, or the cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_memory(device_map) -> tuple[int, str]:
    """(bytes, "1 GPU (NVIDIA H200)") of the CUDA devices ``device_map`` places weights on: one for ``cuda[:i]`` or
    an int, every visible one for ``auto``/``balanced``/... or a dict naming several."""
    import torch

    n = torch.cuda.device_count()
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    picked = set()
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            picked.add(v)
        elif isinstance(v, str) and v.startswith("cuda"):
            picked.add(int(v.split(":", 1)[1]) if ":" in v else torch.cuda.current_device())
        elif v is None or v in ("auto", "balanced", "balanced_low_0", "sequential"):
            picked.update(range(n) if v is not None else [torch.cuda.current_device()])
    picked = sorted(i for i in picked if i < n)
    props = [torch.cuda.get_device_properties(i) for i in picked]
    names = sorted({p.name for p in props})
    return sum(p.total_memory for p in props), f"{len(props)} GPU{'s' * (len(props) != 1)} ({', '.join(names)})"


def on_cuda(spec) -> bool:
    """Whether ``spec.load()`` puts the weights on CUDA here (h2o.assets.models.load_model's rule)."""
    import torch

    from h2o.assets.models import wants_cuda

    return wants_cuda(spec.device_map) or (spec.device_map is None and torch.cuda.is_available())


def fitting(capacity: float, cuda: bool, dtype: str) -> str:
    """What fits in ``capacity`` bytes: the largest parameter count, and the models of conf/model that fit."""
    from omegaconf import OmegaConf

    from h2o.assets.paths import CONF

    size = dtype_bytes(dtype, cuda)[0]
    names = []
    for f in sorted((CONF / "model").glob("*.yaml")):
        node = OmegaConf.load(f)
        params = node.get("params")
        if isinstance(params, int) and params * dtype_bytes(node.get("dtype", "auto"), cuda)[0] <= capacity:
            names.append(f.stem)
    return f"up to {capacity / size / 1e9:.3g}e9 params at {size} bytes; conf/model: {', '.join(names) or 'none'}"


def check_fits_here(spec) -> None:
    """ConfigError when the weights cannot fit where this machine would load them, or the config asks for a GPU
    this machine does not have (h2o-run, before anything loads)."""
    import torch

    if spec.wants_gpu and not torch.cuda.is_available():
        raise ConfigError(f"model={spec.name}: a GPU config (device_map={spec.device_map!r}, model.resources.gpus="
                          f"{(spec.resources or {}).get('gpus')}) but torch sees no GPU here; allowed on this machine: "
                          f"model.device_map=null model.resources.gpus=0 (a CPU run)")
    offloads = isinstance(spec.device_map, dict) and any(v in ("cpu", "disk") for v in spec.device_map.values())
    if spec.params is None or offloads:
        return
    cuda = on_cuda(spec)
    need, how = weights(spec, cuda)
    have, where = gpu_memory(spec.device_map) if cuda else (host_memory(), "RAM")
    if need > have:
        raise ConfigError(f"model={spec.name}: {need / GB:.1f} GB of weights ({how}) do not fit in this machine's "
                          f"{have / GB:.1f} GB of {where}; fits: {fitting(have, cuda, spec.dtype)}")


def check_fits_request(spec) -> None:
    """ConfigError when the weights cannot fit in what ``model.resources`` asks of a Slurm node (gpus x 80 GB
    cards, or mem_gb of RAM for a CPU task)."""
    if spec.params is None:
        return
    r = spec.resources or {}
    gpus = int(r.get("gpus") or 0)
    cuda = gpus > 0
    need, how = weights(spec, cuda)
    have = gpus * CARD_GB * GB if cuda else float(r.get("mem_gb") or 0) * GB
    asked = f"model.resources.gpus={gpus} x {CARD_GB} GB cards" if cuda else f"model.resources.mem_gb={r.get('mem_gb')}"
    if r and need > have:
        raise ConfigError(f"model={spec.name}: {need / GB:.1f} GB of weights ({how}) do not fit in {asked}; "
                          f"fits: {fitting(have, cuda, spec.dtype)}")
