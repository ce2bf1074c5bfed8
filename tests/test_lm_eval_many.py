"""Compress once, ask many through lm-eval's evaluator and ``--model h2o`` (``questions=K`` / ``turns=K``): the niah
task's contexts of K needles, each compressed once, each question answered from its own copy; held against the
per-request paths (the whole prompt under ``full``, ``question=after``) and answers computed by hand, on a tiny random
Llama (one token per byte; weights drawn wider than the default so that answers depend on the prompt; answers
compared token for token)."""
from __future__ import annotations

import json

import pytest
import torch

from h2o import attach, make_policy
from h2o.tasks.lm_eval_model import H2OLM
from h2o.tasks.many_questions import greedy
from tests.refusal import refusal

META = {"depths": [0.3], "samples": 2}
GEN = {"max_gen_toks": 6}


@pytest.fixture(scope="module")
def tiny():
    """The model, its byte tokenizer decoding each id as ``<id>`` (lossless: a random model's bytes are seldom
    UTF-8, which decodes them all to one replacement character), the tokenizer's folder."""
    from h2o.assets.models import tiny_model
    from h2o.assets.tiny import byte_tokenizer, tiny_checkpoint

    tok = byte_tokenizer()
    def decode(token_ids, **_):
        ids = torch.as_tensor(token_ids).flatten().tolist()
        return "".join(f"<{i}>" for i in ids)

    tok.decode = decode
    model = tiny_model("llama", 0, initializer_range=0.2, max_position_embeddings=4096)  # as the checkpoint
    return model, tok, str(tiny_checkpoint("llama"))


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


@pytest.mark.parametrize("turns", [False, True])
def test_each_grouped_answer_has_its_generation_row(tiny, tmp_path, turns):
    """``generation_log``: one row per grouped request, as for ungrouped ones; under ``full`` the entries held at
    an answer's last step are its context, question and answer less its last token (plus the earlier turns)."""
    log = tmp_path / "rows.jsonl"
    mode = {"turns": 2} if turns else {"questions": 2}
    lm, samples = evaluate(tiny, 2, generation_log=str(log), **mode)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["task"], r["doc_id"], r["repeat"]) for r in rows] == [("niah", i, 0) for i in range(4)]
    e = lm.model.config.num_hidden_layers * lm.model.config.num_key_value_heads
    per_entry = 2 * lm.model.config.head_dim * 4  # fp32 keys and values of one token and KV head
    for c, context in enumerate(lm.contexts):
        fed = context["context_tokens"]
        for k, q in enumerate(context["question_tokens"]):
            row = rows[2 * c + k]
            fed += q + row["gen_tokens"] - 1 + (k > 0 and turns)  # a turn also feeds the last answer's token
            held = fed if turns else context["context_tokens"] + q + row["gen_tokens"] - 1
            assert row["kv_tokens_end"] == row["kv_tokens_peak"] == held * e
            assert row["kv_bytes_end"] == held * e * per_entry and row["prompt_tokens"] == context["context_tokens"] + q
            assert 1 <= row["gen_tokens"] <= GEN["max_gen_toks"] and (not row["at_limit"] or row["gen_tokens"] == 6)
            assert row["time_s"] > 0
            if not turns:
                fed = context["context_tokens"]
    assert lm.generations == rows


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
            a0 = greedy(model, h.new_cache(), ctx + q0, GEN["max_gen_toks"], lambda out: out[-1] == 2)  # 2: EOS
        with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
            a1 = greedy(model, h.new_cache(), ctx + q0 + a0 + q1, GEN["max_gen_toks"], lambda out: out[-1] == 2)
        assert [first["resps"][0][0], second["resps"][0][0]] == [tok.decode([t for t in a if t != 2]) for a in (a0, a1)]
        assert a0 != a1
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
    err = refusal(capsys)
    assert err.startswith("error:") and len(err.splitlines()) == 1 and words in err


def ruler_doc() -> dict:
    """A sample as lm-eval's RULER niah_multikey_1 writes it (four keys, one queried), by hand."""
    needle = "One of the special magic numbers for {} is: {}."
    context = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the numbers afterwards.\nThe river ran high. " + needle.format("calm-wagon", "1234567")
               + " Rain fell. " + needle.format("rusty-quill", "7654321") + " The mill was quiet. "
               + needle.format("proud-tower", "5551234") + " Bees hummed. " + needle.format("icy-kettle", "9990001")
               + " The day was long.\n")
    return {"index": 0, "input": context + "What is the special magic number for proud-tower mentioned in the "
                                           "provided text?", "outputs": ["5551234"], "length": 480,
            "max_length": 1024, "gen_prefix": "The special magic number for proud-tower mentioned in the provided "
                                              "text is"}


