"""kvpress's selections at a cut, run as kvpress runs them: ``torch.topk`` on its rows, the scores by position.

Where scores tie exactly at the budget's edge, which tokens stay is ``torch.topk``'s choice, a function of the
whole row's comparisons (neither the newest nor the oldest). Ties are common: knorm at layer 0 (RoPE is a rotation,
so every occurrence of a token has the same key norm), snapkv's window below its size, Ada-KV's safeguard and its
layer-wide cut over those windows. Running the same ``topk`` on the same row keeps the same tokens as kvpress on
the same device, for a model whose scores kvpress computes in the same dtype (fp32 here; kvpress: the keys' or
queries' dtype). Slots may be in any order; pads and empty slots (``valid`` False) are never kept.
"""
import torch

from .base import Counts, keep_top


def rows_by_position(prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, seen: list | None = None):
    """prio, pos (B, H, S), valid (B, H, S) bool -> (rows (B, H, L + 1) the priorities by position, -inf where not
    held (column L: a sink for the rest), index (B, H, S) each slot's column, lengths (B,) list: positions
    0..length-1: ``seen``, the cache's tokens seen, or one host read)."""
    B, H, _ = pos.shape
    p = torch.where(valid, pos, -1)
    lengths = seen or ((p.amax((1, 2)) + 1).tolist() if p.numel() else [0] * B)
    L = max(lengths, default=0)
    index = torch.where(p >= 0, p, L)  # (B, H, S)
    rows = prio.new_full((B, H, L + 1), -torch.inf)
    rows.scatter_(-1, index, torch.where(valid, prio, -torch.inf))
    return rows, index, lengths


def kvpress_topk(prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, counts: Counts,
                 newest_upto: int = 0) -> torch.Tensor:
    """ScorerPress: per sequence and head, ``topk(n)`` (n = ``counts.total`` (B,), its host numbers where kept) of
    its row -> (B, H, S) bool kept. A sequence of at most ``newest_upto`` tokens, or one that keeps everything, gets
    :func:`keep_top` instead (newer first on ties)."""
    host, total = counts.host or counts, counts.total
    rows, index, lengths = rows_by_position(prio, pos, valid, host.seen)
    chosen = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)  # (B, H, L + 1)
    own = torch.zeros(len(lengths), dtype=torch.bool)  # (B,) decided by topk
    for b, (length, n) in enumerate(zip(lengths, host.total.tolist())):
        if newest_upto < length and n < length:
            chosen[b].scatter_(-1, rows[b, :, :length].topk(n, dim=-1).indices, True)
            own[b] = True
    picked = chosen.gather(-1, index) & valid  # (B, H, S)
    return torch.where(own.to(prio.device).view(-1, 1, 1), picked, keep_top(prio, valid, total))


def kvpress_adakv(prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, total: list[int], safe: list[int],
                  newest_upto: int = 0, seen: list | None = None) -> tuple[torch.Tensor, list[bool]]:
    """AdaKVPress: per sequence, each head's ``topk(n_safe)`` (``safe`` (B,)) raised to the dtype's maximum, then the
    ``H * (length - n)`` lowest of the layer's ``H * length`` scores (``topk`` of their negation over the flattened
    heads) removed -> ((B, H, S) bool kept, (B,) decided: False for a sequence of at most ``newest_upto`` tokens,
    where kvpress has no rule and the caller decides). A sequence that keeps everything keeps every valid slot."""
    rows, index, lengths = rows_by_position(prio, pos, valid, seen)
    kept = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)  # (B, H, L + 1)
    own = [length > newest_upto for length in lengths]
    H = rows.shape[1]
    for b, (length, n, n_safe) in enumerate(zip(lengths, total, safe)):
        if not own[b]:
            continue
        if n >= length:
            kept[b, :, :length] = True
            continue
        s = rows[b, :, :length].clone()  # (H, length)
        if n_safe > 0:
            s.scatter_(-1, s.topk(n_safe, dim=-1).indices, torch.finfo(s.dtype).max)
        pruned = (-s).reshape(-1).topk(H * (length - n)).indices  # (H * (length - n),) into the flattened heads
        mask = torch.ones(H * length, dtype=torch.bool, device=s.device)
        mask[pruned] = False
        kept[b, :, :length] = mask.view(H, length)
    return kept.gather(-1, index) & valid, own
