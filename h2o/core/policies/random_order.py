"""random: the floor every plot needs. Each token gets a fixed pseudo-random priority, a seeded hash of (KV head,
position); when a token must go, the held one of lowest priority goes (the whole budget is random, no window).

A hash, not a random stream, so that both paths (the simulated row loop and the evicting cache) and any batching
hold the same tokens. Like kvpress's RandomPress with a seed, every layer draws the same numbers (so keeps the same
positions) and so does every sequence: the hash has no sequence id. kvpress's own draws (torch's generator) cannot
be reproduced, so parity with it is statistical.

Not ``position_only``: the priority differs per head, and the position-only closed form judges one head row. It
declares ``needs_scores`` although it reads none: the simulated row loop hands back attention rows only for
policies that do, and every evicting policy that is not position-only goes through that loop.
"""
import torch

from .base import NOTHING, Counts, Policy, PolicyError

P = 2**31 - 1  # a prime: every step below stays < 2**62, exact in int64
ROUNDS = ((48271, 11), (69621, 7), (16807, 3))  # (multiplier, increment) of each mixing round


def uniform(pos: torch.Tensor, seed: int) -> torch.Tensor:
    """(B, H, S) int64 positions -> (B, H, S) float64 in [0, 1), a fixed function of (seed, head, position)."""
    head = torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
    x = (pos % P + head * 1_000_003 + seed * 7_919 + 1) % P
    for mult, inc in ROUNDS:
        x = (x * mult + inc) % P
        x = x ^ (x >> 13)  # stays < 2**31
    return x.double() / P


class Random(Policy):
    name = "random"
    splits = False  # the whole budget is drawn
    reads = NOTHING  # a hash of (head, position)
    needs_scores = True  # (Policy's property, answered here) see the module docstring: the row loop's rows

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, seed: int = 0):
        super().__init__(budget, heavy, recent, heavy_share)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < P:
            raise PolicyError(f"seed={seed!r}: must be an int in [0, 2**31 - 1)")
        self.whole_budget()  # no recent window: the whole budget is random
        self.seed = seed

    def priority(self, pos, acc, now, counts: Counts):
        return uniform(pos, self.seed)  # (B, H, S) float64

    def describe(self):
        return {**super().describe(), "seed": self.seed}
