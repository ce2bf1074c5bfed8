"""Needle contexts asked several questions: one haystack holding ``n`` needles, one question per needle
(``task.questions`` / ``task.turns`` on the needle task; h2o.tasks.many_questions runs them).

A context of the needle task's (h2o.tasks.niah: its instruction, needle and question texts, its books) at cell
(length, depth, sample index) holds ``n`` needles with distinct keys: needle ``k`` at depth ``(depth + k / n) mod 1``
(needle 0 at the cell's depth; each moved to the nearest sentence end, the measured depth recorded), and its ``n``
questions ask them in that order. ``length`` counts the context and the first question (as the needle task counts
its prompt). Keys, numbers and the haystack's start are drawn from ``random.Random(f"{seed}/{L}/{depth}/{i}/{n}")``:
the contexts are a pure function of their arguments.

lm-eval's task ``niah`` reads its data through :func:`dataset`: h2o.tasks.niah's docs, or with ``questions`` /
``turns`` above 1 in its metadata one doc per (context, question) (:func:`lm_eval_docs`), which ``--model h2o``
with the same option answers from one compressed context (h2o.tasks.lm_eval_many).
"""
from __future__ import annotations

import random

from h2o.tasks.niah import (ADJECTIVES, INSTRUCTION, MIN_HAYSTACK, NEEDLE, NOUNS, QUESTION, haystack, insert_at,
                            load_tokenizer, splice)


def draw(length: int, depth: float, index: int, seed: int, n: int) -> tuple[random.Random, list[str], list[str]]:
    """(the context's generator, ``n`` distinct keys, ``n`` 7-digit numbers)."""
    rng = random.Random(f"{seed}/{length}/{depth}/{index}/{n}")
    pairs = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], n)
    return rng, pairs, [str(rng.randint(10**6, 10**7 - 1)) for _ in range(n)]


def depths_of(depth: float, n: int) -> list[float]:
    """Where the ``n`` needles go: the cell's depth, then evenly around the haystack from it."""
    return [depth] + [(depth + k / n) % 1.0 for k in range(1, n)]


def fixed_tokens(tok, keys: list[str], values: list[str]) -> int:
    """Tokens of the context's text that is not haystack (the instruction, needles, newline, first question)."""
    parts = (INSTRUCTION, *(NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)), "\n",
             QUESTION.format(key=keys[0]))
    return sum(len(tok(t, add_special_tokens=False).input_ids) for t in parts)


def shortest(tok, lengths, depths, samples: int, seed: int, n: int) -> tuple[int, int] | None:
    """(the first length too short for one of its contexts, the least it needs), or None when all fit."""
    for length in lengths:
        need = max(fixed_tokens(tok, *draw(int(length), float(d), i, seed, n)[1:])
                   for d in depths for i in range(int(samples)))
        if length <= need + MIN_HAYSTACK:
            return int(length), need + MIN_HAYSTACK + 1
    return None


def context(tok, words: str, length: int, depth: float, index: int, seed: int, n: int) -> dict:
    """One context: ``prompt`` (instruction, haystack with the needles, newline), ``questions``, ``answers``,
    ``keys``, ``needle_depths`` (measured), and what drew them."""
    rng, keys, values = draw(length, depth, index, seed, n)
    fixed = fixed_tokens(tok, keys, values)
    if length <= fixed + MIN_HAYSTACK:
        raise ValueError(f"length={length}: too short for {n} needles and a question ({fixed} tokens); "
                         f"allowed: > {fixed + MIN_HAYSTACK}")
    start = rng.randrange(max(1, len(words) - 10 * length))
    hay, offsets = haystack(tok, words, start, length - fixed)
    spots = [insert_at(hay, offsets, d) for d in depths_of(depth, n)]  # (character, measured depth) per needle
    for k in sorted(range(n), key=lambda k: (-spots[k][0], -k)):  # from the end, so earlier characters hold
        hay = splice(hay, spots[k][0], NEEDLE.format(key=keys[k], value=values[k]))
    return {"prompt": INSTRUCTION + hay + "\n", "questions": [QUESTION.format(key=k) for k in keys],
            "answers": values, "keys": keys, "needle_depths": [round(m, 4) for _, m in spots], "length": length,
            "depth": depth, "sample": index}


def contexts(tok, lengths, depths, samples: int, text: str, seed: int, n: int) -> list[dict]:
    """Every cell's contexts, lengths outer, then depths, then samples."""
    from h2o.tasks.niah import book

    words = book(text)
    return [{**context(tok, words, int(length), float(d), i, seed, n), "haystack": text}
            for length in lengths for d in depths for i in range(int(samples))]


def lm_eval_docs(tokenizer: str, lengths, depths, samples: int, text: str, seed: int, n: int) -> list[dict]:
    """lm-eval's ``niah`` docs with ``questions`` / ``turns`` = ``n`` in its metadata: one doc per (context, question),
    the context's questions in turn. Each doc is a niah doc (``prompt`` the shared context, ``question``, ``answer``,
    ``key``, ``needle_depth`` the measured depth of its needle, ``prompt_tokens`` of the context and that question)
    with ``context`` (the context's index) and ``question_index``."""
    tok = load_tokenizer(str(tokenizer))
    rows = []
    for c, doc in enumerate(contexts(tok, lengths, depths, samples, text, seed, n)):
        for k, question in enumerate(doc["questions"]):
            rows.append({"prompt": doc["prompt"], "question": question, "answer": doc["answers"][k],
                         "key": doc["keys"][k], "length": doc["length"], "depth": doc["depth"],
                         "needle_depth": doc["needle_depths"][k], "sample": doc["sample"],
                         "prompt_tokens": len(tok(doc["prompt"] + question, add_special_tokens=False).input_ids),
                         "haystack": text, "context": c, "question_index": k})
    return rows


def dataset(tokenizer: str | None = None, pretrained: str | None = None, lengths=(1024,),
            depths=(0.1, 0.5, 0.9), samples: int = 2, text: str = "austen", seed: int = 0, questions: int = 1,
            turns: int = 1, **other):
    """lm-eval's ``custom_dataset`` hook of task ``niah`` (tasks/niah.yaml): h2o.tasks.niah.dataset's docs, or with
    ``questions`` / ``turns`` above 1 in the metadata (``--model_args questions=K`` reaches here too: lm-eval merges
    the model's arguments into the metadata) :func:`lm_eval_docs` of that many questions per context."""
    import datasets

    from h2o.tasks import niah
    from h2o.tasks.question_after import check_many

    many = check_many(questions, turns, "niah metadata ")
    if not many:
        return niah.dataset(tokenizer, pretrained, lengths, depths, samples, text, seed, **other)
    rows = lm_eval_docs(niah.tokenizer_path(tokenizer, pretrained), lengths, depths, samples, text, seed, many[1])
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
