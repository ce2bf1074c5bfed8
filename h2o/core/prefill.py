"""A prefill at the speed of the model's own attention: the attention output from a fused kernel (torch's
``scaled_dot_product_attention``), and only the statistics the policy's rule reads (:attr:`Policy.reads`).

Real path (:func:`real_prefill`, called by :func:`h2o.core.attention.real_attention` for a forward of more than one
token, after :meth:`EvictingLayer.begin`):

* the output: one fused call with ``is_causal`` where the forward is a first prompt without pads (the model's own
  flash kernel where it was loaded with one, :func:`own_kernel`), else fused calls per block of rows under the
  layer's own mask (:meth:`EvictingLayer.visible`); a pad row gets the uniform average of the values (eager's);
* ``READ_ROWS``: every row's attention as ``exp(logits - lse)`` per block of rows (the kernel's log-sum-exp on the
  CPU; elsewhere each block's softmax), over the columns up to the block's last row, into the layer's hook
  (:meth:`EvictingLayer.attended`); ``READ_WINDOW``: the softmax of the rows from the first one inside some
  sequence's last :meth:`Policy.read_window` rows; nothing for the others (docs/architecture-core.md, "The real
  path").

Memory: at most :data:`CELLS` scores or mask cells at once beside the kernel's own (linear in the prompt).

Simulated path (:func:`simulated_fused`): a policy whose mask does not depend on the scores (``full``, the
position-only policies in closed form) hands its mask to the fused kernel instead of materialising the
``T x T`` probabilities (lm-eval scoring at the kernel's speed): built once per forward from the positions on the
device (:func:`simulated_mask`, no host read), on the CPU an additive mask beside the kernel's causal skip.

Not served here (the blocked eager loop of the attention function serves them): Gemma-2's logit soft-capping and
GPT-OSS's learned sinks (no fused kernel takes them), and a forward whose attention probabilities are observed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .policies.base import READ_ROWS, READ_WINDOW
from .simulate import grouped, masked_softmax, scores

CELLS = 2**24  # scores (or mask cells) per block of rows: (B, Hq, rows, S) at most this many
STAT_ROWS = 128  # query rows per block of the READ_ROWS pass (x G query heads): measured fastest of 128-1024


def fused(query, key, value, scaling: float, mask: torch.Tensor | None = None, causal: bool = False,
          lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query (B, Hq, q, D), key/value (B, Hkv, S, D), mask None or bool broadcastable to (B, Hq, q, S) (True:
    attend; every row must have one) -> (out (B, Hq, q, D), the rows' log-sum-exp (B, Hq, q) fp32 if ``lse`` and
    the kernel gives it, else None). ``causal``: torch's top-left causal mask (q == S)."""
    G = query.shape[1] // key.shape[1]
    guard = nonfinite(query, key, value)
    if query.dtype != torch.float32 and query.device.type == "cpu":  # half precision: fp32 math on the CPU, as
        dtype = query.dtype  # the eager path's scores (the CPU kernels round half inputs on the way)
        out, rows = fused(query.float(), key.float(), value.float(), scaling, mask, causal, lse)
        return out.to(dtype), rows
    if lse and query.device.type == "cpu":  # the CPU flash kernel returns the log-sum-exp beside the output
        out, rows = cpu_flash(query, key, value, scaling, None if mask is None else additive(mask), causal)
        return out.add_(guard), rows.float()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                         enable_gqa=G > 1)
    return out.add_(guard), None


def cpu_flash(query, key, value, scaling: float, bias: torch.Tensor | None, causal: bool):
    """torch's CPU flash kernel: query (B, Hq, q, D), key/value (B, Hkv, S, D), ``bias`` None or an additive
    mask broadcastable to (B, Hq, q, S) of the query's dtype, ``causal`` the top-left causal skip of the blocks
    above the diagonal (with a bias too: both apply) -> (out (B, Hq, q, D), log-sum-exp (B, Hq, q)). A row that
    sees nothing comes out 0."""
    G = query.shape[1] // key.shape[1]
    if G > 1:
        key, value = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                      attn_mask=bias, scale=scaling)


def additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bool mask (True: attend) -> the same shape, 0 where True and -inf elsewhere, of ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


def nonfinite(*xs: torch.Tensor) -> torch.Tensor:
    """A 0-dim 0, NaN where any of ``xs`` holds a NaN or an inf: added to the fused output, it keeps the
    non-finite guard (:meth:`h2o.core.attach.Attached.flag`) seeing what the eager softmax would have spread (the
    CPU flash kernel returns zeros for a row of NaN logits). One reduction per input, no host read."""
    return sum(x.sum(dtype=torch.float32) for x in xs) * 0


