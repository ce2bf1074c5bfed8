"""The KV cache a run actually held, for its record: tokens (token x KV head entries summed over the layers, per
sequence), the bytes of their keys and values, and the bytes stored (padding included), right after the prompt's cut
and at the end: the cache the last scored token is predicted from (a window's last token is never an input).

A one-pass task's fields come from one function, :func:`figures`, fed footprints in the keys of
:meth:`h2o.core.cache.EvictingCache.footprint` (``tokens_held``, ``slots_stored``, ``bytes_held``, ``bytes_stored``)
per sequence (:func:`per_sequence`: the mean over a run's batches). A generation task (long-context, summarization)
names its fields from its batches' footprints at the end with :func:`batch_fields` (its own field names, the same
means and rounding). The one-pass task's footprints:

* a real cache's ``footprint()``: a pooled policy's (:func:`measured`, below);
* for a per-head policy (the simulated mask holds no cache) :func:`formula`, what the evicting cache
  holds after the same tokens (tests/test_methods_experiment.py and tests/test_kv_figures.py check it against
  ``footprint()``). With a prompt of ``C`` tokens and a window of ``W`` (``W - 1`` fed), layer ``l``'s budget
  ``n_l`` per KV head: the cut keeps ``min(n_l, C)`` tokens per KV head; at the end ``compress=decode`` still holds
  that, ``compress=prefill`` that plus the ``W - 1 - C`` continuation tokens. Without a prompt the budget is a ratio
  of the window and the end holds ``min(n_l, W - 1)``. A sliding-window layer holds at most its window. Every head
  holds the same count, so the slots stored are the tokens held and the bytes stored their bytes, ``2 x head size x
  element size`` each (None with a KV quantizer: tokens only).
* A rule whose heads share a budget (Ada-KV; h2o.core.engine.held_by_formula) holds the same tokens per layer as
  its formula (one top-k over the layer keeps the inner policy's total) but stores each layer's heads padded to
  the largest head's count, which depends on the scores: no formula gives it, so the one-pass task feeds its windows through the evicting cache once
  more (:func:`measured`: the prompt, then the continuation as the timing appends it) and records that footprint,
  in the task's batches (a batch stores each layer padded to its largest head across its sequences, as a
  generation task's batch does: the bytes stored per sequence depend on the batch size).
"""
from __future__ import annotations

import torch

from h2o.core import engine
from h2o.core.engine import held_by_formula, layer_budget

KEYS = ("tokens_held", "slots_stored", "bytes_held", "bytes_stored")


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
    return [layer_budget(policy, reference, layer, layers, most) for layer in range(layers)]


def held_per_layer(model, policy, window: int, context: int | None) -> tuple[list[int] | None, list[int]]:
    """(tokens per KV head of each layer right after the cut (None without a prompt), the same at the end)."""
    layers, _, _, windows = geometry(model)
    budget = per_layer(policy, context or window, layers, window)

    def capped(n: int, win: int | None) -> int:
        return n if win is None else min(n, win)

    fed = window - 1  # the inputs up to the last scored prediction
    cut = [capped(min(n, context), w) for n, w in zip(budget, windows)] if context else None
    end = [capped(engine.held_after(policy, n, context, fed), w) for n, w in zip(budget, windows)]
    return cut, end


def entry_bytes(model, quant=None) -> int | None:
    """Bytes of one token x KV head entry of one layer: its key and its value (2 x head_dim x the dtype's bytes);
    None with a KV quantizer (its bytes are its own formula)."""
    if quant is not None:
        return None
    return 2 * geometry(model)[2] * torch.empty((), dtype=model.dtype).element_size()


def formula(model, held: list[int] | None, quant=None) -> dict | None:
    """One sequence's footprint from the tokens per KV head of each layer ``held``: every head holds them (None for
    None; bytes None with a KV quantizer)."""
    if held is None:
        return None
    tokens = geometry(model)[1] * sum(held)
    size = entry_bytes(model, quant)
    nbytes = None if size is None else tokens * size
    return {"tokens_held": tokens, "slots_stored": tokens, "bytes_held": nbytes, "bytes_stored": nbytes}