def test_ruler_samples_split_into_one_question_per_key():
    from h2o.tasks.question_after import question_of
    from h2o.tasks.ruler_many import split

    docs = split(ruler_doc(), 4, 7)
    assert [d["outputs"] for d in docs] == [["5551234"], ["1234567"], ["7654321"], ["9990001"]]  # queried first
    assert [(d["context"], d["question_index"]) for d in docs] == [(7, k) for k in range(4)]
    assert docs[1]["input"].endswith("\nWhat is the special magic number for calm-wagon mentioned in the provided "
                                     "text?") and docs[1]["gen_prefix"].endswith("calm-wagon mentioned in the "
                                                                                 "provided text is")
    texts = [d["input"] + " " + d["gen_prefix"] for d in docs]  # lm-eval's request text
    shared = {t[:len(t) - len(question_of(t, d, "niah_multikey_1_questions"))] for t, d in zip(texts, docs)}
    assert shared == {ruler_doc()["input"].split("What is")[0]} and len(split(ruler_doc(), 2, 0)) == 2


def test_ruler_questions_share_one_compressed_context(tiny):
    """Through ``--model h2o``'s generation: the four answers of one RULER context, compressed once, are the
    answers to each request alone with its context prefilled before its question (``question=after``), under
    ``full`` (there also the whole prompt's) and SnapKV."""
    from lm_eval.api.instance import Instance

    from h2o.tasks.ruler_many import split

    model, tok, _ = tiny
    docs = split(ruler_doc(), 4, 0)
    gen = {"until": [], "max_gen_toks": 5, "do_sample": False}

    def answer(policy, options=None, **model_args):
        lm = H2OLM(pretrained=model, tokenizer=tok, batch_size=1, policy=policy, **(options or {}), **model_args)
        reqs = [Instance("generate_until", d, (d["input"] + " " + d["gen_prefix"], dict(gen)), i,
                         ("niah_multikey_1_questions", i, 1)) for i, d in enumerate(docs)]
        return lm, lm.generate_until(reqs)

    lm, many = answer("full", questions=4)
    assert many == answer("full", question="after")[1] == answer("full")[1]  # the last: the whole prompt
    assert len(set(many)) > 1 and len(lm.contexts) == 1
    snap = {"budget": 0.3, "window": 8}
    assert answer("snapkv", snap, questions=4)[1] == answer("snapkv", snap, question="after")[1]


@pytest.mark.slow  # lm-eval's command line and a checkpoint load: about 15 s on idle cores
def test_the_command_line_gives_the_task_its_questions_from_the_model_args(tmp_path, monkeypatch):
    """``--model_args ...,questions=2`` alone: lm-eval merges it into task niah's metadata (2 needles per context) and
    the model answers each context's 2 questions from one compressed context."""
    import json

    from h2o.tasks import lm_eval_cli

    monkeypatch.setattr("sys.argv", [
        "lm_eval_cli", "--model", "h2o", "--model_args", "pretrained=tiny:llama,policy=snapkv,budget=0.3,questions=2",
        "--tasks", "niah", "--include_path", "tasks", "--metadata", '{"lengths": [480], "depths": [0.5], "samples": 2}',
        "--gen_kwargs", "max_gen_toks=2", "--device", "cpu", "--output_path", str(tmp_path / "out"), "--log_samples"])
    assert lm_eval_cli.main() == 0
    rows = [json.loads(line) for f in (tmp_path / "out").rglob("samples_niah_*.jsonl") for line in f.open()]
    assert sorted((r["doc"]["context"], r["doc"]["question_index"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["doc"]["answer"] for r in rows}) == 4


def test_ruler_split_tasks_through_h2o_run(tmp_path, monkeypatch):
    """``task=ruler_niah_multikey_1 task.lm_eval_task=niah_multikey_1_questions task.questions=2``: lm-eval's RULER
    contexts (``limit`` of them per length) each asked 2 keys, one record with each question's context and index,
    the question after the shared context; a bad count is refused before anything loads."""
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    args = ["model=tiny-llama", "threads=1", "task=ruler_niah_multikey_1",
            "task.lm_eval_task=niah_multikey_1_questions", "task.limit=2", "policy=snapkv", "policy.budget=0.5",
            "policy.window=8", f"runs_dir={tmp_path / 'runs'}"]
    assert main([*args, "task.questions=2"]) == 0
    (path,) = (tmp_path / "runs").rglob("metrics.json")
    rec = json.loads(path.read_text())
    samples = [json.loads(line) for line in (path.parent / "samples.jsonl").read_text().splitlines()]
    assert [(s["context"], s["question"]) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({s["target"][0] for s in samples}) == 4 and rec["protocol"]["questions"] == 2
    assert rec["question"] == "after" and rec["kept_ratio"] == pytest.approx(0.5, abs=0.01)
    assert path.parent.name.endswith("questions=2,window=8")
    assert main([*args, "task.questions=5"]) == 2  # RULER's contexts hold 4 keys
