"""``ModelSpec``: what conf/model/*.yaml instantiates. Cheap to build (validation only); ``load()`` loads.

    spec = ModelSpec(name="smollm2-135m", pretrained="smollm2-135m", dtype="fp32")
    model, tokenizer = spec.load()      # cached: the next job of a sweep with the same model reuses it

``pretrained`` is a hub id, a local folder, ``smollm2-135m`` (the offline default, h2o.models) or
``tiny:<arch>`` (a saved tiny random model, h2o.tiny).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from h2o.models import _DTYPES, TINY_ARCHS, load_model

DTYPES = ("auto", *_DTYPES)
_LOADED: dict[tuple, tuple[Any, Any]] = {}  # one model at a time, reused across the jobs of a sweep


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the value and what is allowed."""


def resolve_pretrained(pretrained: str) -> str:
    """``tiny:<arch>`` -> the saved tiny checkpoint's folder; anything else unchanged."""
    if str(pretrained).startswith("tiny:"):
        from h2o.tiny import tiny_checkpoint

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

    def key(self) -> tuple:
        return (self.pretrained, self.dtype, str(self.device_map))

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), eval mode. Keeps the last loaded model for the next job of the sweep."""
        if self.key() not in _LOADED:
            release()
            _LOADED[self.key()] = load_model(resolve_pretrained(self.pretrained), self.dtype, self.device_map)
        return _LOADED[self.key()]


def release() -> None:
    """Drop the cached model (and free GPU memory)."""
    _LOADED.clear()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
