"""The question inside or after the compressed prompt (``task.question``, ``--model_args question=``): with
``after`` the context alone is compressed, then the question is fed (kvpress's query-agnostic protocol), held
against a naive reference written by hand through the API, on the tiny random Llama (one token per byte)."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from h2o import attach, make_policy
from h2o.core.attach import Attached
from h2o.core.validate import BadInput
from h2o.tasks.lm_eval_model import H2OLM

HAY = ["The grass is green and the sky is blue. The code for the red door is 4821. Rain fell on the hills all day "
       "long, and the river ran high under the old stone bridge.\n",
       "Once there was a mill by a quiet stream. The code for the blue gate is 90317. The miller kept bees, and every "
       "summer the garden hummed from dawn until the light was gone.\n"]
QUESTIONS = ["What is the code for the red door? The code is", "What is the code for the blue gate? The code is"]
GEN = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
POLICIES = [("snapkv", {"window": 8}), ("h2o", {"compress": "decode"}), ("h2o", {"compress": "prefill"})]


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def requests(docs=None):
    docs = docs or [{"question": q} for q in QUESTIONS]
    return [Instance("generate_until", doc, (h + q, dict(GEN)), i, ("niah", i, 1))
            for i, (h, q, doc) in enumerate(zip(HAY, QUESTIONS, docs))]


def generate(model, tok, question, name, options, budget=0.3, caches=None, monkeypatch=None):
    """lm-eval's generation through ``--model h2o`` (one left-padded batch of both prompts); ``caches`` receives
    each evicting cache made."""
    if caches is not None:
        made = Attached.new_cache
        monkeypatch.setattr(Attached, "new_cache", lambda self, *a: caches.append(made(self, *a)) or caches[-1])
    lm = H2OLM(pretrained=model, tokenizer=tok, policy=name, budget=budget, batch_size=2, question=question,
               **options)
    return lm, lm.generate_until(requests())


def naive(model, tok, policy, *parts: str) -> str:
    """By hand: the first part through a fresh evicting cache (the policy cuts it at its end), then the next part
    (the question) in one forward, then greedy steps; cut at lm-eval's stop sequence."""
    out = []
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        for part in parts:
            logits = model(torch.tensor([tok.encode(part, add_special_tokens=False)]), cache=cache).logits[0, -1]
        for _ in range(GEN["max_gen_toks"]):
            out.append(int(logits.argmax()))
            if out[-1] == tok.eos_token_id:
                break
            logits = model(torch.tensor([[out[-1]]]), cache=cache).logits[0, -1]
    return tok.decode(out, skip_special_tokens=True).split(GEN["until"][0])[0]


@pytest.mark.parametrize("name, options", POLICIES[:1] + POLICIES[2:])
def test_after_prefill_holds_the_question_whole_and_the_budget_of_the_context(tiny, monkeypatch, name, options):
    model, tok = tiny
    caches = []
    lm, _ = generate(model, tok, "after", name, options, caches=caches, monkeypatch=monkeypatch)
    policy = lm.policy
    (cache,) = caches
    ctx = [len(h) for h in HAY]  # one token per byte
    budget = [int(policy.counts(torch.tensor([n])).total) for n in ctx]
    assert sorted(lm.budgets) == sorted(zip(ctx, budget)) and all(0 < k < 0.31 * n for k, n in zip(budget, ctx))
    assert [lm.question_tokens(h + q) for h, q in zip(HAY, QUESTIONS)] == [len(q) for q in QUESTIONS]
    order = sorted(range(2), key=lambda i: -len(HAY[i] + QUESTIONS[i]))  # lm-eval's batch: longest first
    for layer in cache.layers:
        for b, i in enumerate(order):
            pos = layer.pos[b]  # (Hkv, S) positions held (-1: empty or pad)
            for head in pos:
                held = set(head[head >= 0].tolist())
                assert len({p for p in held if p < ctx[i]}) == budget[i]  # the context: its own budget
                after = {p for p in held if p >= ctx[i]}  # the question and the answer: never evicted
                assert after == set(range(ctx[i], max(held) + 1)) and len(after) >= len(QUESTIONS[i])


@pytest.mark.parametrize("name, options", POLICIES + [("full", {})])
def test_a_full_budget_gives_the_same_generations_either_way(tiny, name, options):
    model, tok = tiny
    inside = generate(model, tok, "prompt", name, options, budget=1.0)[1]
    after = generate(model, tok, "after", name, options, budget=1.0)[1]
    assert inside == after and all(inside)


@pytest.mark.parametrize("name, options", POLICIES)
def test_after_equals_the_naive_reference_token_for_token(tiny, name, options):
    model, tok = tiny
    lm, gens = generate(model, tok, "after", name, options)
    ref = [naive(model, tok, lm.policy, h, q) for h, q in zip(HAY, QUESTIONS)]
    assert [tok.encode(g) for g in gens] == [tok.encode(r) for r in ref]
    inside = [naive(model, tok, lm.policy, h + q) for h, q in zip(HAY, QUESTIONS)]  # the whole prompt cut once
    assert generate(model, tok, "prompt", name, options)[1] == inside  # question=prompt: today's path
    assert gens != inside  # where the question sits changes what is held, and here what is generated