def block_rows(B: int, Hq: int, S: int, cap: int | None = None) -> int:
    """Query rows per block so that (B, Hq, rows, S) holds at most :data:`CELLS` values."""
    rows = max(1, CELLS // max(1, B * Hq * S))
    return rows if cap is None else min(rows, cap)


def allowed_rows(layer, key, r: int, rows: int) -> torch.Tensor:
    """(B, Hkv, 1, rows, S) bool: what query rows r..r+rows of this forward see, by the layer's own rule."""
    return layer.visible(key.new_empty(1, 1, 1, rows, 0), r)


def to_heads(mask: torch.Tensor, G: int) -> torch.Tensor:
    """(B, Hkv|1, 1, r, S) -> (B, Hq|1, r, S)."""
    B, H, _, r, S = mask.shape
    return mask[:, :, 0] if H == 1 else mask.expand(B, H, G, r, S).reshape(B, H * G, r, S)


def uniform_where_empty(mask: torch.Tensor, value: torch.Tensor, G: int):
    """A row that sees nothing (a pad): the eager softmax over no allowed key is uniform over every slot. mask
    (B, H|1, r, S) bool -> (mask with such rows opened, a function fixing their output (B, Hq, r, D))."""
    empty = ~mask.any(-1, keepdim=True)  # (B, H|1, r, 1)
    if not bool(empty.any()):  # one host read per block
        return mask, lambda o: o
    mean = value.float().mean(-2).repeat_interleave(G, 1)[:, :, None].to(value.dtype)  # (B, Hq, 1, D)
    return mask | empty, lambda o: torch.where(empty, mean, o)


def is_flash(implementation: str) -> bool:
    """transformers' flash kernels: ``flash_attention_2``, ``_3``, ``_4``, a kernels hub flash kernel (not the
    paged ones, which read a paged cache)."""
    return "flash" in implementation and "paged" not in implementation


def own_kernel(module, implementation: str | None):
    """The attention the model was loaded with where it is a flash kernel (``flash_attention_2``, ``_3``, a kernels
    hub flash kernel, any registered name with "flash" and without "paged"): a function (query (B, Hq, q, D),
    key/value (B, Hkv, q, D), scaling) -> out (B, Hq, q, D) of a plain causal forward through transformers'
    registered function; None for any other (torch's sdpa serves)."""
    if not implementation or not is_flash(implementation):
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kernel = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if kernel is None:
        return None

    def causal(query, key, value, scaling: float) -> torch.Tensor:
        out = kernel(module, query, key, value, None, dropout=0.0, scaling=scaling, is_causal=True)[0]
        return out.transpose(1, 2)  # (B, q, Hq, D) -> (B, Hq, q, D)

    return causal


def real_prefill(layer, query, key, value, scaling: float, window: int | None = None, own=None) -> torch.Tensor:
    """The attention of a forward of ``q > 1`` tokens on an evicting layer: query (B, Hq, q, D), key/value
    (B, Hkv, S, D) as :meth:`EvictingLayer.begin` returned them -> out (B, Hq, q, D); the statistics the
    policy reads go into the layer (:meth:`EvictingLayer.attended`), its cut follows (``end_forward``).
    ``own``: the model's own flash kernel (:func:`own_kernel`) for a plain causal forward, else None (sdpa)."""
    reads = layer.policy.reads
    B, Hq, q, D = query.shape
    Hkv, S = key.shape[1], key.shape[-2]
    G = Hq // Hkv
    rows = READ_ROWS in reads
    # plain causal: the layer's first forward (nothing held before), no pad, no sliding window shorter than it
    causal = S == q and layer.unpadded() and (window is None or window >= q)
    if causal and own is not None:  # the row statistics then from each block's own softmax
        out, lse = own(query, key, value, scaling).add_(nonfinite(query, key, value)), None
    elif causal:
        out, lse = fused(query, key, value, scaling, causal=True, lse=rows)
    else:
        outs, lses = [], []
        step = block_rows(B, Hq, S)
        for r in range(0, q, step):
            n = min(step, q - r)
            mask, fix = uniform_where_empty(to_heads(allowed_rows(layer, key, r, n), G), value, G)
            o, l = fused(query[:, :, r:r + n], key, value, scaling, mask, lse=rows)
            outs.append(fix(o))
            lses.append(l)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        lse = None if lses[0] is None else (lses[0] if len(lses) == 1 else torch.cat(lses, 2))
    if rows:
        row_statistics(layer, query, key, scaling, lse, causal)
    elif READ_WINDOW in reads:
        window_statistics(layer, query, key, scaling, layer.policy.read_window(), causal)
    return out


def row_statistics(layer, query, key, scaling: float, lse: torch.Tensor | None, causal: bool) -> None:
    """Every row's attention probabilities into the policy's hook, a block of rows at a time, each over the
    columns up to its last row: ``exp(logits - lse)`` with the fused kernel's log-sum-exp, or the block's
    softmax, into :meth:`EvictingLayer.attended` (``acc`` seen as the block's columns)."""
    B, Hq, q, D = query.shape
    Hkv, S = key.shape[1], key.shape[-2]
    G = Hq // Hkv
    qs = (query.float() * scaling).reshape(B * Hkv, G, q, D)  # q scaled before the product, fp32 (as scores())
    k = key.float().reshape(B * Hkv, S, D)
    nlse = None if lse is None else lse.reshape(B * Hkv, G, q).neg()
    before = S - q  # held slots before this forward's columns
    step = block_rows(B, Hq, S, STAT_ROWS)
    tri = torch.ones(step, step, dtype=torch.bool, device=query.device).triu(1)  # above the diagonal
    for r in range(0, q, step):
        n = min(step, q - r)
        c = before + r + n  # the columns up to the block's last row
        rows = qs[:, :, r:r + n].reshape(B * Hkv, G * n, D)
        kt = k[:, :c].transpose(1, 2)
        if nlse is None:
            logits = torch.bmm(rows, kt)
        else:  # logits - lse in one op
            logits = torch.baddbmm(nlse[:, :, r:r + n].reshape(B * Hkv, G * n, 1), rows, kt)
        logits = logits.view(B, Hkv, G, n, c)
        allowed = None
        if causal:
            logits[..., c - n:].masked_fill_(tri[:n, :n], -torch.inf)
        else:
            allowed = allowed_rows(layer, key, r, n)[..., :c]  # (B, Hkv, 1, n, c)
        if nlse is not None:
            if allowed is not None:
                logits.masked_fill_(~allowed, -torch.inf)
            probs = logits.exp_()
        else:
            probs = masked_softmax(logits, allowed)  # a row with none allowed (a pad): the hook zeroes it
        with layer.narrowed(c):
            layer.attended(probs, r)


def window_statistics(layer, query, key, scaling: float, w: int, causal: bool) -> None:
    """The softmax of the rows from the first one among some sequence's last ``w`` real rows to the forward's
    end, into the layer's hook: the rows before it add nothing to a window rule's state."""
    B, Hq, q, D = query.shape
    Hkv, S = key.shape[1], key.shape[-2]
    if causal:  # no pad: the last w rows
        first = max(0, q - w)
    else:  # one host read: the earliest row that is inside a sequence's window
        inside = layer.rows_within(w)  # (q,)
        first = int(inside.long().argmax()) if bool(inside.any()) else q
    qg = grouped(query, Hkv)
    step = block_rows(B, Hq, S)
    for r in range(first, q, step):
        n = min(step, q - r)
        logits = scores(qg[..., r:r + n, :], key, scaling)  # (B, Hkv, G, n, S)
        layer.attended(masked_softmax(logits, allowed_rows(layer, key, r, n)), r, logits)


@dataclass(frozen=True)
class SimulatedMask:
    """A simulated forward's mask for the fused kernel, built once (:func:`simulated_mask`) and shared by the
    layers. ``plain``: plain causal (nothing read); else ``empty`` (B, 1, T, 1) bool, the rows that see nothing
    (leading pads), and on the CPU ``bias`` (B, 1, T, T) the mask as an additive fp32 mask (beside the kernel's
    causal skip: every mask here is within causal), elsewhere ``mask`` (B, 1, T, T) bool with those rows opened
    (a row must see something)."""
    plain: bool
    empty: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def simulated_mask(mask: torch.Tensor, plain: bool) -> SimulatedMask:
    """mask (B, 1, 1, T, T) bool of a policy that does not read the scores (True: attend; within causal), or
    ``plain`` (plain causal: ``mask`` not read). No host read."""
    if plain:
        return SimulatedMask(True)
    m = mask[:, :, 0]  # (B, 1, T, T)
    empty = ~m.any(-1, keepdim=True)  # (B, 1, T, 1)
    if m.device.type == "cpu":
        return SimulatedMask(False, empty, bias=additive(m))
    return SimulatedMask(False, empty, mask=m | empty)


def simulated_fused(query, key, value, plan: SimulatedMask, scaling: float) -> torch.Tensor:
    """The simulated path for a mask that does not depend on the scores: query (B, Hq, T, D), key/value
    (B, Hkv, T, D) fp32 -> out (B, Hq, T, D). A row that sees nothing gets the uniform average of the values, as
    the eager softmax gives it. No host read."""
    if plan.plain:
        return fused(query, key, value, scaling, causal=True)[0]
    G = query.shape[1] // key.shape[1]
    if plan.bias is not None:
        out = cpu_flash(query, key, value, scaling, plan.bias, causal=True)[0].add_(nonfinite(query, key, value))
    else:
        out = fused(query, key, value, scaling, plan.mask)[0]
    mean = value.mean(-2).repeat_interleave(G, 1)[:, :, None]  # (B, Hq, 1, D)
    return torch.where(plan.empty, mean, out)
