"""Compress once, ask many (``task.questions``) and multi-turn (``task.turns``) on the needle task: the context
compressed once, each question answered from its own copy of it, held against answers computed by hand, on the tiny
random Llama (one token per byte)."""
from __future__ import annotations

import pytest
import torch

from h2o import attach, make_policy
from h2o.core.validate import BadInput
from h2o.tasks.many_questions import ask, copy_of, greedy, kv_entries_per_token
from tests.refusal import refusal

CONTEXT = ("The grass is green and the sky is blue. The code for the red door is 4821. Rain fell on the hills all "
           "day long. The code for the blue gate is 90317. The river ran high under the old stone bridge. The code "
           "for the iron box is 5567.\n")
QUESTIONS = ["What is the code for the red door? The code is", "What is the code for the blue gate? The code is",
             "What is the code for the iron box? The code is"]
POLICIES = [("snapkv", {"window": 8}), ("h2o", {"compress": "decode"}), ("h2o", {"compress": "prefill"}),
            ("tova", {})]
MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def never(_out) -> bool:
    return False


def whole(model, policy, *parts: list[int]) -> list[int]:
    """By hand: ``parts`` joined, one forward through a fresh evicting cache, then greedy steps."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        return greedy(model, h.new_cache(), [t for p in parts for t in p], MAX_NEW, never)


def test_full_answers_each_question_as_the_whole_context_does(tiny):
    model, tok = tiny
    full = make_policy("full")
    answers, compressed, _ = ask(model, full, ids(tok, CONTEXT), [ids(tok, q) for q in QUESTIONS], MAX_NEW, never)
    assert answers == [whole(model, full, ids(tok, CONTEXT), ids(tok, q)) for q in QUESTIONS]
    assert compressed["tokens_held"] == len(ids(tok, CONTEXT)) * kv_entries_per_token(model)


@pytest.mark.parametrize("name, options", POLICIES)
def test_no_question_sees_another(tiny, name, options):
    """Each question's answer is what a context compressed for it alone gives, in any order of the questions."""
    model, tok = tiny
    policy = make_policy(name, budget=0.3, **options)
    ctx, qs = ids(tok, CONTEXT), [ids(tok, q) for q in QUESTIONS]
    answers, compressed, held = ask(model, policy, ctx, qs, MAX_NEW, never)
    alone = [ask(model, policy, ctx, [q], MAX_NEW, never)[0][0] for q in qs]
    assert answers == alone
    assert ask(model, policy, ctx, qs[::-1], MAX_NEW, never)[0] == answers[::-1]
    budget = int(policy.counts(torch.tensor([len(ctx)])).total)
    e = kv_entries_per_token(model)  # layers x KV heads
    assert compressed["tokens_held"] == budget * e  # the context's budget, every layer and KV head
    grows = policy.schedule.once  # compress=prefill: nothing after the cut is evicted
    assert held == [compressed["tokens_held"] + (len(q) + MAX_NEW - 1) * e * grows for q in qs]


def test_a_copy_shares_no_state(tiny):
    model, tok = tiny
    policy = make_policy("h2o", budget=0.3, compress="decode")
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        base = h.new_cache()
        model(input_ids=torch.tensor([ids(tok, CONTEXT)]), cache=base)
        before = [(layer.keys.clone(), layer.pos.clone(), layer.acc.clone(), list(layer.host_tok))
                  for layer in base.layers]
        h.cache = copy_of(base)
        greedy(model, h.cache, ids(tok, QUESTIONS[0]), MAX_NEW, never)
        assert h.cache.policy is base.policy and h.cache.layers[0].keys is not base.layers[0].keys
        for layer, (keys, pos, acc, host) in zip(base.layers, before):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.pos, pos) and torch.equal(layer.acc, acc)
            assert layer.host_tok == host


