"""``ModelSpec``: what conf/model/*.yaml instantiates. Cheap to build (validation only); ``load()`` loads.

    spec = ModelSpec(name="smollm2-135m", pretrained="smollm2-135m", dtype="fp32")
    model, tokenizer = spec.load()      # cached: the next job of a sweep with the same model reuses it

``pretrained`` is a hub id, a local folder, a packaged model (``smollm2-135m``, the offline default, or
``gemma3-270m``: h2o.assets.packaged) or ``tiny:<arch>`` (a saved tiny random model, h2o.assets.tiny).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h2o.assets.models import _DTYPES, ATTENTION, TINY_ARCHS, DeviceError, load_model, wants_cuda
from h2o.core.validate import ConfigError, check

DTYPES = ("auto", *_DTYPES)
_LOADED: dict[tuple, tuple[Any, Any]] = {}  # one model at a time, reused across the jobs of a sweep


def resolve_tiny(pretrained: str) -> str:
    """``tiny:<arch>`` -> the saved tiny checkpoint's folder; anything else unchanged."""
    if str(pretrained).startswith("tiny:"):
        from h2o.assets.tiny import tiny_checkpoint

        return str(tiny_checkpoint(str(pretrained).split(":", 1)[1]))
    return str(pretrained)


def resolve_pretrained(pretrained):
    """A packaged model (``smollm2-135m``, ``gemma3-270m``) -> its cached checkpoint; ``tiny:<arch>`` -> the tiny
    checkpoint; else unchanged (a model object too)."""
    if not isinstance(pretrained, str):
        return pretrained
    from h2o.assets.packaged import packaged, packaged_path

    if packaged(pretrained):
        return str(packaged_path(packaged(pretrained)))
    return resolve_tiny(pretrained)