def measured(model, policy, wins: torch.Tensor, context: int | None, batch: int = 1,
             quant=None) -> tuple[dict | None, dict]:
    """Footprints per sequence (means over ``wins`` (N, W)) of the evicting cache fed each window as the one-pass task
    scores it: the prompt ``wins[:, :context]`` in one forward (the cut), then the ``W - 1 - context`` continuation
    tokens, in one forward under ``compress=prefill`` (appended, never evicted) or one at a time under
    ``compress=decode``; without a prompt every token one at a time, budget ratios of ``W``. -> (at the cut (None
    without a prompt), at the end)."""
    from h2o.core.attach import attach

    N, W = wins.shape
    cuts, ends = [], []  # (footprint, rows) per batch
    with torch.no_grad(), attach(model, policy, mode="real", quant=quant) as state:
        for start in range(0, N, batch):
            ids = wins[start:start + batch]  # (b, W)
            cache = state.new_cache(None if context else W)
            if context:
                model(ids[:, :context], cache=cache)
                cuts.append((cache.footprint(), len(ids)))
            rest = ids[:, context or 0:W - 1]  # (b, W - 1 - C) the continuation fed
            for step in [rest] if engine.appends_after_prompt(policy) else rest.split(1, dim=1):
                model(step, cache=cache)
            ends.append((cache.footprint(), len(ids)))
    return (per_sequence(cuts) if context else None), per_sequence(ends)


def per_sequence(footprints: list[tuple[dict, int]]) -> dict:
    """The mean per sequence of footprints, each of a batch of ``rows`` sequences. A key some footprints hold None
    for (a quantized cache's bytes, a batch logged before the key was recorded) is the mean over those that have it,
    None where none has."""
    out = {}
    for key in KEYS:
        have = [(f[key], rows) for f, rows in footprints if f.get(key) is not None]
        out[key] = sum(v for v, _ in have) / sum(n for _, n in have) if have else None
    return out


CUT = {"tokens_held": "kv_tokens_cut", "bytes_held": "kv_bytes_cut", "bytes_stored": "kv_bytes_stored_cut"}
END = {"tokens_held": "kv_tokens_end", "bytes_held": "kv_bytes_end", "bytes_stored": "kv_bytes_stored"}


def field(per_seq: dict | None, key: str, digits: int | None = None):
    """One record field from a footprint per sequence: ``round(value, digits)`` (None: a whole number), None
    without a footprint or a value."""
    return None if per_seq is None or per_seq.get(key) is None else round(per_seq[key], digits)


def batch_fields(footprints: list[tuple[dict, int]], names: dict[str, str], token_digits: int | None = None) -> dict:
    """The record fields ``names`` ({footprint key: field}, in that order) of the mean per sequence of a run's
    batches (a generation task's footprints at the end of each batch, with its rows): bytes whole, tokens to
    ``token_digits`` decimals (None: whole); {} without any batch."""
    if not sum(n for _, n in footprints):
        return {}
    per_seq = per_sequence(footprints)
    return {name: field(per_seq, key, token_digits if key == "tokens_held" else None) for key, name in names.items()}


def figures(cut: dict | None, end: dict, end_per_layer: list[int]) -> dict:
    """The record's KV fields from footprints per sequence (``cut`` None without a prompt; a byte count None with a
    KV quantizer's formula): ``kv_tokens_cut`` / ``kv_tokens_end`` (token x KV head entries held),
    ``kv_bytes_cut`` / ``kv_bytes_end`` (their keys' and values' bytes), ``kv_bytes_stored_cut`` /
    ``kv_bytes_stored`` (the bytes stored, empty slots of padded heads included) and ``kv_tokens_end_per_layer``
    (tokens per KV head of each layer at the end)."""
    out = {}
    for key in CUT:  # each figure at the cut, then at the end
        out.update({CUT[key]: field(cut, key), END[key]: field(end, key)})
    return {**out, "kv_tokens_end_per_layer": end_per_layer}


def simulated_held(model, policy, window: int, context: int | None, quant=None, wins: torch.Tensor | None = None,
                   batch: int = 1) -> dict:
    """The record's KV fields (:func:`figures`) of a one-pass task over windows of ``window`` tokens with a prompt of
    ``context`` (None: none): :func:`formula`, or for a pooled policy :func:`measured` on the run's windows ``wins``
    (N, W), ``batch`` at a time (its tokens held are the formula's: the same layer totals), or under ``interval`` on
    a sliding-window layer (what the window takes between cuts depends on what was kept)."""
    cut, end = held_per_layer(model, policy, window, context)
    if not held_by_formula(policy, geometry(model)[3]) and wins is not None:
        return figures(*measured(model, policy, wins, context, batch, quant), end)
    return figures(formula(model, cut, quant), formula(model, end, quant), end)