@pytest.mark.parametrize("name, options", POLICIES)
def test_each_question_is_compressed_inside_its_own_prompt(tiny, name, options):
    """``question=each``: each answer is the one-prompt answer of the context and that question (by hand), the
    footprint the mean of its prompts' cuts; under ``full`` the same answers as compressing once."""
    model, tok = tiny
    policy = make_policy(name, budget=0.3, **options)
    ctx, qs = ids(tok, CONTEXT), [ids(tok, q) for q in QUESTIONS]
    answers, compressed, held = ask(model, policy, ctx, qs, MAX_NEW, never, each=True)
    assert answers == [whole(model, policy, ctx, q) for q in qs]
    e = kv_entries_per_token(model)
    budgets = [int(policy.counts(torch.tensor([len(ctx) + len(q)])).total) * e for q in qs]
    if policy.schedule.once:  # the cut at each prompt's end, then the answer kept whole
        assert compressed["tokens_held"] == pytest.approx(sum(budgets) / len(qs))
        assert held == [b + (MAX_NEW - 1) * e for b in budgets]
    else:  # decode timing: the budget held from the prompt's end on
        assert held == budgets
    full = make_policy("full")
    assert ask(model, full, ctx, qs, MAX_NEW, never, each=True)[0] == ask(model, full, ctx, qs, MAX_NEW, never)[0]


def test_full_turns_answer_as_the_whole_conversation_does(tiny):
    """Multi-turn: each turn's answer under ``full`` is what the whole conversation so far, one prompt, gives."""
    model, tok = tiny
    full = make_policy("full")
    ctx, qs = ids(tok, CONTEXT), [ids(tok, q) for q in QUESTIONS]
    answers, _, held = ask(model, full, ctx, qs, MAX_NEW, never, turns=True)
    history = list(ctx)
    for q, answer in zip(qs, answers):
        assert answer == whole(model, full, history, q)
        history += q + answer
    assert held[-1] == (len(history) - 1) * kv_entries_per_token(model)  # the last answer's last token is never fed


@pytest.mark.parametrize("name, options", POLICIES[1:3])
def test_turns_keep_one_cache_under_the_timing(tiny, name, options):
    model, tok = tiny
    policy = make_policy(name, budget=0.3, **options)
    ctx, qs = ids(tok, CONTEXT), [ids(tok, q) for q in QUESTIONS]
    _, compressed, held = ask(model, policy, ctx, qs, MAX_NEW, never, turns=True)
    fed = [len(q) + MAX_NEW - 1 + (k > 0) for k, q in enumerate(qs)]  # a turn also feeds the last answer's token
    if policy.schedule.once:  # compress=prefill: the context cut once, each turn kept whole
        assert held == [compressed["tokens_held"] + kv_entries_per_token(model) * sum(fed[:k + 1]) for k in range(len(qs))]
    else:  # decode: the budget held across turns
        assert held == [compressed["tokens_held"]] * len(qs)


def test_the_needle_task_asks_each_context_many_questions(tiny):
    from h2o.tasks.long_context import LongContextTask

    model, tok = tiny
    task = LongContextTask("niah", lengths=[512], depths=[0.5], samples=2, questions=3)
    result = task.run(model, tok, make_policy("snapkv", budget=0.3, window=8), "real", 0)
    assert [(s["doc_id"], s["question"]) for s in result.samples] == [(c, k) for c in range(2) for k in range(3)]
    assert len({s["target"] for s in result.samples}) == 6 and len(result.info["contexts"]) == 2
    assert all(0 <= s["needle_depth"] <= 1 and s["question_tokens"] > 0 for s in result.samples)
    assert result.info["kept_ratio"] == pytest.approx(0.3, abs=0.01) and result.info["questions"] == 3
    assert all(r["kv_bytes_cut"] > 0 and "kv_bytes_cut" not in s for r in result.info["contexts"]
               for s in result.samples)
    assert task.protocol(tok)["questions"] == 3 and "turns" not in task.protocol(tok)
    each = LongContextTask("niah", lengths=[512], depths=[0.5], samples=2, questions=3, question="each")
    inside = each.run(model, tok, make_policy("snapkv", budget=0.3, window=8), "real", 0)
    assert [s["target"] for s in inside.samples] == [s["target"] for s in result.samples]
    assert inside.info["question"] == "each" and result.info["question"] == "after"
    assert each.protocol(tok)["question"] == "each"
    turns = LongContextTask("niah", lengths=[512], depths=[0.5], samples=1, turns=2)
    out = turns.run(model, tok, make_policy("h2o", budget=0.3, compress="decode"), "real", 0)
    assert [s["turn"] for s in out.samples] == [0, 1] and len(out.info["turn_acc"]) == 2


