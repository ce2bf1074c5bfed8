"""expected_attention: keep the keys that future queries are expected to attend to (Expected Attention, Devoto et
al., arXiv 2510.00636), as kvpress 0.5.5's ExpectedAttentionPress defines it, at the end of a prompt only.

The rule per sequence and query head (the prompt's queries' mean and covariance before RoPE at positions
``>= n_sink``, rotated over the next ``n_future_positions``; each held key's log expected weight, softmaxed, averaged
over a KV head's query heads, times ``|V|`` with ``use_vnorm``; the sinks kept) and kvpress's defaults:
docs/methods.md, "Expected Attention". ``D`` is the head dimension (kvpress's ``sqrt(d)``).

Where kvpress reads the prompt's length as its columns (it never pads), L here is the sequence's prompt tokens,
pads excluded (the next token's position when positions skip pads, as ``generate`` numbers them). Per-sequence
maximum for the sinks' score (kvpress: the batch's; the same for one sequence). A prompt of at most ``n_sink``
tokens is all sinks (kvpress asserts it is longer); ties there go to the newest. Computed in at least fp32
(kvpress: the model's dtype; the same in fp32).

The queries before RoPE: :mod:`h2o.core.prerope` (the attention function's queries turned back with the rotation
the module applied). State: the statistics live in the evicting layer from the prompt's forward to its cut
(``EvictingLayer.queries``); the simulated path computes them from the prompt's rows in the same call.
No decoding form: ``compress=decode`` is refused in one line (:meth:`ExpectedAttention.timed`); kvpress's
``DecodingPress`` around it is degenerate (NaN scores at interval 1, measured): docs/methods.md, "Expected Attention".
"""
from __future__ import annotations

import math

import torch

from ..schedule import Schedule
from .base import READ_QUERIES, PolicyError, Unsupported
from .prefill import PrefillOnly
from .snapkv import window_on_top


def average_rotation(cos: torch.Tensor, sin: torch.Tensor, D: int) -> torch.Tensor:
    """cos, sin (B, N, r) of N positions -> (B, D, D) their rotations averaged: ``diag(mean cos) +
    P diag(mean sin)`` on the first r channels (the rotations are linear in cos and sin), the identity after."""
    B, _, r = cos.shape
    c, s = cos.mean(1), sin.mean(1)  # (B, r)
    h = r // 2
    R = torch.eye(D, dtype=c.dtype, device=c.device).repeat(B, 1, 1)  # (B, D, D)
    idx = torch.arange(r, device=c.device)
    R[:, idx, idx] = c
    R[:, idx[:h], idx[h:]] = -s[:, h:]  # (P diag(s))[i, i + h] = -s[i + h]
    R[:, idx[h:], idx[:h]] = s[:, :h]  # (P diag(s))[i + h, i] = s[i]
    return R


