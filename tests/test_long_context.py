"""lm-eval's generation and scoring through the harness's own attention and evicting cache (``--model h2o``),
held against lm-eval's own ``hf`` model at 100% budget; the budget recorded per generated row."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from h2o.tasks.lm_eval_model import H2OLM

CONTEXTS = ["Once upon a time there was a", "The answer to the question, asked twice over in a long sentence, is"]
GEN = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
PAIRS = [("A question:", " one answer"), ("A much longer question, padded out well past the first:", " two"),
         ("Short", " and a rather long continuation here")]


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def gen_requests(contexts=CONTEXTS, docs=None):
    return [Instance("generate_until", (docs or [{}] * len(contexts))[i], (c, dict(GEN)), i)
            for i, c in enumerate(contexts)]


def ll_requests():
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]


def generate(lm, contexts=CONTEXTS):
    """lm-eval's generation -> texts, and the token ids the model produced (the texts encoded again)."""
    return lm.generate_until(gen_requests(contexts))


def check_equal_to_hf(model, tok, policies, batch_size=2):
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, add_bos_token=False, device="cpu")
    ref_gen = generate(hf)
    ref_ll = hf.loglikelihood(ll_requests())
    assert len(set(ref_gen)) == len(ref_gen) and all(ref_gen)  # non-trivial, distinct generations
    for policy, options in policies:
        lm = H2OLM(pretrained=model, tokenizer=tok, policy=policy, batch_size=batch_size, add_bos_token=False,
                   **options)
        calls = []
        real = lm._model_generate

        def spy(context, *a, **kw):  # every generation goes through the evicting cache (no pass-through)
            calls.append(context.shape)
            return real(context, *a, **kw)

        lm._model_generate = spy
        gens = generate(lm)
        assert [tok.encode(g) for g in gens] == [tok.encode(g) for g in ref_gen], policy  # token for token
        assert calls and calls[0][0] == batch_size  # one left-padded batch of both prompts
        lens = sorted(len(tok.encode(c, add_special_tokens=False)) for c in CONTEXTS)
        assert sorted(lm.budgets) == [(n, n) for n in lens]  # 100%: the budget is each prompt's whole length
        lls = lm.loglikelihood(ll_requests())
        assert lm.stats["rows"] >= len(PAIRS)  # scored by the harness's attention (the simulated mask)
        for (ll, greedy), (ref, ref_greedy) in zip(lls, ref_ll):
            assert ll == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy


def test_generation_and_loglikelihoods_equal_hf_at_full_budget(tiny):
    model, tok = tiny
    check_equal_to_hf(model, tok, [("full", {}), ("h2o", {"budget": 1.0}), ("local", {"budget": 1.0})])


def test_evicting_generation_keeps_a_ratio_of_each_prompt(tiny):
    model, tok = tiny
    lm = H2OLM(pretrained=model, tokenizer=tok, policy="h2o", budget=0.2, batch_size=2)
    gens = generate(lm)
    full = generate(H2OLM(pretrained=model, tokenizer=tok, policy="full", batch_size=2))
    lens = sorted(len(tok.encode(c, add_special_tokens=False)) for c in CONTEXTS)
    # heavy 10% + recent 10%, each floor(r * n) tokens of the prompt (h2o.core.policies.base.to_count)
    assert sorted(lm.budgets) == [(n, 2 * int(0.1 * n)) for n in lens] == [(28, 4), (67, 12)]
    assert gens != full  # the evicting cache changes what is generated
    # one prompt alone gives the same text as inside the left-padded batch (budgets are per sequence)
    alone = [generate(H2OLM(pretrained=model, tokenizer=tok, policy="h2o", budget=0.2, batch_size=1), [c])[0]
             for c in CONTEXTS]
    assert alone == gens


def test_question_tokens_name_the_end_of_the_prompt(tiny):
    model, tok = tiny
    lm = H2OLM(pretrained=model, tokenizer=tok, policy="full", batch_size=2)
    question = " What is it?"
    contexts = ["Some haystack text." + question, "No question here"]
    lm.generate_until(gen_requests(contexts, [{"question": question}, {"question": "absent"}]))
    assert lm.question_tokens(contexts[0]) == len(question)  # one token per byte for the tiny tokenizer
    assert lm.question_tokens(contexts[1]) == 0 and lm.question_tokens("never seen") == 0


@pytest.mark.slow
def test_generation_and_loglikelihoods_equal_hf_on_smollm2():
    from h2o.assets.models import load_model

    model, tok = load_model("smollm2-135m")
    check_equal_to_hf(model, tok, [("full", {}), ("h2o", {"budget": 1.0})])
