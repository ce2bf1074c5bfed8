"""Offline fit of KVQuant's constants on a calibration text: per-channel key ranges and per-layer datatypes.

1. The model runs over the calibration windows (a plain forward, no policy); each layer's keys (after RoPE, as
   the cache receives them) and values are collected; pre-RoPE keys are the same keys turned back by their
   column (:func:`h2o.core.quant.rope.rotate`).
2. Per-channel key ranges, per layer, KV head and channel, before and after RoPE: min / max, and the 0.5% /
   99.5% quantiles (the range when the 1% outliers are kept apart).
3. Datatypes: for every normalisation a ``kvquant`` config can ask for (keys per channel or per token, pre- or
   post-RoPE, with or without outliers; values with or without outliers) and every bit width, each layer's
   activations are normalised exactly as :meth:`KVQuant.normalise` does, the outliers dropped, and a 1-D k-means
   (Lloyd's algorithm on a 4,096-bin histogram of the normalised values in [-1, 1], started at the quantiles)
   gives the ``2**bits`` points. Unweighted: KVQuant weights the k-means by Fisher information (squared
   gradients), which needs a backward pass over the calibration text; not done here.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .base import BITS
from .kvquant import OUTLIER_FRACTION, KVQuant, variant
from .rope import head_dim_of, rotary_inv_freq, rotate

BINS = 4096


@torch.no_grad()
def collect(model, windows: torch.Tensor, batch_size: int = 4):
    """windows (N, W) token ids -> per layer (keys, values), each (Hkv, N * W, D) fp32 after RoPE; cols (N * W,)."""
    keys, values = [], []  # per batch, per layer (b, H, W, D)
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size].to(model.device)
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        keys.append([layer.keys.float().cpu() for layer in cache.layers])
        values.append([layer.values.float().cpu() for layer in cache.layers])
    keys, values = ([torch.cat(x).transpose(0, 1).flatten(1, 2) for x in zip(*kv)] for kv in (keys, values))
    cols = torch.arange(windows.shape[1]).repeat(len(windows))
    return keys, values, cols


def kmeans_1d(u: torch.Tensor, k: int, iters: int = 100) -> torch.Tensor:
    """u (n,) in [-1, 1] -> (k,) sorted centroids minimising the squared error (histogram Lloyd's)."""
    hist = torch.histc(u.double(), bins=BINS, min=-1, max=1)
    centers = torch.linspace(-1, 1, BINS + 1, dtype=torch.float64)
    centers = (centers[1:] + centers[:-1]) / 2
    cdf = hist.cumsum(0) / hist.sum()
    c = centers[torch.searchsorted(cdf, (torch.arange(k, dtype=torch.float64) + 0.5) / k).clamp(max=BINS - 1)]
    for _ in range(iters):
        c = c.sort().values
        assign = torch.searchsorted((c[1:] + c[:-1]) / 2, centers)
        w = torch.zeros(k, dtype=torch.float64).index_add_(0, assign, hist)
        s = torch.zeros(k, dtype=torch.float64).index_add_(0, assign, hist * centers)
        new = torch.where(w > 0, s / w.clamp(min=1e-30), c)
        if torch.equal(new, c):
            break  # converged
        c = new
    return c.sort().values.float()


def fit(model, windows: torch.Tensor, bits=BITS, batch_size: int = 4, meta: dict | None = None) -> dict:
    """The calibration dict :class:`KVQuant` reads (``torch.save`` it). windows (N, W) token ids."""
    keys, values, cols = collect(model, windows, batch_size)
    inv_freq = rotary_inv_freq(model)
    frames = {"post": keys}
    if inv_freq is not None:
        frames["pre"] = [rotate(k[None], cols, inv_freq, -1)[0] for k in keys]
    q = torch.tensor([OUTLIER_FRACTION / 2, 1 - OUTLIER_FRACTION / 2])
    ranges = {}
    for frame, ks in frames.items():  # per layer (H, n, D)
        qs = [torch.quantile(k.transpose(1, 2).reshape(-1, k.shape[1]), q, dim=-1).view(2, k.shape[0], -1) for k in ks]
        ranges[frame] = {"min": torch.stack([k.amin(1) for k in ks]), "max": torch.stack([k.amax(1) for k in ks]),
                         "qlo": torch.stack([x[0] for x in qs]), "qhi": torch.stack([x[1] for x in qs])}  # (L, H, D)
    cal = {"num_layers": len(keys), "kv_heads": keys[0].shape[0], "head_dim": head_dim_of(model.config),
           "outlier_fraction": OUTLIER_FRACTION, "tokens": int(windows.numel()), "ranges": ranges,
           "codebooks": {}, **(meta or {})}
    for per_channel in (True, False):
        for pre_rope in ((True, False) if inv_freq is not None else (False,)):
            for outliers in (True, False):
                quant = KVQuant(BITS[0], per_channel, pre_rope, False, outliers, cal).bind(model)
                for kind, acts in (("key", keys), ("value", values)):
                    name = variant(kind, per_channel, pre_rope, outliers)
                    if f"{name}/{bits[0]}" in cal["codebooks"]:
                        continue  # values do not depend on the key options
                    books = {b: [] for b in bits}
                    for layer, x in enumerate(acts):  # (H, N * W, D) -> windows as the batch, from column 0
                        x = x.view(x.shape[0], len(windows), -1, x.shape[-1]).transpose(0, 1)
                        u, idx, _ = quant.normalise(x, kind, layer, 0)  # (N, H, W, D)
                        keep = torch.ones_like(u, dtype=torch.bool)
                        if idx is not None:
                            keep.scatter_(-1, idx, False)
                        sample = u[keep].clamp(-1, 1)
                        for b in bits:
                            books[b].append(kmeans_1d(sample, 2 ** b))
                    for b in bits:
                        cal["codebooks"][f"{name}/{b}"] = torch.stack(books[b])  # (L, 2**b)
    return cal
