"""uniform: FlexGen's group-wise asymmetric min-max quantization of keys and values.

Each token's vector of one KV head is cut into groups of ``group_size`` channels (64 in FlexGen, along the head
dimension); a group keeps its minimum ``m`` and step ``s = (max - min) / (2**bits - 1)`` in fp16, and each value
the code ``c = clamp(round((x - m) / s), 0, 2**bits - 1)``; it reads back as ``c * s + m``. FlexGen keeps
``m`` and ``1 / s``; ``s`` itself is kept here (``1 / s`` overflows fp16 for narrow 8-bit groups).
Row: codes ``D * bits / 8`` bytes, then ``D / group_size`` fp16 minima and steps.
"""
from __future__ import annotations

import torch

from .base import Quantizer, QuantError, as_bytes, check_bits, from_bytes, pack_bits, unpack_bits
from .rope import head_dim_of


class Uniform(Quantizer):
    name = "uniform"

    def __init__(self, bits: int = 4, group_size: int = 64):
        self.bits = check_bits(bits)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise QuantError(f"quant.group_size={group_size!r}: expected a positive int dividing the head size")
        self.group_size = group_size

    def check_geometry(self, head_dim, rotary, num_layers):
        if head_dim is not None and head_dim % self.group_size:
            raise QuantError(f"quant.group_size={self.group_size}: does not divide the model's head size "
                             f"{head_dim}; allowed: a divisor of {head_dim}")

    def bind(self, model):
        self.check_geometry(head_dim_of(model.config), None, None)
        return self

    def pack(self, x, kind, layer, col0):
        B, H, q, D = x.shape
        levels = 2 ** self.bits - 1
        xg = x.float().reshape(B, H, q, D // self.group_size, self.group_size)  # (B, H, q, G, g)
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        m = lo.half().float()  # the stored values, so that reading back matches exactly
        s = ((hi - lo) / levels).half().float()
        codes = torch.where(s > 0, ((xg - m) / s.clamp(min=1e-30)).round(), 0).clamp(0, levels)
        return torch.cat([pack_bits(codes.reshape(B, H, q, D), self.bits),
                          as_bytes(m[..., 0], torch.float16), as_bytes(s[..., 0], torch.float16)], -1)

    def unpack(self, rows, kind, layer, dtype):
        B, H, S, P = rows.shape
        D = P * self.group_size * 8 // (self.bits * self.group_size + 32)  # P = D*bits/8 + 4 * D/group_size
        n_code, G = D * self.bits // 8, D // self.group_size
        codes = unpack_bits(rows[..., :n_code], self.bits, D).reshape(B, H, S, G, self.group_size)
        m, at = from_bytes(rows, n_code, G, torch.float16)
        s, _ = from_bytes(rows, at, G, torch.float16)
        return (codes * s.float()[..., None] + m.float()[..., None]).reshape(B, H, S, D).to(dtype)

    def row_bytes(self, kind, head_dim):
        return head_dim * self.bits // 8 + 4 * (head_dim // self.group_size)

    def describe(self):
        return {**super().describe(), "group_size": self.group_size}