def test_bad_values_are_refused_in_one_line():
    from h2o.tasks.long_context import LongContextTask

    with pytest.raises(BadInput, match=r"^task.questions=0: expected an int >= 1$"):
        LongContextTask("niah", questions=0)
    with pytest.raises(BadInput, match=r"^task.turns='2': expected an int >= 1$"):
        LongContextTask("niah", turns="2")
    with pytest.raises(BadInput, match=r"^task.questions=2, task.turns=3: allowed: one of them above 1$"):
        LongContextTask("niah", questions=2, turns=3)
    with pytest.raises(BadInput, match=r"^task.question='each': allowed: prompt, after "
                                       r"\(each: with task.questions > 1 on niah\)$"):
        LongContextTask("niah", question="each", turns=3)
    with pytest.raises(BadInput, match=r"^task.questions=2: several questions per context on task niah and "
                                       r"RULER's split"):
        LongContextTask("r", "niah_single_2", questions=2)


def test_hydra_names_the_option_and_refuses_bad_values_before_loading(hydra_ctx, tmp_path, capsys):
    from h2o.pipeline import sweep
    from h2o.pipeline.spec import prepare
    from h2o.pipeline.sweep import _compose

    root = ["model=tiny-llama", "task=niah", "task.lengths=[512]", f"runs_dir={tmp_path}"]
    plain, given, many = (prepare(_compose(root + extra)) for extra in
                          ([], ["task.questions=1", "task.turns=1"], ["task.questions=3"]))
    assert given.path == plain.path and given.identity == plain.identity and "questions" not in plain.cfg.task
    assert many.path == plain.path.with_name(plain.path.name + ",questions=3") and many.task.questions == 3
    capsys.readouterr()
    assert sweep.main([*root, "task.turns=0"]) == 2
    err = refusal(capsys)
    assert len(err.splitlines()) == 1 and "task.turns=0: expected an int >= 1" in err


def test_the_page_tabulates_and_draws_accuracy_against_turn(tmp_path):
    from analysis.many_questions import page_lines

    def rec(policy, budget, accs):  # 2 contexts x 3 turns: turn k right in the first accs[k] * 2 contexts
        samples = [{"doc_id": c, "question": k, "turn": k, "acc": float(c < a * 2)}
                   for k, a in enumerate(accs) for c in range(2)]
        return {"policy": policy, "budget": budget, "mode": "turns", "protocol": {"turns": 3}, "turn_acc": accs,
                "samples": samples, "metrics": {"acc": sum(accs) / 3}, "kv_bytes_cut": 2**20}

    lines = page_lines([rec("full", 1.0, [1.0, 0.5, 0.5]), rec("h2o", 0.2, [0.5, 0.0, 0.0])], tmp_path, "fig")
    assert "| H2O | 20% | 0.50 | 0.00 | 0.00 |" in lines and "| full | 100% | 1.00 | 0.50 | 0.50 |" in lines
    assert "![accuracy against the turn](fig/many_questions_turns.png)" in lines
    assert (tmp_path / "many_questions_turns.png").stat().st_size > 5_000


