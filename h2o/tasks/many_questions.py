"""Compress once, ask many: a context compressed once and asked several questions (``task.questions``), or asked
questions in turn on one cache (``task.turns``, SCBench's multi-turn protocol), on the needle task's contexts with
several needles (h2o.tasks.niah_many).

* ``questions=N``: the context alone is prefilled into the policy's evicting cache (its cut at the context's end
  under either timing: kvpress's query-agnostic protocol, as ``task.question=after``); each question is then
  answered from its own copy of that compressed cache (:func:`copy_of`), so no question sees another's tokens and
  the context is compressed once, whatever the number of questions.
* ``questions=N`` with ``task.question=each``: the question-aware protocol that compressing once gives up, beside
  it: for each question the context and that question are one prompt, prefilled into a fresh evicting cache and
  cut there (the question inside the compressed prompt, as ``task.question=prompt`` for one question), then the
  answer. The context is compressed N times; the tokens are those of ``questions=N`` (the context and each question
  encoded apart), so the two protocols differ only in where the question is. (``prompt`` and ``after`` both mean
  compressed once here: ``prompt``, the default, is what the committed records of ``questions=N`` ran with.)
* ``turns=N``: one cache for the whole conversation. Each turn feeds its question after what the cache holds (the
  previous turns' questions and answers included) and generates its answer into the cache; the policy's timing
  decides what later tokens do: ``compress=prefill`` cuts the context once and evicts nothing after it (the cache
  grows by each turn), ``compress=decode`` cuts each question's chunk back to the budget and evicts while
  decoding.

Tokens: the context is encoded once (BOS as the task's ``add_bos_token``), each question apart without special
tokens (kvpress encodes context and question apart; the needle task's question starts after a newline). Greedy,
at most the task's ``max_gen_toks``, stopped at the first newline (the needle task's lm-eval ``until``); scored as
the needle task scores (h2o.tasks.niah.found). One context at a time (batch 1), on the model's device.

Records: one sample per question (``doc_id`` the context, ``question`` its index, ``turn`` under ``turns``);
``info.contexts`` one row per context with the compressed context's KV (tokens, bytes held, bytes stored: stated
once, not per question) and its accuracy; under ``turns`` each question's row also has ``kv_tokens_turn_end`` (what
the cache held after its answer).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from h2o.core.attach import attach
from h2o.tasks.base import Result, cells, clamped, stderr
from h2o.tasks.kv_held import CUT, batch_fields

MODES = ("questions", "turns")


def copy_of(cache):
    """A copy of an evicting cache that shares nothing it changes (h2o.core.cache.EvictingCache.copy)."""
    return cache.copy()


def greedy(model, cache, ids: list[int], max_new: int, done: Callable[[list[int]], bool],
           fed: Callable[[], None] = lambda: None, step: Callable[[], None] = lambda: None) -> list[int]:
    """``ids`` fed after what ``cache`` holds (then ``fed()``), then up to ``max_new`` greedy tokens (stopped once
    ``done``); every generated token but the last is fed into the cache. ``step()`` is called before each token is
    chosen, on the cache it is predicted from (h2o.tasks.generation_rows.StepWatch's step)."""
    device = model.device
    logits = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True,
                   logits_to_keep=1).logits[0, -1]  # (V,)
    fed()
    out: list[int] = []
    while True:
        step()
        out.append(int(logits.argmax()))
        if len(out) >= max_new or done(out):
            return out
        logits = model(input_ids=torch.tensor([out[-1:]], device=device), cache=cache, use_cache=True).logits[0, -1]


def ask(model, policy, context: list[int], questions: list[list[int]], max_new: int, done: Callable,
        turns: bool = False, quant=None, each: bool = False, steps: list | None = None
        ) -> tuple[list[list[int]], dict, list[int]]:
    """The context compressed once, then each question: from a copy of the compressed cache, or (``turns``) in turn
    on the one cache; or (``each``) the context compressed with each question inside its prompt. Returns (each
    answer's tokens, the compressed context's footprint (EvictingCache.footprint; ``each``: the mean of its
    prompts'), the tokens held (token x KV head entries) after each answer). ``steps``: a list that gets, per
    question, the h2o.tasks.generation_rows.StepWatch of its steps (seconds since the question was fed, entries
    held)."""
    if each:
        return ask_each(model, policy, context, questions, max_new, done, quant)
    from h2o.tasks.generation_rows import StepWatch
    from h2o.tasks.kv_held import geometry

    answers, held = [], []
    with torch.no_grad(), attach(model, policy, mode="real", quant=quant) as h:
        base = h.new_cache()
        model(input_ids=torch.tensor([context], device=model.device), cache=base, use_cache=True, logits_to_keep=1)
        compressed = base.footprint()
        pending: list[int] = []  # turns: the last answer's last token, not yet in the cache
        for q in questions:
            if not turns:
                h.cache = copy_of(base)  # the attention function reads the attached cache
            if steps is not None:
                steps.append(StepWatch(h.cache, geometry(model)[1], time.perf_counter()))
            answers.append(greedy(model, h.cache, pending + q, max_new, done,
                                  step=steps[-1].note if steps is not None else lambda: None))
            pending = answers[-1][-1:] if turns else []
            held.append(h.cache.footprint()["tokens_held"])
    return answers, compressed, held


