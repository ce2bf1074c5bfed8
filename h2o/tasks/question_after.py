"""The question inside or after the compressed prompt (``task.question``, lm-eval ``--model_args question=``).

* ``prompt`` (the default): a generation request's whole context -- the haystack and the question that ends it --
  is the prompt the policy compresses (its newest queries, which SnapKV and TOVA score from, are the question's).
* ``after``: kvpress's query-agnostic protocol (its ``KVPressTextGenerationPipeline``: the context is prefilled
  under the press, the question is fed after it, then the greedy answer). The context less the question is
  prefilled alone into the evicting cache, which keeps the policy's budget of it (a ratio of the context alone);
  then the question's tokens and the generated ones follow. Under ``compress=prefill`` the cut is at the context's
  end and nothing after it is evicted (the question is held whole, like a continuation); under ``compress=decode``
  the question goes through the evicting cache like any later tokens: one chunk that sees what is held and
  itself, then the cut back to the budget (the evicting cache's chunked prefill), then the budget held while the
  answer is generated.

Where the question is: the doc's ``question`` field when its text ends the request's context (our ``niah``);
else, for lm-eval's RULER tasks, whose docs hold one ``input`` string, the last match of kvpress's pattern for
the task's family (kvpress evaluation/benchmarks/ruler/create_huggingface_dataset.py splits RULER's inputs by
these same patterns) up to the end of the context, lm-eval's ``gen_prefix`` included (kvpress feeds its answer
prefix after the context too). A task with neither (LongBench) has no question to move.

Tokens: the request's context is encoded once, as lm-eval encodes it, and split before its last
``question_tokens`` tokens (:meth:`h2o.tasks.lm_eval_model.H2OLM.question_tokens`), so both options feed the same
tokens and at a 100% budget give the same generations; kvpress encodes context and question apart, which gives the
same tokens wherever the question starts after a newline (niah and every RULER template).
"""
from __future__ import annotations

import re

import torch

QUESTIONS = ("prompt", "after")


def check_many(questions, turns, prefix: str = "--model_args ") -> tuple[str, int] | None:
    """Questions per context after it (``--model_args questions=K`` / ``turns=K``, h2o.tasks.lm_eval_many; niah's
    metadata): ConfigError (one line) for a bad value -> ("questions" | "turns", K) when one is above 1, else None."""
    from h2o.core.validate import check, is_int

    for key, value in (("questions", questions), ("turns", turns)):
        check(is_int(value) and value >= 1, f"{prefix}{key}={value!r}: allowed: an int >= 1 (1: one question "
                                            f"per context)")
    check(min(questions, turns) == 1,
          f"{prefix}questions={questions},turns={turns}: allowed: one of them above 1")
    if max(questions, turns) == 1:
        return None
    return ("turns", turns) if turns > 1 else ("questions", questions)


def distinct_keys(task: str) -> int | None:
    """How many needles a context of lm-eval task ``task`` can hold, each with a key of its own (one question per
    needle): niah's keys drawn from its words, RULER's split tasks' 4; None: a task with one question a context."""
    from h2o.tasks.niah import ADJECTIVES, NOUNS
    from h2o.tasks.ruler_offline import NIAH_SHAPES, SPLIT_SOURCES as SOURCES

    if task == "niah":
        return len(ADJECTIVES) * len(NOUNS)
    return NIAH_SHAPES[SOURCES[task]][3] if task in SOURCES else None


def check_many_task(key: str, value: int, task: str, prefix: str = "--model_args ") -> None:
    """``questions`` / ``turns`` (``key``) above 1 on lm-eval task ``task``: ConfigError (one line) unless the task
    holds several questions a context (niah, RULER's split tasks) and ``value`` is within its distinct keys. One
    rule for h2o-run (``task.questions``) and the lm-eval wrapper (``--model_args questions=``)."""
    from h2o.core.validate import check
    from h2o.tasks.ruler_offline import SPLIT_SOURCES as SOURCES

    if value == 1:
        return
    keys = distinct_keys(task)
    check(keys is not None, f"{prefix}{key}={value}: several questions per context on task niah and RULER's split "
                            f"tasks ({', '.join(SOURCES)}) only; allowed: {prefix}{key}=1 for task {task}")
    check(value <= keys, f"{prefix}{key}={value}: more needles than task {task}'s {keys} distinct keys; allowed: "
                         f"{prefix}{key} in 1-{keys}")


# the start of the question in a RULER input, by task family (kvpress's QUESTION_PATTERNS)
RULER_QUESTION = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "ruler_vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "ruler_cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "ruler_fwe": re.compile(r"Question: Do not provide any explanation\."),
    "ruler_qa": re.compile(r"Answer the question based on the given documents\."),
}


def ruler_pattern(task: str | None) -> re.Pattern | None:
    """The question pattern of a RULER task (``niah_single_1``, ``ruler_vt``, ``ruler_qa_squad``, ...), or None."""
    return next((p for family, p in RULER_QUESTION.items() if (task or "").startswith(family)), None)


def question_of(context: str, doc: dict | None, task: str | None) -> str | None:
    """The question that ends ``context`` (see the module docstring), or None where none is known."""
    question = (doc or {}).get("question") if isinstance(doc, dict) else None
    if isinstance(question, str) and question and context.endswith(question):
        return question
    pattern = ruler_pattern(task)
    starts = [m.start() for m in pattern.finditer(context)] if pattern else []
    return context[starts[-1]:] if starts else None


def context_then_question(ids: torch.Tensor, mask: torch.Tensor, question: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded ids (B, T) and mask (B, T), and each row's question tokens (its last ones) -> (ids, mask) of
    (B, C + Q): each row's context left-padded to C (the longest context), then its question left-padded to Q
    (the longest question), and C. The pads between a short question and its context are masked out, so each
    token keeps its position (transformers counts positions over the mask) and the budget its real tokens."""
    lengths = mask.sum(-1).tolist()
    rows = [row[mask_row.bool()] for row, mask_row in zip(ids, mask)]
    C = max(n - q for n, q in zip(lengths, question))
    Q = max(question)
    out = ids.new_zeros((ids.shape[0], C + Q))
    valid = mask.new_zeros((ids.shape[0], C + Q))
    for i, (row, n, q) in enumerate(zip(rows, lengths, question)):
        out[i, C - (n - q):C], valid[i, C - (n - q):C] = row[:n - q], 1
        out[i, C + Q - q:], valid[i, C + Q - q:] = row[n - q:], 1
    return out, valid, C


def prefill(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> None:
    """The context (B, C) left-padded, through ``cache`` (positions counted over ``mask``, as generate counts
    them); only the last position's logits are computed (the next forward recomputes its own)."""
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, C)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
              logits_to_keep=1)
