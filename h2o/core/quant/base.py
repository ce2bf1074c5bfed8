"""What every KV quantizer shares: the packed row format and the store/read interface the two paths call.

A quantizer turns a block of keys or values ``x (B, Hkv, q, D)`` into *rows* ``(B, Hkv, q, P)`` uint8: one row of
``P`` bytes per (token, KV head) holding everything the cache needs to rebuild that vector (bit-packed codes,
fp16 scales / zero points, fp16 outliers and their uint8 indices, an int32 column for pre-RoPE keys). A row
depends on its own vector only (per-channel ranges are fitted offline), so

* the real path (:class:`h2o.core.cache.EvictingLayer`) stores rows in its slots exactly where it stored keys
  and values: append, in-place overwrite and the prefill cut move whole rows, and ``nbytes`` counts them;
* the simulated path attends to ``fake(x) = unpack(pack(x))``: the same bytes decoded, so both paths see the
  same dequantized values and a policy judges tokens on the values the cache really holds.

Bits are packed little-endian: code ``j`` of a vector occupies bits ``j*b .. j*b+b-1`` of the byte string.
"""
from __future__ import annotations

import torch

from ..policies import PolicyError

BITS = (2, 3, 4, 8)
KINDS = ("key", "value")


class QuantError(PolicyError):
    """Bad quantization input: the message is one line naming the value and what is allowed."""


def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise QuantError(f"quant.bits={bits!r}: allowed: {', '.join(map(str, BITS))}")
    return bits


# ------------------------------------------------------------------------------------ byte fields
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) integers in [0, 2**bits) -> (..., n * bits / 8) uint8 (n * bits must be a multiple of 8)."""
    if bits == 8:
        return codes.to(torch.uint8)
    planes = (codes.long()[..., None] >> torch.arange(bits, device=codes.device)) & 1  # (..., n, bits)
    planes = planes.reshape(*codes.shape[:-1], -1, 8)  # (..., n*bits/8, 8)
    return (planes << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """(..., n * bits / 8) uint8 -> (..., n) int64 codes."""
    if bits == 8:
        return packed.long()
    planes = (packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1  # (..., m, 8)
    planes = planes.reshape(*packed.shape[:-1], n, bits)
    return (planes << torch.arange(bits, device=packed.device)).sum(-1)


def as_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., k) -> (..., k * itemsize) uint8: ``x`` cast to ``dtype`` (fp16, int32) and viewed as bytes."""
    return x.to(dtype).contiguous().view(torch.uint8)


def from_bytes(rows: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``count`` values of ``dtype`` read from byte ``start`` of each row -> (..., count), the next offset."""
    size = torch.empty((), dtype=dtype).element_size() * count
    return rows[..., start:start + size].contiguous().view(dtype), start + size


# ------------------------------------------------------------------------------------ interface
class Quantizer:
    """Base class. Subclasses implement :meth:`pack`, :meth:`unpack` and :meth:`row_bytes`."""

    name = ""
    bits = 16
    sink = False  # keep each sequence's first token (the attention sink) as computed: :meth:`fake_kv`, the cache

    def bind(self, model) -> "Quantizer":
        """Check the quantizer against a loaded model (head size, rotary) and read what it needs; returns self."""
        return self

    def check_geometry(self, head_dim: int | None, rotary: bool | None, num_layers: int | None) -> None:
        """QuantError if this quantizer cannot serve a model of this shape (None: unknown, not checked)."""

    def pack(self, x: torch.Tensor, kind: str, layer: int, col0: int) -> torch.Tensor:
        """x (B, Hkv, q, D) of ``kind`` (key | value) in ``layer``; its tokens sit in columns col0..col0+q-1
        of the sequence (the rotary positions of a plain forward). -> rows (B, Hkv, q, P) uint8."""
        raise NotImplementedError  # abstract

    def unpack(self, rows: torch.Tensor, kind: str, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """rows (B, Hkv, S, P) uint8 -> (B, Hkv, S, D) in ``dtype``."""
        raise NotImplementedError  # abstract

    def row_bytes(self, kind: str, head_dim: int) -> int:
        raise NotImplementedError  # abstract

    def const_bytes(self) -> int:
        """Bytes held once per model (offline-fitted ranges and codebooks), counted with the cache."""
        return 0

    # the two hooks of the paths
    def pack_kv(self, keys, values, layer: int, col0: int):
        return self.pack(keys, "key", layer, col0), self.pack(values, "value", layer, col0)

    def unpack_kv(self, keys, values, layer: int, dtype: torch.dtype):
        return self.unpack(keys, "key", layer, dtype), self.unpack(values, "value", layer, dtype)

    def fake_kv(self, keys, values, layer: int, valid: torch.Tensor | None = None):
        """The simulated path: (B, Hkv, T, D) keys/values from column 0 -> the values the cache would hold
        (``sink``: each sequence's first real token as computed, the rest decoded; valid (B, T) bool: the
        non-pad columns, None: all)."""
        rows = self.pack_kv(keys, values, layer, 0)
        fk, fv = self.unpack_kv(*rows, layer, keys.dtype)
        if self.sink:
            T = keys.shape[-2]
            valid = torch.ones(keys.shape[0], T, dtype=torch.bool, device=keys.device) if valid is None else valid
            at = (torch.arange(T, device=keys.device) == valid.long().argmax(-1, keepdim=True)) & valid  # (B, T)
            fk, fv = self.put_sink(fk, fv, (keys, values), at[:, None, :])
        return fk, fv

    @staticmethod
    def put_sink(keys, values, sink: tuple, at: torch.Tensor):
        """Decoded (B, Hkv, S, D) keys/values with the slots ``at`` (B, Hkv or 1, S) bool replaced by the sink's
        key and value as computed, ``sink`` = ((B, Hkv, 1 or S, D), (B, Hkv, 1 or S, D))."""
        at = at[..., None]
        return torch.where(at, sink[0], keys), torch.where(at, sink[1], values)

    def describe(self) -> dict:
        return {"quant": self.name, "bits": self.bits}

    def label(self) -> str:
        """A short name for folders and tables: ``uniform4``, ``kvquant3``."""
        return f"{self.name}{self.bits}"
