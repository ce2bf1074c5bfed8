"""The helpers every rule and both paths share over per-slot state (B, H, S): broadcasting, cached constants,
tiered priorities, the recent window, the decoding step's slot choice (:func:`select_slot`) and a cut's top count
(:func:`keep_top`). Re-exported by :mod:`.base`.
"""
from __future__ import annotations

from functools import cache

import torch

TIER = float(2**40)  # priority tiers: tier * TIER + position, exact in float64 (positions < 2**40)
TIER_INT = 2**40  # the same tiers as an int64 key (decoding steps: no float64 conversion)


def bcast(x: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1) to broadcast against (B, H, S) (one view; indexing with None takes two ops)."""
    return x.view(-1, 1, 1)


@cache
def const(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor of ``value``, made once per dtype and device. A Python scalar given to ``torch.where`` or an
    arithmetic op is wrapped into a tensor on the host at every call (up to 4 more aten ops each, per layer and
    decoding step); this one is not. Never an inference tensor, whatever mode the first call ran in: one made under
    ``torch.inference_mode`` could not enter a later forward that autograd records."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=dtype, device=device)


def tiered(top: torch.Tensor, special: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Priority of a tiered pattern, (B, H, S) float64: tier 2 (``top``), 1 (``special`` outside ``top``), 0;
    newest first within a tier."""
    return (2 * top + (special > top)).double() * TIER + pos.double()  # a > b of bools: a & ~b


def tier_key(top: torch.Tensor, special: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The order of :func:`tiered` as an int64 key where tier 2 holds the newest tokens (a window, the current
    block): then ``top`` and ``special`` can share one tier (three ops, exact; ``out``: into that buffer)."""
    return torch.where(torch.bitwise_or(top, special), pos + const(TIER_INT, torch.int64, pos.device), pos, out=out)


def recent_window(pos: torch.Tensor, now: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool: the ``size`` most recent positions counting the arriving token ``now`` itself."""
    return pos > bcast(now - size)


def select_slot(prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None, room: torch.Tensor | None
                ) -> torch.Tensor:
    """The eviction step shared by both paths: which slot the arriving token takes, (B, H, 1) int64.

    Where the sequence still has ``room`` (B,) below its budget, an empty slot (``valid`` False) is taken (``room``
    (B, H, 1): per KV head, on a sliding-window layer where the window frees slots head by head).
    Otherwise the valid slot of lowest priority is dropped, the oldest one on ties, so the answer does not
    depend on the order of slots (the evicting cache fills slots in place, the simulated mask by position).
    ``valid=None``: every slot holds a token (then ``room`` is not read). Compared in ``prio``'s dtype.
    """
    key = prio
    if valid is not None:
        inf = const(float("inf"), prio.dtype, prio.device)
        key = torch.where(valid, prio, torch.where(room if room.dim() == 3 else bcast(room), -inf, inf))
    tie = key == key.amin(-1, keepdim=True)
    oldest = torch.where(tie, pos, const(torch.iinfo(torch.int64).max, torch.int64, pos.device))
    return oldest.argmin(-1, keepdim=True)


def along_slots(index: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A slot index (B, H, S') for a gather/scatter of ``state`` (B, H, S, ...) along its slot axis 2: as it is for
    a (B, H, S) state, else broadcast over the trailing axes (:meth:`Policy.new_state`)."""
    if state.dim() == 3:
        return index
    return index.view(*index.shape, *[1] * (state.dim() - 3)).expand(*index.shape, *state.shape[3:])


def keep_top(prio: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, H, S) bool: the ``keep`` (B,) highest-priority valid slots, newer first on ties.

    Slots must be in position order (true at the end of a prefill in both paths).
    """
    key = torch.where(valid, prio, -float("inf"))
    order = key.argsort(dim=-1, stable=True)  # ascending; on ties the older slot comes first
    rank_from_top = torch.empty_like(order)
    S = key.shape[-1]
    rank_from_top.scatter_(-1, order, torch.arange(S - 1, -1, -1, device=key.device).expand_as(order))
    return (rank_from_top < bcast(keep)) & valid