@dataclass
class ModelSpec:
    name: str
    pretrained: str
    dtype: str = "auto"
    device_map: Any = None
    resources: dict | None = None  # per Slurm array task: gpus, mem_gb, cpus, load_min, s_per_mtok (RESOURCES)
    params: int | None = None  # parameter count (weights' bytes = params x the dtype's size)
    positions: int | None = None  # the longest sequence it takes (max_position_embeddings), known without the hub
    attn_implementation: str = "auto"  # as loaded (h2o.assets.models.resolve_attention): auto, sdpa, eager, flash_*

    def __post_init__(self):
        check_cpu_run(self.device_map, self.resources)
        if not self.name or not self.pretrained:
            raise ConfigError(f"model: name and pretrained are required (got {self.name!r}, {self.pretrained!r})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r}: allowed: {', '.join(DTYPES)}")
        check_pretrained(self.pretrained)
        check_device(self.device_map)
        check_resources(self.resources)
        check(self.attn_implementation in ATTENTION or "/" in str(self.attn_implementation),
              f"model.attn_implementation={self.attn_implementation!r}: allowed: {', '.join(ATTENTION)} or a "
              f"kernels hub id owner/repo")
        check_flash(self.attn_implementation, self.dtype, self.device_map)
        check(self.params is None or (isinstance(self.params, int) and not isinstance(self.params, bool)
                                      and self.params > 0),
              f"model.params={self.params!r}: expected a parameter count (an integer > 0) or null")
        check(self.positions is None or (isinstance(self.positions, int) and not isinstance(self.positions, bool)
                                         and self.positions > 0),
              f"model.positions={self.positions!r}: expected the model's max positions (an integer > 0) or null")

    @property
    def wants_gpu(self) -> bool:
        """A GPU config: device_map ``auto`` or a CUDA device, or resources asking for GPUs."""
        return wants_cuda(self.device_map) or bool((self.resources or {}).get("gpus"))

    def config(self) -> dict:
        """The checkpoint's config.json read without loading weights ({} if unknown: a hub id not cached)."""
        return checkpoint_config(self.pretrained)

    def max_positions(self) -> int | None:
        """The longest sequence the model takes: the conf/model yaml's ``positions`` (known offline, before any
        download: a dry run clips its grids by it), else the checkpoint's config.json (max_position_embeddings /
        n_positions), None if unknown."""
        if self.positions is not None:
            return self.positions
        cfg = self.config()
        return next((cfg[k] for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
                     if isinstance(cfg.get(k), int)), None)

    def num_layers(self) -> int | None:
        cfg = self.config()
        return next((cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(cfg.get(k), int)),
                    None)

    def geometry(self) -> tuple[int | None, bool | None, int | None]:
        """(head size, has rotary embeddings, layers) from the model's config, without loading weights
        (the tiny models, a local folder, a packaged model once cached, a hub id in the local cache); Nones if
        unknown."""
        config = None
        try:
            if str(self.pretrained).startswith("tiny:"):
                from h2o.assets.models import tiny_config

                config = tiny_config(self.pretrained[5:])
            else:
                from transformers import AutoConfig

                from h2o.assets.packaged import packaged, packaged_dir

                path = packaged_dir(packaged(self.pretrained)) if packaged(self.pretrained) else self.pretrained
                config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError):
            return None, None, None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = any(hasattr(config, k) for k in ("rope_theta", "rope_parameters", "rotary_pct", "rope_scaling"))
        return head_dim, rotary, config.num_hidden_layers

    def key(self) -> tuple:
        return (self.pretrained, self.dtype, str(self.device_map), self.attn_implementation)

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), eval mode. Keeps the last loaded model for the next job of the sweep."""
        import torch

        if self.wants_gpu and not torch.cuda.is_available():
            raise DeviceError(f"model={self.name}: a GPU config (device_map={self.device_map!r}, "
                              f"gpus={(self.resources or {}).get('gpus')}) but torch sees no GPU (torch "
                              f"{torch.__version__}, CUDA {torch.version.cuda}); no CPU fallback; to run on the CPU "
                              f"set model.device_map=null model.resources.gpus=0")
        if self.key() not in _LOADED:
            release()
            _LOADED[self.key()] = load_model(resolve_tiny(self.pretrained), self.dtype, self.device_map,
                                               self.attn_implementation)
        return _LOADED[self.key()]


RESOURCES = {"gpus": int, "mem_gb": (int, float), "cpus": int, "load_min": (int, float), "s_per_mtok": (int, float)}


def check_resources(resources: dict | None) -> None:
    """ConfigError unless ``resources`` is null or a mapping of RESOURCES keys to numbers >= 0."""
    if resources is None:
        return
    if not isinstance(resources, dict):
        raise ConfigError(f"model.resources={resources!r}: expected a mapping with keys {', '.join(RESOURCES)}")
    for key, value in resources.items():
        if key not in RESOURCES:
            raise ConfigError(f"model.resources.{key}: unknown; allowed: {', '.join(RESOURCES)}")
        if isinstance(value, bool) or not isinstance(value, RESOURCES[key]) or value < 0:
            raise ConfigError(f"model.resources.{key}={value!r}: expected a number >= 0")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
DEVICE_MAPS = ("null", "auto", "balanced", "balanced_low_0", "sequential", "cpu", "cuda", "cuda:<n>", "<n>", "a dict")
ALLOWED_PRETRAINED = ("a checkpoint folder (with config.json), a hub id owner/name, smollm2-135m, gemma3-270m or "
                      "tiny:<arch>")


def hub_cache_dir(repo_id: str) -> Path:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    return hub / f"models--{repo_id.replace('/', '--')}"


def check_pretrained(pretrained: Any, key: str = "model.pretrained") -> None:
    """ConfigError unless ``pretrained`` names a model that can be loaded: a tiny arch, a packaged model, a local
    checkpoint folder, or a hub id (in the local cache when HF_HUB_OFFLINE is set). Reads no weights."""
    text = str(pretrained)
    check(isinstance(pretrained, str) and text.strip() != "", f"{key}={pretrained!r}: allowed: {ALLOWED_PRETRAINED}")
    if text.startswith("tiny:"):
        check(text[5:] in TINY_ARCHS, f"{key}={text!r}: allowed tiny:<arch> with arch in {', '.join(TINY_ARCHS)}")
        return
    from h2o.assets.packaged import packaged

    if packaged(text):
        return
    path = Path(text).expanduser()
    if path.exists() or text.startswith((".", "/", "~")):
        why = "no such folder" if not path.exists() else "not a checkpoint folder (no config.json)"
        check(path.is_dir() and (path / "config.json").is_file(),
              f"{key}={text!r}: {why}; allowed: {ALLOWED_PRETRAINED}")
        return
    check(bool(HUB_ID.fullmatch(text)), f"{key}={text!r}: neither a folder nor a hub id; allowed: {ALLOWED_PRETRAINED}")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    check(not offline or hub_cache_dir(text).is_dir(), f"{key}={text!r}: not in the Hugging Face cache and "
                                                       f"HF_HUB_OFFLINE=1; allowed offline: smollm2-135m, gemma3-270m, "
                                                       f"tiny:<arch>, a local folder or a cached hub id")


def checkpoint_config(pretrained: str) -> dict:
    """config.json of ``pretrained`` without loading weights: tiny archs, a cached packaged model, a local folder,
    a hub id's cached snapshot; {} when it is not on this machine."""
    text = str(pretrained)
    if text.startswith("tiny:"):
        from h2o.assets.models import tiny_config
        from h2o.assets.tiny import MAX_POSITIONS

        return {**tiny_config(text[5:]).to_dict(), "max_position_embeddings": MAX_POSITIONS}
    from h2o.assets.packaged import packaged, packaged_dir

    if packaged(text):
        files = [packaged_dir(packaged(text)) / "config.json"]
    else:
        files = [Path(text).expanduser() / "config.json", *sorted(hub_cache_dir(text).glob("snapshots/*/config.json"))]
    for f in files:
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            text_cfg = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
            return {**text_cfg, **data}
    return {}


