"""``ModelSpec``: what conf/model/*.yaml instantiates. Cheap to build (validation only); ``load()`` loads.

    spec = ModelSpec(name="smollm2-135m", pretrained="smollm2-135m", dtype="fp32")
    model, tokenizer = spec.load()      # cached: the next job of a sweep with the same model reuses it

``pretrained`` is a hub id, a local folder, ``smollm2-135m`` (the offline default, h2o.assets.models) or
``tiny:<arch>`` (a saved tiny random model, h2o.assets.tiny).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from h2o.assets.models import _DTYPES, TINY_ARCHS, load_model

DTYPES = ("auto", *_DTYPES)
_LOADED: dict[tuple, tuple[Any, Any]] = {}  # one model at a time, reused across the jobs of a sweep


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the value and what is allowed."""


def resolve_tiny(pretrained: str) -> str:
    """``tiny:<arch>`` -> the saved tiny checkpoint's folder; anything else unchanged."""
    if str(pretrained).startswith("tiny:"):
        from h2o.assets.tiny import tiny_checkpoint

        return str(tiny_checkpoint(str(pretrained).split(":", 1)[1]))
    return str(pretrained)


@dataclass
class ModelSpec:
    name: str
    pretrained: str
    dtype: str = "auto"
    device_map: Any = None

    def __post_init__(self):
        if not self.name or not self.pretrained:
            raise ConfigError(f"model: name and pretrained are required (got {self.name!r}, {self.pretrained!r})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r}: allowed: {', '.join(DTYPES)}")
        if str(self.pretrained).startswith("tiny:") and self.pretrained[5:] not in TINY_ARCHS:
            raise ConfigError(f"model.pretrained={self.pretrained!r}: allowed tiny:<arch> with arch in "
                              f"{', '.join(TINY_ARCHS)}")
        check_device(self.device_map)

    def max_positions(self) -> int | None:
        """The longest sequence the model takes (its config's max_position_embeddings / n_positions), read
        without loading weights: the tiny models' constant, or a local folder's config.json; None if unknown."""
        if str(self.pretrained).startswith("tiny:"):
            from h2o.assets.tiny import MAX_POSITIONS

            return MAX_POSITIONS
        import json
        from pathlib import Path

        cfg = Path(str(self.pretrained)).expanduser() / "config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
                if isinstance(data.get(key), int):
                    return data[key]
        return None

    def geometry(self) -> tuple[int | None, bool | None, int | None]:
        """(head size, has rotary embeddings, layers) from the model's config, without loading weights
        (the tiny models, a local folder, SmolLM2 once cached, a hub id in the local cache); Nones if unknown."""
        config = None
        try:
            if str(self.pretrained).startswith("tiny:"):
                from h2o.assets.models import tiny_config

                config = tiny_config(self.pretrained[5:])
            else:
                from transformers import AutoConfig

                from h2o.assets.models import SMOLLM2_NAME, _smollm2_dir

                path = _smollm2_dir() if self.pretrained == SMOLLM2_NAME else self.pretrained
                config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError):
            return None, None, None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = any(hasattr(config, k) for k in ("rope_theta", "rope_parameters", "rotary_pct", "rope_scaling"))
        return head_dim, rotary, config.num_hidden_layers

    def key(self) -> tuple:
        return (self.pretrained, self.dtype, str(self.device_map))

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), eval mode. Keeps the last loaded model for the next job of the sweep."""
        if self.key() not in _LOADED:
            release()
            _LOADED[self.key()] = load_model(resolve_tiny(self.pretrained), self.dtype, self.device_map)
        return _LOADED[self.key()]


def check_device(device_map: Any) -> None:
    """ConfigError when ``device_map`` asks for a CUDA device this machine does not have (cheap: no model)."""
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


def release() -> None:
    """Drop the cached model (and free GPU memory)."""
    _LOADED.clear()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