def test_the_named_headline_heads_the_page(tmp_path):
    """study.yaml's ``headline`` for many questions: a − b paired by question at its budget, with its interval,
    verdict and reason; a missing record says so."""
    from analysis.many_questions import page_lines

    def rec(policy, budget, right):  # 4 contexts x 3 questions: the first ``right`` of 12 answered
        samples = [{"doc_id": c, "question": q, "acc": float(3 * c + q < right)} for c in range(4) for q in range(3)]
        return {"policy": policy, "budget": budget, "mode": "questions", "protocol": {"questions": 3},
                "samples": samples, "metrics": {"acc": right / 12}, "kv_bytes_cut": 2**20}

    named = {"a": "kvzip", "b": "keydiff", "budget": 0.2, "why": "Named first."}
    recs = [rec("full", 1.0, 12), rec("kvzip", 0.2, 9), rec("keydiff", 0.2, 3)]
    lines = page_lines(recs, tmp_path, "fig", named)
    # 6 of 12 questions differ (+1 each): mean 0.5, variance 3/11, se sqrt(3/11/12) = 0.1508, z 1.96; McNemar:
    # 6 discordant pairs all one way, p = 2 x 0.5^6 = 0.03125
    assert lines[0] == ("**Headline**: KVzip against KeyDiff at 20%, each context asked its questions "
                        "(`task.questions`), paired by question (KVzip − KeyDiff, difference in accuracy with its 95% "
                        "interval): +0.500 [+0.205, +0.795] over 12 questions, KVzip better at 95% (right with KVzip "
                        "alone on 6, with KeyDiff alone on 0: exact McNemar p = 0.031). Named first.")
    assert page_lines(recs[:2], tmp_path, "fig", named)[0].endswith(": not yet measured (a record is missing). "
                                                                     "Named first.")
    assert not page_lines(recs, tmp_path, "fig")[0].startswith("**Headline**")


def test_the_placement_pairs_each_question_inside_its_prompt_with_compressing_once(tmp_path):
    """study.yaml's ``placement``: a method's ``task.question=each`` record against its record compressed once, paired
    by question, named first, then a row per method with both; a record of either alone makes no row."""
    from analysis.many_questions import page_lines

    def rec(policy, mode, right, cpu):  # 2 contexts x 3 questions: the first ``right`` of 6 answered
        samples = [{"doc_id": c, "question": q, "acc": float(3 * c + q < right)} for c in range(2) for q in range(3)]
        return {"policy": policy, "budget": 0.2, "mode": mode, "protocol": {"questions": 3}, "samples": samples,
                "metrics": {"acc": right / 6}, "kv_bytes_cut": 2**20, "cpu_s": cpu}

    recs = [rec("snapkv", "questions", 0, 50), rec("snapkv", "each", 6, 140), rec("tova", "questions", 3, 60),
            rec("tova", "each", 3, 170), rec("h2o", "each", 1, 150)]
    lines = page_lines(recs, tmp_path, "fig", None, {"method": "snapkv", "budget": 0.2, "why": "Named first."})
    # all 6 differ by +1: mean 1, variance 0: the interval [1, 1]; McNemar 6 vs 0: p = 2 x 0.5^6
    assert lines[0].endswith("paired by question (each − once): +1.000 [+1.000, +1.000] over 6 questions, each better "
                             "at 95% (right with each alone on 6, with once alone on 0: exact McNemar p = 0.031). "
                             "Named first.")
    assert "| SnapKV | 20% | 0.00 [0.00, 0.39] | 1.00 [0.61, 1.00] | > +1.000 [+1.000, +1.000] | 50 / 140 |" in lines
    assert "| TOVA | 20% | 0.50 [0.19, 0.81] | 0.50 [0.19, 0.81] | ≈ +0.000 [+0.000, +0.000] | 60 / 170 |" in lines
    assert not any(line.startswith("| H2O | 20%") for line in lines)
    missing = page_lines(recs[2:], tmp_path, "fig", None, {"method": "snapkv", "budget": 0.2})
    assert missing[0].endswith("(each − once): not yet measured (a record is missing)")


@pytest.mark.parametrize("a_only, b_only", [(6, 0), (10, 2), (3, 3), (0, 7), (17, 1), (0, 0)])
def test_exact_mcnemar_equals_scipy_s_binomial_test(a_only, b_only):
    from scipy.stats import binomtest

    from analysis.estimate import mcnemar_exact

    want = binomtest(min(a_only, b_only), a_only + b_only, 0.5).pvalue if a_only + b_only else 1.0
    assert mcnemar_exact(a_only, b_only) == pytest.approx(want, rel=1e-12)
