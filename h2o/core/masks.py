"""Masks and softmax the simulated path and the attention function share: positions of a padded batch, causal and
sliding-window masks, the masked softmax (with learned sink logits), and a one-thread context for loops of tiny ops.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def positions(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool non-pad -> (B, T) int64 position of each token in its own sequence, -1 for pads."""
    return torch.where(valid, valid.long().cumsum(-1) - 1, -1)


def in_window(pos: torch.Tensor, window: int) -> torch.Tensor:
    """pos (B, T) -> (B, 1, 1, T, T) bool: key j lies in the sliding window of row i, ``pos_j > pos_i - window``
    (transformers' convention: a row sees itself and the ``window - 1`` tokens before it). A pad row (pos -1)
    loses nothing."""
    return (pos[:, None, :] > pos[:, :, None] - window)[:, None, None]


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor | None, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """fp32 softmax over allowed keys (None: all); a row with none allowed is uniform (finite, like transformers'
    eager). ``sinks`` (1, Hkv, G, 1, 1) fp32, learned sink logits (GPT-OSS ``s_aux``): one more logit per query
    head in the denominator, attending to nothing (the probabilities then sum to less than 1)."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(torch.float32).min)
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    return with_sinks(logits, sinks.view(*sinks.shape[:3], *[1] * (logits.dim() - 3)))


def with_sinks(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits`` (..., S) with one sink logit per row broadcast from ``sinks`` (..., 1), sink dropped."""
    return torch.softmax(torch.cat([logits, sinks.expand(*logits.shape[:-1], 1)], -1), dim=-1)[..., :-1]


@contextmanager
def serial(device: torch.device):
    """One CPU thread for loops of tiny ops: waking a second thread costs more than each op (measured 40x)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def causal_valid(valid: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, T) bool non-pad -> (B, 1, 1, T, T) bool: causal and padding (and the sliding ``window``, if any)."""
    idx = torch.arange(valid.shape[1], device=valid.device)
    allowed = (idx[None, :] <= idx[:, None]) & valid[:, None, None, None, :]
    return allowed if window is None else allowed & in_window(positions(valid), window)