def ruler_templates() -> dict[str, str]:
    """lm-eval's own RULER prompt templates, read from its source (importing those modules costs ~15 s)."""
    import ast

    from h2o.tasks.long_context import ruler_folder

    out = {}
    for name in ("niah_utils", "qa_utils"):
        for node in ast.parse((ruler_folder() / f"{name}.py").read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("TEMPLATE", "CONFIG"):
                value = ast.literal_eval(node.value) if not isinstance(node.value, ast.Subscript) else None
                out.setdefault(name, value["template"] if isinstance(value, dict) else value)
    return out


def test_ruler_questions_split_as_kvpress_splits_them():
    """lm-eval's own RULER templates: the question starts at kvpress's pattern (its last match) and runs to the
    end of the request, lm-eval's gen_prefix included."""
    from h2o.tasks.question_after import question_of

    templates = ruler_templates()
    niah = templates["niah_utils"].format(type_needle_v="numbers", context="What is the special magic hay.",
                                          query="long-bridge") + " The special magic number for long-bridge is"
    q = question_of(niah, {"input": niah}, "niah_single_2")
    assert q.startswith("What are all the special magic numbers for long-bridge") and niah.endswith(q)
    qa = templates["qa_utils"].format(context="Document 1: ...", query="Who wrote it?") + " Answer:"
    assert question_of(qa, {}, "ruler_qa_squad").startswith("Answer the question based on the given documents.")
    assert question_of(qa, {}, "ruler_qa_squad").endswith("Question: Who wrote it? Answer:")
    assert question_of("no question here", {}, "longbench_narrativeqa") is None


def test_bad_values_are_refused_in_one_line(tiny):
    from h2o.tasks.long_context import LongContextTask

    with pytest.raises(BadInput, match=r"^task.question='later': allowed: prompt, after "
                                       r"\(each: with task.questions > 1 on niah\)$"):
        LongContextTask("niah", question="later")
    with pytest.raises(BadInput, match="task longbench_narrativeqa's prompts hold no question to split off; "
                                       "allowed: question=prompt"):
        LongContextTask("lb", "longbench_narrativeqa", lengths=[8192], question="after")
    assert LongContextTask("r", "ruler_vt", question="after").question == "after"  # RULER: split by kvpress's rule
    model, tok = tiny
    with pytest.raises(BadInput, match=r"^question='later': allowed: prompt, after$"):
        H2OLM(pretrained=model, tokenizer=tok, question="later")
    lm = H2OLM(pretrained=model, tokenizer=tok, question="after", batch_size=2)
    with pytest.raises(BadInput, match="request 0 has no question to put after the compressed context"):
        lm.generate_until(requests([{}, {}]))


def test_the_default_keeps_every_folder_and_after_names_itself(hydra_ctx, tmp_path, capsys):
    """Hydra: ``task.question=prompt`` (given or not, on any task) is today's run: its folder, config and identity;
    ``after`` adds ``question=after`` to the folder; a bad value exits 2 in one line before anything loads."""
    from h2o.pipeline import sweep
    from h2o.pipeline.spec import prepare
    from h2o.pipeline.sweep import _compose

    root = ["model=tiny-llama", "task=niah", "task.lengths=[512]", f"runs_dir={tmp_path}"]
    plain, given, after = (prepare(_compose(root + extra)) for extra in
                           ([], ["task.question=prompt"], ["task.question=after"]))
    assert given.path == plain.path and given.identity == plain.identity and "question" not in plain.cfg.task
    assert after.path == plain.path.with_name(plain.path.name + ",question=after")
    assert after.identity["task"]["question"] == "after" and after.task.question == "after"
    ppl = ["model=tiny-llama", "task=austen_ppl", f"runs_dir={tmp_path}"]
    assert prepare(_compose([*ppl, "++task.question=prompt"])).path == prepare(_compose(ppl)).path
    with pytest.raises(BadInput, match=r"^grid_only=\[1\]: expected \[\{when: "):
        prepare(_compose([*root, "grid_only=[1]"]))
    capsys.readouterr()
    assert sweep.main([*root, "task.question=later"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "task.question='later': allowed: prompt, after" in err


def test_the_needle_task_records_the_question_after(tiny):
    """h2o.tasks.long_context through lm-eval: the record names the option, each sample its question's tokens, and
    the budget is a ratio of the context alone."""
    from h2o.tasks.long_context import LongContextTask

    model, tok = tiny
    task = LongContextTask("niah", lengths=[512], depths=[0.5], samples=2, question="after", batch_size=2)
    result = task.run(model, tok, make_policy("snapkv", budget=0.3, window=8), "real", 0)
    assert result.info["question"] == "after" and task.protocol(tok)["question"] == "after"
    assert all(s["question_tokens"] > 0 for s in result.samples) and len(result.samples) == 2
    context = sum(s["prompt_tokens"] - s["question_tokens"] for s in result.samples) / 2
    assert result.info["mean_prompt_tokens"] == pytest.approx(context, abs=1)  # the compressed prompt: the context
    assert result.info["kept_ratio"] == pytest.approx(0.3, abs=0.01)
    assert "question" not in LongContextTask("niah").protocol(tok)  # the default: every older record's protocol
