"""Compress once, ask many through lm-eval's evaluator and ``--model h2o`` (``questions=K`` / ``turns=K``): the niah
task's contexts of K needles, each compressed once, each question answered from its own copy; held against the
per-request paths (the whole prompt under ``full``, ``question=after``) and answers computed by hand, on a tiny random
Llama (one token per byte; weights drawn wider than the default so that answers depend on the prompt)."""
from __future__ import annotations

import pytest
import torch

from h2o import attach, make_policy
from h2o.tasks.lm_eval_model import H2OLM
from h2o.tasks.many_questions import greedy

META = {"depths": [0.3], "samples": 2}
GEN = {"max_gen_toks": 6}


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.models import tiny_model
    from h2o.assets.tiny import byte_tokenizer, tiny_checkpoint

    return tiny_model("llama", 0, initializer_range=0.2), byte_tokenizer(), str(tiny_checkpoint("llama"))


def evaluate(tiny, n: int, policy: str = "full", options: dict | None = None, lengths=(480,), **model_args
             ) -> tuple[H2OLM, list]:
    """lm-eval's evaluator on task niah with ``n`` questions per context in its data; ``model_args`` the model's
    (questions, turns, question) -> (the model, the samples in doc order)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from h2o.assets.paths import REPO

    model, tok, path = tiny
    lm = H2OLM(pretrained=model, tokenizer=tok, batch_size=1, policy=policy, **(options or {}), **model_args)
    tm = TaskManager(include_path=str(REPO / "tasks"), include_defaults=False,
                     metadata={"tokenizer": path, **META, "lengths": list(lengths), "questions": n})
    out = simple_evaluate(model=lm, tasks=["niah"], task_manager=tm, log_samples=True, gen_kwargs=GEN)
    return lm, sorted(out["samples"]["niah"], key=lambda s: s["doc_id"])


def answers(samples) -> list[str]:
    return [s["resps"][0][0] for s in samples]


def test_full_answers_each_question_as_the_whole_context_does(tiny):
    lm, many = evaluate(tiny, 2, questions=2)
    _, whole = evaluate(tiny, 2)  # one request at a time, the whole context and its question as one prompt
    assert [(s["doc"]["context"], s["doc"]["question_index"]) for s in many] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert answers(many) == answers(whole) and len(set(answers(many))) > 1  # answers depend on the question
    assert [c["doc_ids"] for c in lm.contexts] == [[0, 1], [2, 3]]  # each context compressed once
    e = lm.model.config.num_hidden_layers * lm.model.config.num_key_value_heads
    assert all(c["footprint"]["tokens_held"] == c["context_tokens"] * e for c in lm.contexts)


@pytest.mark.parametrize("name, options", [("snapkv", {"window": 8}), ("h2o", {"compress": "decode"})])
def test_no_question_sees_another(tiny, name, options):
    """Each answer is the one a request alone gives with its context compressed before its question is fed."""
    lm, many = evaluate(tiny, 2, name, {"budget": 0.3, **options}, questions=2)
    _, alone = evaluate(tiny, 2, name, {"budget": 0.3, **options}, question="after")
    assert answers(many) == answers(alone)
    budget = [int(lm.policy.counts(torch.tensor([c["context_tokens"]])).total) for c in lm.contexts]
    e = lm.model.config.num_hidden_layers * lm.model.config.num_key_value_heads
    assert [c["footprint"]["tokens_held"] for c in lm.contexts] == [b * e for b in budget]
    assert sorted(lm.budgets) == sorted((c["context_tokens"], b) for c, b in zip(lm.contexts, budget) for _ in "ab")


def test_turns_answer_as_the_whole_conversation_does(tiny):
    """``turns``: under ``full`` turn 1's answer is what the context, turn 0's question and answer and turn 1's
    question, one prompt, give (computed by hand)."""
    lm, turns = evaluate(tiny, 2, turns=2)
    model, tok, _ = tiny
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    for c in (0, 1):
        first, second = (s for s in turns if s["doc"]["context"] == c)
        ctx, q0, q1 = ids(first["doc"]["prompt"]), ids(first["doc"]["question"]), ids(second["doc"]["question"])
        with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
            a0 = greedy(model, h.new_cache(), ctx + q0, GEN["max_gen_toks"], lambda out: "\n" in tok.decode(out))
        with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
            a1 = greedy(model, h.new_cache(), ctx + q0 + a0 + q1, GEN["max_gen_toks"],
                        lambda out: "\n" in tok.decode(out))
        assert [first["resps"][0][0], second["resps"][0][0]] == [tok.decode(a).split("\n")[0] for a in (a0, a1)]
    assert [c["mode"] for c in lm.contexts] == ["turns", "turns"]


def test_a_context_asked_more_than_k_questions_is_refused(tiny):
    from h2o.core.policies import PolicyError

    with pytest.raises(PolicyError, match=r"^questions=2: task niah asks one context 3 questions \(docs \[0, 1, 2\]\)"
                                          r"; allowed: questions=3 or more"):
        evaluate(tiny, 3, lengths=(560,), questions=2)


@pytest.mark.parametrize("model_args, words", [
    ("questions=0", "--model_args questions=0: allowed: an int >= 1"),
    ("turns=abc", "--model_args turns='abc': allowed: an int >= 1"),
    ("questions=2,turns=3", "--model_args questions=2,turns=3: allowed: one of them above 1")])
def test_bad_values_are_refused_in_one_line_before_loading(model_args, words, capsys, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    monkeypatch.setattr("sys.argv", ["lm_eval_cli", "--model", "h2o", "--model_args",
                                     f"pretrained=tiny:llama,{model_args}", "--tasks", "niah", "--include_path",
                                     "tasks", "--output_path", str(tmp_path / "out")])
    assert lm_eval_cli.main() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err
