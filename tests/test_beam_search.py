"""transformers' generate with beams and several returned sequences through the evicting cache (its batch hooks:
``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``)."""
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from h2o import attach, make_policy
from h2o.assets.models import tiny_model

ARCHS = ("llama", "opt", "gpt_neox")
GEN = 10


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


def prompts(lengths, seed=0):
    """Left-padded (B, T) ids and mask of prompts of the given lengths (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids, mask = torch.zeros(len(lengths), T, dtype=torch.long), torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:], mask[b, T - n:] = torch.randint(3, 128, (n,), generator=g), 1
    return ids, mask


BEAMS = dict(max_new_tokens=GEN, num_beams=4, do_sample=False, pad_token_id=0, eos_token_id=None,
             length_penalty=0.0, early_stopping=True)


class Held(StoppingCriteria):
    """Records, at every step, the tokens each (sequence, KV head) of every layer holds and the slots stored."""

    def __init__(self, state):
        self.state, self.steps = state, []

    def __call__(self, input_ids, scores, **kw):
        for layer in self.state.cache.layers:  # a pooled layer's slots shrunk to its count, as footprint reads them
            layer.fullest()
        self.steps.append([((layer.pos >= 0).sum(-1), layer.keys.shape[-2]) for layer in self.state.cache.layers])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("returned", [1, 3])
def test_full_beam_search_equals_transformers(model, returned):
    ids, mask = prompts([20, 14])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, num_return_sequences=returned, **BEAMS)
        with attach(model, make_policy("full"), mode="real") as h:
            out = model.generate(ids, attention_mask=mask, cache=h.new_cache(), num_return_sequences=returned,
                                 **BEAMS)
    assert out.shape == (2 * returned, ids.shape[1] + GEN)
    assert torch.equal(out, ref)


def alone(model, policy, seq, prompt: int):
    """One sequence (1, n) fed alone through the evicting cache: its first ``prompt`` tokens as a prefill, then
    one token at a time. (log-probabilities of the next token after the prompt and after each later token
    (n - prompt + 1, V), the cache after every token)."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        logits = [model(seq[:, :prompt], cache=cache).logits[:, -1]]
        for t in range(prompt, seq.shape[1]):
            logits.append(model(seq[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.log_softmax(torch.cat(logits).float(), -1), cache


def held_state(pos, acc):
    """One sequence's (positions held, their scores) per KV head in position order: pos, acc (H, S) -> (H, n)."""
    n = int((pos >= 0).sum(-1).min())
    key, idx = pos.sort(-1)
    return key[:, -n:], acc.gather(-1, idx)[:, -n:]


class LastStep(LogitsProcessor):
    """Keeps the running sequences, their log-probabilities and a copy of the cache's state at each step."""

    def __init__(self, state):
        self.state, self.steps = state, []

    def __call__(self, input_ids, scores):
        layers = [(layer.pos.clone(), layer.acc.clone()) for layer in self.state.cache.layers]
        self.steps.append((input_ids.clone(), scores.clone(), layers))
        return scores


@pytest.mark.parametrize("name", ["h2o", "strided_h2", "streaming_llm"])
def test_evicting_beam_search_keeps_its_budget_and_each_beam_its_own_state(model, name):
    """Two prompts of different lengths (left-padded: different budgets and host counts per sequence). At every
    step every sequence holds exactly its budget; at the last step each running beam's state (the positions held
    and their accumulated scores in every layer) and log-probabilities are those of its tokens fed alone through
    the evicting cache: every reorder moved the whole state with its beam, host counts included. The returned
    beams' scores are their tokens' log-probabilities fed so."""
    lengths = [20, 14]
    ids, mask = prompts(lengths, seed=1)
    policy = make_policy(name, budget=0.3)
    budgets = [int(policy.counts(torch.tensor([n])).total) for n in lengths]
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        held, last = Held(h), LastStep(h)
        out = model.generate(ids, attention_mask=mask, cache=h.new_cache(), num_return_sequences=2,
                             stopping_criteria=StoppingCriteriaList([held]), return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([last]), output_scores=True, **BEAMS)
    assert len(held.steps) == GEN
    for step in held.steps:
        for n_held, slots in step:  # (B * beams, Hkv)
            want = torch.tensor(budgets).repeat_interleave(4)[:, None].expand_as(n_held)
            assert torch.equal(n_held, want)
            assert slots == max(budgets)
    T = ids.shape[1]
    seqs, scores, layers = last.steps[-1]  # (B * beams, T + GEN - 1): the state after the last forward
    for r, seq in enumerate(seqs):
        b = r // 4
        logp, cache = alone(model, policy, seq[None, T - lengths[b]:], lengths[b])
        assert torch.allclose(logp[-1], scores[r], atol=1e-4)
        for (pos, acc), solo in zip(layers, cache.layers):
            beam_pos, beam_acc = held_state(pos[r], acc[r])
            solo_pos, solo_acc = held_state(solo.pos[0], solo.acc[0])
            assert torch.equal(beam_pos, solo_pos)
            assert torch.allclose(beam_acc, solo_acc, atol=1e-4)
    for r, seq in enumerate(out.sequences):  # (B * returned, T + GEN)
        b = r // 2
        logp, _ = alone(model, policy, seq[None, T - lengths[b]:-1], lengths[b])
        score = float(logp.gather(-1, seq[T:, None]).sum())
        assert score == pytest.approx(float(out.sequences_scores[r]), abs=1e-3)


def step_logits(model, h, cache, nxt, **kw):
    h.cache = cache  # the attached state serves one cache at a time
    with torch.no_grad():
        return model(nxt, cache=cache, **kw).logits[:, -1]


@pytest.mark.parametrize("name", ["h2o", "fixed_h2", "topk_h2"])
def test_repeat_interleave_and_select_equal_a_cache_built_so(model, name):
    """A cache repeated in the batch (or cut to some of its sequences) decodes as one prefilled that way."""
    policy = make_policy(name, budget=0.3)
    ids, mask = prompts([18, 12], seed=2)
    nxt = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        step_logits(model, h, cache, ids, attention_mask=mask)
        cache.batch_repeat_interleave(2)
        got = [step_logits(model, h, cache, nxt[:, t:t + 1].repeat_interleave(2, 0)) for t in range(4)]
        twice = h.new_cache()
        step_logits(model, h, twice, ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0))
        want = [step_logits(model, h, twice, nxt[:, t:t + 1].repeat_interleave(2, 0)) for t in range(4)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))

        cache.batch_select_indices(torch.tensor([2]))  # the second prompt's first copy (its host counts differ)
        one = h.new_cache()  # the same prompt, padded the same, alone
        step_logits(model, h, one, ids[1:], attention_mask=mask[1:])
        for t in range(4):
            step_logits(model, h, one, nxt[1:, t:t + 1])
        assert [layer.host_held for layer in cache.layers] == [layer.host_held for layer in one.layers]
        for t in range(3):
            step = torch.full((1, 1), 5 + t)
            assert torch.allclose(step_logits(model, h, cache, step), step_logits(model, h, one, step), atol=1e-5)
            held = lambda c: c.layers[0].pos.sort(-1).values[..., -c.layers[0].host_held[0]:]  # noqa: E731
            assert torch.equal(held(cache), held(one))  # the same tokens (slots empty in every sequence aside)


def test_a_per_sequence_policy_refuses_a_reorder(model):
    from h2o.core.policies.per_sequence import PerSequence
    from h2o.core.policies import PolicyError

    policy = PerSequence([make_policy("h2o", budget=8), make_policy("local", budget=8)])
    ids, mask = prompts([12, 12])
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids, cache=cache)
        with pytest.raises(PolicyError, match="one policy per sequence"):
            cache.reorder_cache(torch.tensor([1, 0]))
