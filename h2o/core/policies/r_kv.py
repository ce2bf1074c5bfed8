"""r_kv: keep the tokens that are important and not redundant (R-KV, Cai et al., arXiv 2505.24133), as the
reference code (Zefan-Cai/R-KV, ``R1KV.update_kv`` with ``cal_similarity``) defines it, at decoding time.

At a cut, per (sequence, KV head), over the held tokens in position order: the newest ``window`` kept; the others
scored ``mix_lambda * importance - (1 - mix_lambda) * redundancy`` (importance: the newest rows' group-maximum
logits, a softmax over the older held tokens, their mean, max-pooled by ``kernel``; redundancy: the held keys'
cosine similarity, each row's newest entry above ``threshold`` zeroed, column means, a softmax), the
``total - window`` highest kept. Step by step, with the reference's lines: docs/r_kv.md.

Defaults are the reference code's: ``window`` 8, ``kernel`` 7, ``mix_lambda`` 0.07, ``threshold`` 0.5 (its
``cal_similarity``), budget 128 tokens; its schedule, a cut every 128 generated tokens, is ``compress=interval``
(``interval`` 128 where none is given: its ``divide_length``; the default timing is every rule's, ``decode``).
``compress=decode`` is the rule at every step: the arriving token takes
the slot of the lowest-scored older token, judged over the ``total`` held older tokens with the newest ``w`` rows
(the reference's cut at interval 1 with a budget of ``total - 1``; docs/r_kv.md). A budget of at most ``w``
tokens keeps the newest (all window).

State: ``acc`` (B, H, S, w), per slot the group-maximum logit of each of the newest ``w`` rows (oldest first);
the paths give the rows' logits (``reads_logits``). At a cut or step the priority reads ``acc`` beside the held
keys (:meth:`cut_score`: (B, H, S, w + D)). Computed in at least fp32 (the reference: the model's dtype).
Per sequence (the reference's similarity reads the batch's first sequence).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import READ_KEYS, READ_LOGITS, READ_WINDOW, Counts, Policy, PolicyError, TIER
from .snapkv import newest_rank, push_rows

BUFFER = 128  # the reference's divide_length: generated tokens between two cuts (compress=interval)


def check_number(name: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise PolicyError(f"{name}={value!r}: allowed: a number in [{low:g}, {high:g}]")
    return float(value)


class Windowed(Policy):
    """R-KV's and G-KV's frame: the whole budget scored, the newest ``window`` held tokens inside it; per slot a
    ring of the newest rows, read at a cut or step beside the held keys (:meth:`cut_score`)."""

    splits = False  # the whole budget is scored, the window inside it
    token_options = ("window",)  # the observation window: at most the model's positions

    def __init__(self, budget=128, heavy=None, recent=None, heavy_share=0.5, window: int = 8):
        super().__init__(budget, heavy, recent, heavy_share)
        self.whole_budget()  # no recent part: the window is inside the budget
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PolicyError(f"window={window!r}: the observation window; allowed: an int >= 1")
        self.window = window

    def read_window(self) -> int:
        return self.window

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """acc (B, H, S, w) (g_kv's: w + 1, the history last): its ring of rows ``acc[..., :w]`` <- the newest ``w``
        real rows of the old rows and of probs (B, H, G, r, S) (r_kv's: the logits, ``reads_logits``), each the
        maximum over the G query heads, rows in order; valid (B, r) bool the real rows (None: all)."""
        push_rows(acc[..., :self.window], probs.float().amax(2).transpose(-1, -2), valid)  # (B, H, S, r)

    def cut_score(self, acc: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """acc (B, H, S, r) the rows, keys (B, H, S, D) -> (B, H, S, r + D): what :meth:`priority` reads."""
        dtype = torch.promote_types(keys.dtype, torch.float32)
        return torch.cat([acc.to(dtype), keys.to(dtype)], -1)

    def parts(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pos (B, H, S) (-1: not held) -> (held, window, older) (B, H, S) bool: the window the newest ``w``."""
        held = pos >= 0
        window = held & (newest_rank(pos) < self.window)
        return held, window, held & ~window


class RKV(Windowed):
    name = "r_kv"
    reads = frozenset({READ_WINDOW, READ_LOGITS, READ_KEYS})  # the newest rows' logits, the held keys
    # the default timing is every rule's (decode); the reference's is compress=interval (BUFFER when none is given)
    default_interval = BUFFER

    def __init__(self, budget=128, heavy=None, recent=None, heavy_share=0.5, window: int = 8, kernel: int = 7,
                 mix_lambda: float = 0.07, threshold: float = 0.5):
        super().__init__(budget, heavy, recent, heavy_share, window)
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"kernel={kernel!r}: the pooling kernel; allowed: an odd int >= 1")
        self.kernel = kernel
        self.mix_lambda = check_number("mix_lambda", mix_lambda, 0.0, 1.0)
        self.threshold = check_number("threshold", threshold, -1.0, 1.0)

    def new_state(self, B: int, H: int, S: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(B, H, S, self.window, dtype=torch.float32, device=device)  # (B, H, S, w)

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        """pos (B, H, S) (-1: not held), acc (B, H, S, w + D) (:meth:`cut_score`) -> (B, H, S) float64: the
        window a tier above the scores, newest first."""
        w = self.window
        held, window, older = self.parts(pos)
        score = self.mix_lambda * self.importance(acc[..., :w], pos, older) \
            - (1 - self.mix_lambda) * redundancy(acc[..., w:], pos, held, self.threshold, counts.host is not None)
        return torch.where(window, 2 * TIER + pos.double(), torch.where(older, score.double(), 0.0))

    def importance(self, logits: torch.Tensor, pos: torch.Tensor, older: torch.Tensor) -> torch.Tensor:
        """logits (B, H, S, w) of the newest rows, the older held tokens ``older`` (B, H, S) -> (B, H, S): each
        row's softmax over them, the mean over the rows, max-pooled along them in position order."""
        B, H, S, _ = logits.shape
        probs = logits.masked_fill(~older[..., None], -torch.inf).softmax(2).nan_to_num(0.0).mean(-1)  # (B, H, S)
        order = torch.where(older, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)  # older first
        line = probs.gather(-1, order).masked_fill(~older.gather(-1, order), -torch.inf)  # (B, H, S)
        pooled = F.max_pool1d(line.view(B * H, 1, S), self.kernel, 1, self.kernel // 2).view(B, H, S)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)

    def describe(self):
        return {**super().describe(), "window": self.window, "kernel": self.kernel, "mix_lambda": self.mix_lambda,
                "threshold": self.threshold}


def redundancy(keys: torch.Tensor, pos: torch.Tensor, held: torch.Tensor, threshold: float,
               compact: bool = False, fallback: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """keys (B, H, S, D), pos (B, H, S), held (B, H, S) bool -> (B, H, S): each held key's mean cosine similarity
    to the held keys (each row's newest similar entry zeroed), a softmax over the held keys; 0 where not held.
    ``fallback``: a row with no similar key has its oldest held entry zeroed (R-KV's ``cal_similarity``; False:
    nothing, G-KV's ``cal_similarity_triton``); ``eps`` is added to the norms (1e-8 R-KV's, 1e-6 that kernel's).

    On the CPU, where at most half the S slots are held (the simulated path's rows: S is every position, at most
    the budget held), the similarity is taken over the held keys only, gathered in slot order (n^2 instead of S^2
    entries per head): the same figures up to float rounding (the non-held enter neither the means nor the softmax;
    the sums run in another order, so an exact near-tie may be decided the other way). It needs n on the host, a
    read that costs nothing on the CPU and a sync on a GPU, so a GPU takes the S x S form, and so does the evicting
    cache (``compact``: its counts keep a host mirror, ``Counts.host``), whose slots are what it holds."""
    S = held.shape[-1]
    n = int(held.sum(-1).amax()) if held.device.type == "cpu" and S > 1 and not compact else S
    if n > S // 2:
        return redundancy_of(keys, pos, held, threshold, fallback, eps)
    idx = held.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :max(n, 1)]  # (B, H, n) held first
    sub = redundancy_of(keys.gather(2, idx[..., None].expand(*idx.shape, keys.shape[-1])), pos.gather(-1, idx),
                        held.gather(-1, idx), threshold, fallback, eps)  # (B, H, n)
    return torch.zeros(held.shape, dtype=sub.dtype, device=sub.device).scatter_(-1, idx, sub)


def redundancy_of(keys: torch.Tensor, pos: torch.Tensor, held: torch.Tensor, threshold: float,
                  fallback: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """:func:`redundancy` over all S slots: the (B, H, S, S) similarity."""
    unit = keys / (keys.norm(dim=-1, keepdim=True) + eps)
    sim = unit @ unit.transpose(-1, -2)  # (B, H, S, S) rows i, columns j
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    cols = held[..., None, :]  # (B, H, 1, S)
    similar = (sim > threshold) & cols
    newest = torch.where(similar, pos[..., None, :], -1).amax(-1)  # (B, H, S) per row, -1: none
    oldest = torch.where(held, pos, torch.iinfo(torch.int64).max).amin(-1, keepdim=True)  # (B, H, 1)
    target = torch.where(newest >= 0, newest, oldest if fallback else -1)  # (B, H, S) the entry zeroed per row
    sim = sim.masked_fill((pos[..., None, :] == target[..., None]) & cols, 0.0)
    rows = held.sum(-1, keepdim=True).clamp(min=1)  # (B, H, 1)
    mean = (sim * held[..., None].to(sim.dtype)).sum(-2) / rows  # (B, H, S) per column
    return mean.masked_fill(~held, -torch.inf).softmax(-1).nan_to_num(0.0)
