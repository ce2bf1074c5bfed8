"""Two compression timings of an evicting policy: ``decode`` (the budget kept at every step, the default) and
``prefill`` (kvpress's protocol: cut once at the end of the prompt, every later token kept), the same in both
paths; what the cache holds (tokens per head) beside what it stores."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core.policies import PolicyError

L, P = 30, 14


@pytest.fixture(scope="module", params=["llama_gqa", "gpt_neox"])
def model(request):
    return tiny_model(request.param)


def both_paths(model, policy, ids):
    with torch.no_grad():
        with attach(model, policy, prompt_len=P):
            sim = model(ids).logits
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            real = [model(ids[:, :P], cache=cache).logits]
            real += [model(ids[:, t:t + 1], cache=cache).logits for t in range(P, L)]
    return sim, torch.cat(real, 1), cache


@pytest.mark.parametrize("name", ["h2o", "local", "strided_h2", "fixed"])
def test_compressed_once_at_the_prompts_end_in_both_paths(model, name):
    ids = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(8))
    once = make_policy(name, budget=0.3, compress="prefill")
    assert once.describe()["compress"] == "prefill" and "compress" not in make_policy(name).describe()
    sim, real, cache = both_paths(model, once, ids)
    torch.testing.assert_close(real, sim, rtol=0, atol=1e-4)
    total = int(once.counts(torch.tensor([P])).total)
    assert torch.equal(cache.held_tokens(), torch.full_like(cache.held_tokens(), total + L - P))
    every_step, _, kept = both_paths(model, make_policy(name, budget=0.3), ids)
    assert torch.equal(kept.held_tokens(), torch.full_like(kept.held_tokens(), total))
    assert not torch.allclose(every_step[:, P:], sim[:, P:])  # the timings differ after the prompt
    torch.testing.assert_close(every_step[:, :P], sim[:, :P], rtol=0, atol=1e-5)  # the prompt's rows do not


def test_bad_timing_fails_in_one_line():
    with pytest.raises(PolicyError, match="compress='later': allowed: decode, prefill"):
        make_policy("h2o", compress="later")
    with pytest.raises(PolicyError, match="topk keeps the whole cache"):
        make_policy("topk", budget=0.2).timed("prefill")