def check_device(device_map: Any) -> None:
    """ConfigError when ``device_map`` is not one transformers takes, or asks for a CUDA device this machine
    does not have (cheap: no model)."""
    if not isinstance(device_map, dict):
        ok = device_map is None or (isinstance(device_map, int) and not isinstance(device_map, bool)
                                    and device_map >= 0) or (isinstance(device_map, str) and (
            device_map in DEVICE_MAPS[1:7] or re.fullmatch(r"cuda:\d+", device_map) is not None))
        check(ok, f"model.device_map={device_map!r}: allowed: {', '.join(DEVICE_MAPS)}")
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    wanted = [str(v) for v in values if v is not None and (str(v).startswith("cuda") or isinstance(v, int))]
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for v in wanted:
        index = int(v) if v.isdigit() else int(v.split(":", 1)[1]) if ":" in v and v.split(":", 1)[1].isdigit() else 0
        if index >= n:
            have = f"{n} CUDA device(s)" if n else "no CUDA device"
            raise ConfigError(f"model.device_map={device_map!r}: this machine has {have}; allowed: null, cpu, auto"
                              + (f", cuda:0-{n - 1}" if n else ""))


def check_flash(attn_implementation: str, dtype: str, device_map: Any) -> None:
    """ConfigError when a flash attention kernel is asked for where it cannot run: it needs its package, a CUDA
    device and half precision (transformers refuses each only while loading the model)."""
    if attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        return
    import importlib.util

    import torch

    package = "flash_attn" if attn_implementation == "flash_attention_2" else "flash_attn_interface"
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    lacks = [f"the {package} package is not installed"] if importlib.util.find_spec(package) is None else []
    if not torch.cuda.is_available() or (values and all(v in ("cpu", "disk") for v in values)):
        lacks.append("no CUDA device" if not torch.cuda.is_available() else f"device_map={device_map!r}")
    if _DTYPES.get(dtype) is torch.float32:
        lacks.append(f"dtype={dtype}")
    check(not lacks, f"model.attn_implementation={attn_implementation}: needs its package, a CUDA device and "
                     f"dtype fp16 or bf16 (here: {', '.join(lacks)}); allowed: auto (flash where it runs, else "
                     f"sdpa), sdpa, eager")


def check_cpu_run(device_map: Any, resources: Any) -> None:
    """ConfigError when ``device_map`` names the CPU only (``cpu``, or a dict of cpu/disk) but ``resources`` asks
    for GPUs: a GPU config run on the CPU by mistake."""
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    gpus = resources.get("gpus") if isinstance(resources, dict) else None
    check(not (values and all(v in ("cpu", "disk") for v in values) and gpus),
          f"model.device_map={device_map!r} with model.resources.gpus={gpus}: a CPU run of a GPU config; allowed: "
          f"add model.resources.gpus=0 (a CPU run), or model.device_map=auto (a GPU run)")


def release() -> None:
    """Drop the cached model (and free GPU memory)."""
    _LOADED.clear()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
