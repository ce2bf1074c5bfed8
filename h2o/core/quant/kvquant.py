"""kvquant: KVQuant's methods (Hooper et al., 2024), each switchable so their effects can be separated.

* ``per_channel_keys``: keys are scaled per channel (per layer, KV head and channel, from ranges fitted offline,
  as KVQuant calibrates its key ranges offline); off: per token like values. Values are always per token
  (range of each vector, computed online).
* ``pre_rope``: keys are quantized before the rotary embedding: the rotation of the key's column is undone,
  the key quantized, and the rotation re-applied on use (rotary models only). Each row keeps its int32 column.
* ``nonuniform``: per-layer datatypes, one codebook of ``2**bits`` points in [-1, 1] for keys and one for values
  per layer, fitted offline (:mod:`h2o.core.quant.calibrate`: k-means of the normalised activations of a
  calibration text); off: the evenly spaced grid (plain integer quantization of the same range).
* ``outliers``: dense-and-sparse: the top 1% entries of each vector (``ceil(0.01 * D)``: 1 of 64) are kept
  exactly in fp16 with a uint8 index; the range is that of the other entries. Keys per channel: the entries
  furthest outside the calibrated range (the range then spans the channel's 0.5-99.5% quantiles); per token:
  the entries of largest magnitude.
* ``sink``: each sequence's first real token (position 0, the attention sink; after left padding, the first
  non-pad column) keeps its key and value as the model computes them (its dtype), as in KVQuant's later version
  (attention-sink-aware quantization): per-channel ranges fitted offline clip the sink's key (relative error 0.98
  on SmolLM2). The evicting cache holds that token's two vectors per layer and sequence beside the rows (counted
  in ``nbytes``, whether or not the policy still holds the token) and reads them into its slot while held.

A vector is normalised to ``u = (x - mid) / half`` in [-1, 1], each entry coded as its nearest codebook point,
and read back as ``mid + half * codebook[code]`` with the outliers put back.
Row: codes ``D * bits / 8`` bytes | per token: fp16 mid, half | outliers: fp16 values, uint8 indices |
pre-RoPE keys: int32 column.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .base import KINDS, Quantizer, QuantError, as_bytes, check_bits, from_bytes, pack_bits, unpack_bits
from .rope import head_dim_of, rotary_inv_freq, rotate

OUTLIER_FRACTION = 0.01
CALIBRATE_CMD = "python -m h2o.assets.calibrate --model <name>"


def variant(kind: str, per_channel: bool, pre_rope: bool, outliers: bool) -> str:
    """The normalisation a codebook was fitted under: ``key/ch-pre-out``, ``value/tok-post-noout``, ..."""
    if kind == "value":
        per_channel = pre_rope = False
    return f"{kind}/{'ch' if per_channel else 'tok'}-{'pre' if pre_rope else 'post'}-{'out' if outliers else 'noout'}"


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise QuantError(f"quant.{name}={value!r}: expected true or false")
    return value


class KVQuant(Quantizer):
    name = "kvquant"

    def __init__(self, bits: int = 4, per_channel_keys: bool = True, pre_rope: bool = True,
                 nonuniform: bool = True, outliers: bool = True, calibration: str | dict | None = None,
                 sink: bool = True):
        self.bits = check_bits(bits)
        self.per_channel_keys = flag("per_channel_keys", per_channel_keys)
        self.pre_rope = flag("pre_rope", pre_rope)
        self.nonuniform = flag("nonuniform", nonuniform)
        self.outliers = flag("outliers", outliers)
        self.sink = flag("sink", sink)
        self.cal = self.load(calibration) if self.per_channel_keys or self.nonuniform else None
        self.head_dim = self.cal["head_dim"] if self.cal else None
        self.inv_freq = None

    def load(self, calibration) -> dict:
        if isinstance(calibration, dict):
            return calibration
        if calibration is None or not Path(calibration).is_file():
            raise QuantError(f"quant.calibration={calibration!r}: no such file; per-channel keys and non-uniform "
                             f"datatypes need one: fit it with `{CALIBRATE_CMD}` (or set quant.calibration)")
        cal = torch.load(calibration, map_location="cpu", weights_only=True)
        for kind in KINDS:
            name = f"{variant(kind, self.per_channel_keys, self.pre_rope, self.outliers)}/{self.bits}"
            if self.nonuniform and name not in cal["codebooks"]:
                raise QuantError(f"quant.calibration={calibration}: has no codebook {name}; "
                                 f"refit it with `{CALIBRATE_CMD}`")
        return cal

    # ------------------------------------------------------------------------------ model checks
    def check_geometry(self, head_dim, rotary, num_layers):
        if self.pre_rope and rotary is False:
            raise QuantError("quant.pre_rope=true: the model has no rotary embeddings; allowed: quant.pre_rope=false")
        if self.cal is None:
            return
        for what, mine, theirs in (("head size", self.cal["head_dim"], head_dim),
                                   ("layers", self.cal["num_layers"], num_layers)):
            if theirs is not None and mine != theirs:
                raise QuantError(f"quant.calibration: fitted on a model with {mine} {what}, this one has {theirs}; "
                                 f"fit it for this model with `{CALIBRATE_CMD}`")

    def bind(self, model):
        cfg = model.config
        self.inv_freq = rotary_inv_freq(model) if self.pre_rope else None
        self.check_geometry(head_dim_of(cfg), self.inv_freq is not None or not self.pre_rope, cfg.num_hidden_layers)
        self.head_dim = head_dim_of(cfg)
        return self

    # ------------------------------------------------------------------------------ constants
    def n_out(self, D: int) -> int:
        return math.ceil(OUTLIER_FRACTION * D) if self.outliers else 0

    def codebook(self, kind: str, layer: int, device) -> torch.Tensor:
        """(2**bits,) sorted points in [-1, 1] (fp16-exact)."""
        if not self.nonuniform:
            return torch.linspace(-1, 1, 2 ** self.bits, device=device)
        name = f"{variant(kind, self.per_channel_keys, self.pre_rope, self.outliers)}/{self.bits}"
        return self.cal["codebooks"][name][layer].half().float().to(device)

    def channel_range(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel keys: (Hkv, 1, D) mid and half-width, fp16-exact, from the calibrated ranges."""
        r = self.cal["ranges"]["pre" if self.pre_rope else "post"]
        lo, hi = (r["qlo"], r["qhi"]) if self.outliers else (r["min"], r["max"])
        mid = ((hi[layer] + lo[layer]) / 2).half().float()
        half = ((hi[layer] - lo[layer]) / 2).clamp(min=1e-4).half().float()
        return mid[:, None].to(device), half[:, None].to(device)

    # ------------------------------------------------------------------------------ rows
    def normalise(self, x, kind, layer, col0):
        """x (B, H, q, D) -> u (B, H, q, D) in the codebook's frame, outlier indices (B, H, q, n), byte fields."""
        B, H, q, D = x.shape
        xf = x.float()
        if kind == "key" and self.pre_rope:
            xf = rotate(xf, torch.arange(col0, col0 + q, device=x.device), self.inv_freq, -1)
        n, fields = self.n_out(D), []
        if kind == "key" and self.per_channel_keys:
            mid, half = self.channel_range(layer, x.device)  # (H, 1, D)
            u = (xf - mid) / half
            idx = u.abs().topk(n, dim=-1).indices if n else None
        else:
            idx = xf.abs().topk(n, dim=-1).indices if n else None
            lo, hi = xf, xf
            if n:
                out = torch.zeros_like(xf, dtype=torch.bool).scatter_(-1, idx, True)
                lo, hi = xf.masked_fill(out, float("inf")), xf.masked_fill(out, -float("inf"))
            lo, hi = lo.amin(-1, keepdim=True), hi.amax(-1, keepdim=True)
            mid = ((hi + lo) / 2).half().float()
            half = ((hi - lo) / 2).clamp(min=1e-4).half().float()
            u = (xf - mid) / half
            fields += [as_bytes(mid[..., 0:1], torch.float16), as_bytes(half[..., 0:1], torch.float16)]
        if n:
            fields += [as_bytes(xf.gather(-1, idx), torch.float16), idx.to(torch.uint8)]
        if kind == "key" and self.pre_rope:
            cols = torch.arange(col0, col0 + q, device=x.device, dtype=torch.int32)
            fields.append(as_bytes(cols[None, None, :, None].expand(B, H, q, 1), torch.int32))
        return u, idx, fields

    def pack(self, x, kind, layer, col0):
        u, _, fields = self.normalise(x, kind, layer, col0)
        cb = self.codebook(kind, layer, x.device)
        codes = torch.searchsorted((cb[1:] + cb[:-1]) / 2, u.clamp(-1, 1).contiguous())  # nearest point
        return torch.cat([pack_bits(codes, self.bits), *fields], -1)

    def unpack(self, rows, kind, layer, dtype):
        D, n = self.head_dim, self.n_out(self.head_dim)
        at = D * self.bits // 8
        u = self.codebook(kind, layer, rows.device)[unpack_bits(rows[..., :at], self.bits, D)]
        if kind == "key" and self.per_channel_keys:
            mid, half = self.channel_range(layer, rows.device)
        else:
            mid, at = from_bytes(rows, at, 1, torch.float16)
            half, at = from_bytes(rows, at, 1, torch.float16)
            mid, half = mid.float(), half.float()
        x = mid + half * u  # (B, H, S, D)
        if n:
            vals, at = from_bytes(rows, at, n, torch.float16)
            x = x.scatter(-1, rows[..., at:at + n].long(), vals.float())
            at += n
        if kind == "key" and self.pre_rope:
            cols, at = from_bytes(rows, at, 1, torch.int32)
            x = rotate(x, cols[..., 0], self.inv_freq, 1)
        return x.to(dtype)

    def row_bytes(self, kind, head_dim):
        per_token = kind == "value" or not self.per_channel_keys
        return (head_dim * self.bits // 8 + 4 * per_token + 3 * self.n_out(head_dim)
                + 4 * (kind == "key" and self.pre_rope))

    def const_bytes(self):
        if self.cal is None:
            return 0
        L, H, D = self.cal["num_layers"], self.cal["kv_heads"], self.cal["head_dim"]
        ranges = 2 * L * H * D * 2 if self.per_channel_keys else 0  # fp16 mid and half per channel
        books = 2 * L * 2 ** self.bits * 2 if self.nonuniform else 0  # fp16 codebook per layer, keys and values
        return ranges + books

    def describe(self):
        return {**super().describe(), "per_channel_keys": self.per_channel_keys, "pre_rope": self.pre_rope,
                "nonuniform": self.nonuniform, "outliers": self.outliers, "sink": self.sink}