class ExpectedAttention(PrefillOnly):
    name = "expected_attention"
    reads = frozenset({READ_QUERIES})  # the prompt's queries' statistics (the held keys, values at the cut)

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, n_future_positions: int = 512,
                 n_sink: int = 4, use_covariance: bool = True, use_vnorm: bool = True, epsilon: float = 0.0):
        super().__init__(budget, heavy, recent, heavy_share)
        for key, value, low in (("n_future_positions", n_future_positions, 1), ("n_sink", n_sink, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PolicyError(f"{key}={value!r}: expected an int >= {low}")
        for key, value in (("use_covariance", use_covariance), ("use_vnorm", use_vnorm)):
            if not isinstance(value, bool):
                raise PolicyError(f"{key}={value!r}: expected true or false")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) \
                or epsilon < 0:
            raise PolicyError(f"epsilon={epsilon!r}: expected a finite number >= 0")
        self.n_future_positions, self.n_sink = n_future_positions, n_sink
        self.use_covariance, self.use_vnorm, self.epsilon = use_covariance, use_vnorm, float(epsilon)

    def check_schedule(self, schedule: Schedule) -> None:
        if schedule.evicts_each_step:
            raise Unsupported(f"compress=decode: expected_attention has no faithful decoding form (kvpress's "
                              f"DecodingPress(ExpectedAttentionPress, compression_interval=1) scores from the one "
                              f"hidden state buffered since its last cut, {self.degenerate()}); allowed: prefill")
        super().check_schedule(schedule)

    def degenerate(self) -> str:
        """What kvpress's re-score every step computes from one buffered hidden state under this ``n_sink``."""
        if self.n_sink:
            return (f"which n_sink={self.n_sink} removes: the mean and covariance of 0 queries are NaN, so every "
                    f"score is NaN and top-k keeps an arbitrary set")
        return ("so with n_sink=0 the covariance is 0 and the future rotation averages positions 1..n_future_positions "
                "(the buffer's length read as the prompt's), not the sequence's")

    def query_stats(self, queries, rows: int, pos: torch.Tensor, length: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """queries (:class:`h2o.core.prerope.Queries`) of a prompt's forward, its first ``rows`` rows with
        positions pos (B, rows) (-1: a pad), length (B,) the prompt's tokens -> the prompt's query statistics
        rotated to the future positions: mean (B, Hq, D), covariance (B, Hq, D, D) (None without ``use_covariance``)."""
        q = queries.before_rope(rows)  # (B, Hq, rows, D)
        B, _, _, D = q.shape
        w = (pos >= self.n_sink).to(q.dtype)  # (B, rows) the rows counted: no pad, no sink
        n = w.sum(-1).clamp(min=1)[:, None, None]  # (B, 1, 1)
        mean = torch.einsum("bhrd,br->bhd", q, w) / n  # (B, Hq, D)
        future = length[:, None] + torch.arange(self.n_future_positions, device=length.device)  # (B, N)
        R = average_rotation(*queries.tap.at(future), D).to(q.dtype)[:, None]  # (B, 1, D, D)
        cov = None
        if self.use_covariance:
            centred = (q - mean[:, :, None]) * w[:, None, :, None]  # (B, Hq, rows, D)
            cov = torch.einsum("bhri,bhrj->bhij", centred, centred) / n[..., None]  # (B, Hq, D, D)
            cov = R @ cov @ R.transpose(-1, -2)
        return (R @ mean[..., None])[..., 0], cov

    def query_score(self, stats: tuple[torch.Tensor, torch.Tensor | None], keys: torch.Tensor, values: torch.Tensor,
                    pos: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """stats (:meth:`query_stats`), keys, values (B, Hkv, S, D) as held (keys after RoPE), pos (B, Hkv, S), held
        (B, Hkv, S) bool -> (B, Hkv, S) the score the cut keeps the top of."""
        mean, cov = stats
        B, Hkv, S, D = keys.shape
        k = keys.to(mean.dtype)[:, :, None]  # (B, Hkv, 1, S, D)
        G = mean.shape[1] // Hkv
        z = (k @ mean.view(B, Hkv, G, D, 1))[..., 0] / math.sqrt(D)  # (B, Hkv, G, S)
        if cov is not None:
            z = z + ((k @ cov.view(B, Hkv, G, D, D)) * k).sum(-1) / D / 2
        scored = held & (pos >= self.n_sink)  # (B, Hkv, S)
        z = z.masked_fill(~scored[:, :, None], -torch.inf)
        expected = torch.softmax(z, -1).nan_to_num(0.0).mean(2)  # (B, Hkv, S); a head with no scored key: 0
        if self.use_vnorm:
            norms = torch.linalg.vector_norm(values, dim=-1, dtype=expected.dtype)  # (B, Hkv, S)
            expected = (expected + self.epsilon) * norms
        return window_on_top(expected, scored)  # the sinks above (a prompt of at most n_sink tokens: all sinks)

    def describe(self) -> dict:
        return {**super().describe(), "n_future_positions": self.n_future_positions, "n_sink": self.n_sink,
                "use_covariance": self.use_covariance, "use_vnorm": self.use_vnorm, "epsilon": self.epsilon}
