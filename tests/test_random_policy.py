"""random: a naive cache with the same fixed priorities holds the same tokens; seeds and heads differ."""
import pytest
import torch

from h2o import make_policy
from h2o.core.policies import PolicyError
from h2o.core.policies.random_order import uniform
from tests.test_policies import random_logits, run_mask, static_rows


@pytest.mark.parametrize("K", [3, 8])
@pytest.mark.parametrize("seed", [0, 5])
def test_random_against_naive(K, seed):
    T = 32
    mask = run_mask(make_policy("random", budget=K, seed=seed), random_logits(T))
    u = uniform(torch.arange(T).view(1, 1, T).expand(1, 3, T), seed)[0]  # (H, T)
    for h in range(3):
        want = static_rows(T, K, lambda j, i, h=h: float(u[h, j]))
        for b in range(2):  # no sequence id: every sequence holds the same tokens
            assert torch.equal(mask[b, h], want)


def test_heads_and_seeds_differ_and_scores_are_ignored():
    logits = random_logits(32)
    a = run_mask(make_policy("random", budget=6, seed=0), logits)
    assert not torch.equal(a[:, 0], a[:, 1])  # each KV head its own draws
    assert not torch.equal(a, run_mask(make_policy("random", budget=6, seed=1), logits))
    assert torch.equal(a, run_mask(make_policy("random", budget=6, seed=0), random_logits(32, seed=9)))


def test_uniform_is_spread():
    u = uniform(torch.arange(50000).view(1, 1, -1), 0).flatten()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.histc(u.float(), bins=10, min=0, max=1).min() > 4500  # 10 bins of ~5000


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**31])
def test_bad_seed(seed):
    with pytest.raises(PolicyError, match="seed="):
        make_policy("random", budget=0.2, seed=seed)
