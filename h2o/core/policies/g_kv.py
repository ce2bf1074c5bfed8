"""g_kv: G-KV's training-free global score (Liao et al., arXiv 2512.00504), local attention smoothed by a decayed
history and mixed with R-KV's redundancy, as its reference code (microsoft/G-KV, ``ScoreBasedKV.update_kv`` with
``enable_score_cache``, ``smooth_method="max"``, ``suppressing_redundancy``; ``compute_attention_scores`` and
``cal_similarity_triton`` of its ``gkv/utils/compression_score.py``) defines it, at decoding time.

At a cut, per (sequence, KV head), over the held tokens in position order: the newest ``window`` kept; each older
held token ``j`` scored

    local_j     = mean over the newest ``w`` rows of the maximum over the KV head's query heads of the row's
                  attention probability of ``j`` (each row a softmax over every held key it sees), divided by its
                  largest value over the older tokens
    global_j    = max(alpha * history_j, local_j)          (history_j = 0 for a token never ranked before)
    redundant_j = R-KV's redundancy (cosine similarity of the held keys, each row's newest entry above ``threshold``
                  zeroed, column means, a softmax over the held keys), divided by its largest value over the older
    score_j     = mix_lambda * global_j - (1 - mix_lambda) * redundant_j

and the ``total - window`` highest kept. Each kept token's ``history`` becomes its ``global_j`` (the reference's
``score_cache``), so a token's score decays by ``alpha`` per cut unless its local attention renews it. Step by
step, with the reference's lines and every difference: docs/g_kv.md.

Defaults are the reference's G-KV recipe (its scripts/inference.sh): ``window`` 16, ``mix_lambda`` 0.5, ``alpha``
0.8, ``threshold`` 0.5 (``cal_similarity_triton``'s); budget 128 tokens (its ``--budget`` default; the recipe runs
2048). Its schedule, a cut at the prompt's end and after every 128th generated token (``divide_length``), is this
rule's default timing, ``compress=interval`` (``interval`` 128 where none is given); ``prefill`` is one cut;
``buffer`` (TriAttention's trigger) is accepted. The history is carried from cut to cut, so ``decode`` (an eviction
at every step, no cut) is refused in one line.

State: ``acc`` (B, H, S, w + 1): per slot the group-maximum attention probability of each of the newest ``w`` rows
(oldest first, as the paths computed them over the cache each row saw), then its history. Under ``interval`` N >=
w every window row came after the last cut and saw exactly the keys the cut ranks, the rows the reference
recomputes; below, the older rows saw keys since dropped (docs/g_kv.md). At a cut the priority reads ``acc``
beside the held keys (:meth:`cut_score`: (B, H, S, w + 1 + D)); :meth:`cut_order` writes the history. Computed in
at least fp32 (the reference: the model's dtype). Per sequence (the reference cuts the batch when its padded
length exceeds the budget).
"""
from __future__ import annotations

import torch

from ..schedule import Interval, Schedule
from .base import READ_KEYS, READ_WINDOW, TIER, Counts
from .budget import Unsupported
from .r_kv import Windowed, check_number, redundancy

DIVIDE = 128  # the reference's divide_length: generated tokens between two cuts (compress=interval)
EPS = 1e-6  # cal_similarity_triton's key-norm epsilon (R-KV's cal_similarity: 1e-8)


class GKV(Windowed):
    name = "g_kv"
    reads = frozenset({READ_WINDOW, READ_KEYS})  # the newest rows' attention, the held keys
    schedule = Interval(DIVIDE)  # the reference's timing (compress=interval; DIVIDE where no interval is given)
    default_interval = DIVIDE  # where a schedule that takes an interval is given none

    def __init__(self, budget=128, heavy=None, recent=None, heavy_share=0.5, window: int = 16,
                 alpha: float = 0.8, mix_lambda: float = 0.5, threshold: float = 0.5):
        super().__init__(budget, heavy, recent, heavy_share, window)
        self.alpha = check_number("alpha", alpha, 0.0, 1.0)
        self.mix_lambda = check_number("mix_lambda", mix_lambda, 0.0, 1.0)
        self.threshold = check_number("threshold", threshold, -1.0, 1.0)

    def check_schedule(self, schedule: Schedule) -> None:
        """A schedule that evicts at every step is refused (the history lives from cut to cut)."""
        if schedule.evicts_each_step:
            cuts = ", ".join(n for n, c in Schedule.registry.items() if not c.evicts_each_step)
            raise Unsupported(f"compress={schedule.name}: g_kv carries its history from cut to cut (G-KV cuts every "
                              f"divide_length tokens); allowed: {cuts}")

    def new_state(self, B: int, H: int, S: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(B, H, S, self.window + 1, dtype=torch.float32, device=device)  # (B, H, S, w + 1)

    def global_score(self, acc: torch.Tensor, older: torch.Tensor) -> torch.Tensor:
        """acc (B, H, S, w + 1) (rows, history), older (B, H, S) bool -> (B, H, S): the local score (the rows'
        mean over the older tokens, divided by its largest) against the history decayed by ``alpha``, the larger;
        0 where not older."""
        local = torch.where(older, acc[..., :self.window].mean(-1), 0.0)  # (B, H, S)
        top = local.amax(-1, keepdim=True)  # (B, H, 1)
        local = torch.where(top > 0, local / top, 0.0)
        return torch.where(older, torch.maximum(self.alpha * acc[..., self.window], local), 0.0)

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        """pos (B, H, S) (-1: not held), acc (B, H, S, w + 1 + D) (:meth:`cut_score`) -> (B, H, S) float64: the
        window a tier above the scores, newest first."""
        w = self.window
        held, window, older = self.parts(pos)
        red = redundancy(acc[..., w + 1:], pos, held, self.threshold, counts.host is not None, fallback=False, eps=EPS)
        red = torch.where(older, red, 0.0)
        top = red.amax(-1, keepdim=True)  # (B, H, 1)
        red = torch.where(top > 0, red / top, 0.0)
        score = self.mix_lambda * self.global_score(acc[..., :w + 1], older) - (1 - self.mix_lambda) * red
        return torch.where(window, 2 * TIER + pos.double(), torch.where(older, score.double(), 0.0))

    def cut_order(self, acc, prio, pos, valid, counts: Counts) -> None:
        """A cut's history, in place: on each (sequence, KV head) holding more than its ``total``, every older held
        slot's history becomes its global score (the kept ones carry it to the next cut), the window's 0."""
        _, _, older = self.parts(pos.masked_fill(~valid, -1))
        cut = (valid.sum(-1) > counts.total[:, None])[..., None]  # (B, H, 1): the reference cuts only above budget
        history = acc[..., self.window]  # (B, H, S) a view: written in place
        history.copy_(torch.where(cut, self.global_score(acc.float(), older), history))

    def describe(self):
        return {**super().describe(), "window": self.window, "alpha": self.alpha, "mix_lambda": self.mix_lambda,
                "threshold": self.threshold}
