"""The KV cache a run actually held, for its record: tokens (summed over layers and KV heads, per sequence) and
their bytes (keys and values), right after the prompt's cut and at the end: the cache the last scored token is
predicted from (a window's last token is never an input).

* :func:`simulated_held`: a one-pass task (the simulated mask holds no cache) from the policy's per-layer budget,
  which is what the evicting cache holds after the same tokens (tests/test_methods_experiment.py checks it
  against :meth:`h2o.core.cache.EvictingCache.footprint`; a pooled policy, adakv, stores its heads padded, more
  than these bytes held). With a prompt of ``context`` tokens the
  cut keeps ``min(n_l, C)`` tokens per layer ``l`` and KV head; at the end ``compress=decode`` still holds that,
  ``compress=prefill`` holds it plus the ``W - 1 - C`` continuation tokens fed. Without a prompt the budget is a
  ratio of the window and the end holds ``min(n_l, W - 1)``. A sliding-window layer holds at most its window.

A generation measures its cache instead (:meth:`h2o.core.cache.EvictingCache.footprint`). Bytes count keys and
values at the model's element size; with a KV quantizer :func:`simulated_held` gives tokens only (bytes None).
"""
from __future__ import annotations

import torch


def geometry(model) -> tuple[int, int, int, list[int | None]]:
    """(layers, KV heads, head size, each layer's sliding window or None) from the model's config."""
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    window = getattr(cfg, "sliding_window", None)
    return layers, kv, dim, [window if kind == "sliding_attention" else None for kind in kinds]


def per_layer(policy, reference: int, layers: int, most: int) -> list[int]:
    """Each layer's budget in tokens per KV head for a reference length (the arriving token counted); ``most``
    for a policy that never evicts."""
    counts = policy.counts(torch.tensor([reference]))
    if policy.is_full:
        return [most] * layers
    return [int(policy.layer_counts(counts, layer, layers).total[0]) for layer in range(layers)]


def simulated_held(model, policy, window: int, context: int | None, quant=None) -> dict:
    """``kv_tokens_cut`` / ``kv_tokens_end`` (token x KV head slots held per sequence, all layers) and
    ``kv_bytes_cut`` / ``kv_bytes_end``; ``*_cut`` is None without a prompt."""
    layers, kv, dim, windows = geometry(model)
    budget = per_layer(policy, context or window, layers, window)
    prefill = policy.compress == "prefill"

    def capped(n: int, win: int | None) -> int:
        return n if win is None else min(n, win)

    fed = window - 1  # the inputs up to the last scored prediction
    cut = [capped(min(n, context), w) for n, w in zip(budget, windows)] if context else None
    if context:
        end = [capped(min(n, context) + (fed - context) if prefill else min(n, fed), w)
               for n, w in zip(budget, windows)]
    else:
        end = [capped(min(n, fed), w) for n, w in zip(budget, windows)]
    size = None if quant is not None else 2 * dim * torch.empty((), dtype=model.dtype).element_size()
    tokens = lambda held: None if held is None else kv * sum(held)  # noqa: E731
    nbytes = lambda held: None if held is None or size is None else tokens(held) * size  # noqa: E731
    return {"kv_tokens_cut": tokens(cut), "kv_tokens_end": tokens(end), "kv_bytes_cut": nbytes(cut),
            "kv_bytes_end": nbytes(end), "kv_tokens_end_per_layer": end}