def ask_each(model, policy, context: list[int], questions: list[list[int]], max_new: int, done: Callable,
             quant=None) -> tuple[list[list[int]], dict, list[int]]:
    """:func:`ask` with ``each``: per question, the context and the question one prompt in a fresh cache."""
    answers, held, prints = [], [], []
    with torch.no_grad(), attach(model, policy, mode="real", quant=quant) as h:
        for q in questions:
            cache = h.new_cache()
            answers.append(greedy(model, cache, context + q, max_new, done, lambda: prints.append(cache.footprint())))
            held.append(cache.footprint()["tokens_held"])
    return answers, {k: sum(p[k] for p in prints) / len(prints) for k in prints[0]}, held


def stop_at(tok, until: str = "\n") -> Callable[[list[int]], bool]:
    return lambda out: until in tok.decode(out, skip_special_tokens=True)


def run(task, model, tok, policy, quant=None) -> Result:
    """The needle task (h2o.tasks.long_context.LongContextTask) with ``questions`` or ``turns`` above 1."""
    from h2o.tasks.niah import found
    from h2o.tasks.niah_many import contexts

    cpu0 = time.process_time()
    n = max(task.questions, task.turns)
    bos = task.add_bos(tok)
    docs = []
    for doc in contexts(tok, task.lengths, task.depths, task.samples, task.text, task.seed, n):
        docs.append({"context": tok(doc["prompt"], add_special_tokens=bos).input_ids,
                     "questions": [tok(q, add_special_tokens=False).input_ids for q in doc["questions"]],
                     "targets": doc["answers"], "fields": {k: doc[k] for k in ("length", "depth", "sample")},
                     "question_fields": [{"needle_depth": d} for d in doc["needle_depths"]]})
    result = answer_contexts(model, tok, policy, docs, "turns" if task.turns > 1 else "questions", task.gen_tokens,
                             stop_at(tok), lambda text, target: float(found(text, target)), quant,
                             cut=lambda text: text.split("\n")[0],
                             question="each" if task.question == "each" else "after")
    info = result.info
    result.info = {"headline": info.pop("headline"), "cells": cells(result.samples, True),
                   "lm_eval_task": task.lm_eval_task, "haystack": task.text, **info,
                   "cpu_s": round(time.process_time() - cpu0, 1)}
    return result


def answer_contexts(model, tok, policy, docs: list[dict], mode: str, max_new: int, done: Callable,
                    score: Callable[[str, object], float], quant=None,
                    cut: Callable[[str], str] = lambda text: text, question: str = "after") -> Result:
    """Each doc (``context``: its token ids; ``questions``: each question's ids; ``targets``: what each answer is
    scored against; ``fields`` and ``question_fields``: what its records carry) asked its questions by :func:`ask`
    under ``mode`` (questions | turns), each answer decoded up to ``done``, ``cut`` (niah: its first line) and scored
    by ``score(text, target)``; ``question``: after (compressed once) | each (:func:`ask_each`).
    The Result's info: the question mode, the contexts' rows with their compressed KV, and what was kept."""
    samples, rows, prints = [], [], []
    for c, doc in enumerate(tqdm(docs, desc=f"{mode} {policy.name}", unit="context", file=sys.stderr)):
        ctx, qs = doc["context"], doc["questions"]
        answers, compressed, held = ask(model, policy, ctx, qs, max_new, done, mode == "turns", quant,
                                        question == "each")
        scores = []
        for k, (q, answer) in enumerate(zip(qs, answers)):
            generation = cut(tok.decode(answer, skip_special_tokens=True))
            scores.append(score(generation, doc["targets"][k]))
            turn = {"turn": k, "kv_tokens_turn_end": held[k]} if mode == "turns" else {}
            extra = doc["question_fields"][k] if doc.get("question_fields") else {}
            samples.append({"doc_id": c, "question": k, **turn, **doc.get("fields", {}), **extra,
                            "context_tokens": len(ctx), "question_tokens": len(q), "target": doc["targets"][k],
                            "generation": generation, "acc": scores[-1]})
        prints.append((compressed, 1))
        rows.append({"doc_id": c, **doc.get("fields", {}), "context_tokens": len(ctx),
                     **{CUT[k]: compressed[k] for k in CUT}, "acc": sum(scores) / len(scores)})
    n = max(len(doc["questions"]) for doc in docs)
    accs = [s["acc"] for s in samples]
    held_ratio = (sum(r["kv_tokens_cut"] for r in rows) / (kv_entries_per_token(model) *
                                                            sum(r["context_tokens"] for r in rows)))
    info = {"headline": "acc", "question": question, mode: n, "contexts": rows, "kept_ratio": round(held_ratio, 4),
            "mean_prompt_tokens": round(sum(r["context_tokens"] for r in rows) / len(rows), 1),
            "clamped_requests": clamped(policy, [r["context_tokens"] for r in rows]),
            **batch_fields(prints, CUT, token_digits=1)}
    if mode == "turns":
        at = [[s["acc"] for s in samples if s["turn"] == k] for k in range(n)]  # contexts may have fewer turns
        info["turn_acc"] = [sum(a) / len(a) for a in at]
    return Result({"acc": sum(accs) / len(accs), "acc_stderr": stderr(accs)}, samples, info)


def kv_entries_per_token(model) -> int:
    """Token x KV head entries one token takes over all layers (every layer global)."""
    from h2o.tasks.kv_held import geometry

    layers, kv, _, _ = geometry(model)
    return layers * kv
