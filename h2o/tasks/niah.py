"""Needle in a haystack as the field draws it: the dataset and the scoring of lm-eval task ``niah`` (tasks/niah.yaml).

One sample per (context length, needle depth, sample index): a RULER-style needle, "One of the special magic
numbers for <key> is: <7-digit number>.", is put at an explicit depth of a haystack cut from one of the project's
public-domain books (h2o.assets.fetch: Austen's six novels or Moby-Dick), and the question ends the prompt::

    prompt   = "Some special magic numbers are hidden within the following text. ... afterwards.\\n"
               + haystack[:depth] + " " + needle + " " + haystack[depth:] + "\\n"
    question = "What is the special magic number for <key> mentioned in the provided text? "
               "The special magic number for <key> mentioned in the provided text is"

The task's context is ``prompt + question`` (a doc's ``question`` field is what ends it: the seam a prefill-time
compression reads, h2o.tasks.lm_eval_model.H2OLM.question_tokens). Greedy answer; ``exact_match`` is 1 when the
first run of digits of the generation is the number.

Lengths are prompt tokens of the model's tokenizer: the haystack is the book's tokens from a sentence start, as
many as bring the prompt to ``length`` (the needle and the words around it can merge at the seams: the measured
``prompt_tokens`` is in each doc). Depth is where the needle starts, as a fraction of the haystack's tokens, moved
to the nearest sentence end (the measured depth is recorded). The haystack of sample ``i`` at length ``L`` is the
same at every depth (only the needle moves; its last tokens vary with the needle's length); keys and numbers are
drawn per sample with ``random.Random(f"{seed}/{L}/{depth}/{i}")``, the haystack's start with
``random.Random(f"{seed}/{L}/{i}")``: the data set is a pure function of its arguments.

lm-eval passes the task's ``metadata`` as keyword arguments (TaskManager(metadata=...), ``--metadata`` on the
CLI): ``tokenizer`` (a path; or ``pretrained``, as RULER's tasks take it), ``lengths``, ``depths``, ``samples``
(per cell), ``text`` (austen | moby_dick) and ``seed``.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache

INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")
ADJECTIVES = ("ancient", "bitter", "brave", "calm", "clever", "crooked", "dusty", "eager", "faint", "gentle",
              "hollow", "humble", "icy", "jolly", "lively", "lonely", "mellow", "nimble", "proud", "quiet",
              "rapid", "rusty", "shiny", "silent", "tender", "vivid", "wicked", "young")
NOUNS = ("anchor", "badger", "barrel", "candle", "castle", "cellar", "compass", "falcon", "garden", "harbor",
         "kettle", "lantern", "meadow", "mirror", "orchard", "parcel", "pebble", "quill", "saddle", "teapot",
         "thimble", "tower", "valley", "violin", "wagon", "willow")
TEXTS = ("austen", "moby_dick")
SENTENCE_END = re.compile(r"(?<!\bMr)(?<!\bMrs)(?<!\bMs)(?<!\bDr)(?<!\bSt)[.!?][\"')\]]*\s")  # not "Mrs. "
DIGITS = re.compile(r"\d+")


def book(text: str) -> str:
    """The book's text, whitespace runs made one space (a haystack is prose, not the book's line layout)."""
    from h2o.assets.fetch import austen_text, moby_dick

    if text not in TEXTS:
        raise ValueError(f"text={text!r}: allowed: {', '.join(TEXTS)}")
    return re.sub(r"\s+", " ", austen_text() if text == "austen" else moby_dick())


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from h2o.assets.model_spec import resolve_pretrained

    return AutoTokenizer.from_pretrained(resolve_pretrained(path))


def haystack(tok, words: str, start: int, n_tokens: int) -> tuple[str, list[tuple[int, int]]]:
    """``n_tokens`` tokens of ``words`` from the first sentence start at or after character ``start``: the text and
    each token's (start, end) characters in it."""
    m = SENTENCE_END.search(words, start)
    begin = m.end() if m else 0
    chunk = words[begin:begin + 8 * n_tokens + 64]  # > n_tokens tokens for any subword tokenizer
    enc = tok(chunk, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"][:n_tokens]
    if len(offsets) < n_tokens:
        raise ValueError(f"the book has fewer than {n_tokens} tokens after character {begin}")
    return chunk[:offsets[-1][1]], offsets


def insert_at(text: str, offsets: list[tuple[int, int]], depth: float) -> tuple[int, float]:
    """(character where the needle goes, measured depth): the sentence end nearest to token ``depth * len(offsets)``
    (the token boundary itself when the haystack has none), as a fraction of the tokens before it (0: before the
    first token, 1: after the last)."""
    n = len(offsets)
    k = min(int(round(depth * n)), n)
    if k in (0, n):
        return (0, 0.0) if k == 0 else (len(text), 1.0)
    target = offsets[k][0]
    ends = [m.start() + 1 for m in SENTENCE_END.finditer(text)]  # just after each sentence's punctuation
    at = min(ends, key=lambda e: abs(e - target)) if ends else target
    return at, sum(1 for start, _ in offsets if start < at) / n


def splice(hay: str, at: int, needle: str) -> str:
    """The haystack with the needle at character ``at``, one space on each side."""
    return " ".join(part for part in (hay[:at].strip(), needle, hay[at:].strip()) if part)


MIN_HAYSTACK = 8  # tokens of book a prompt holds at least beside its fixed text


def draw(length: int, depth: float, index: int, seed: int) -> tuple[str, str]:
    """(key, 7-digit number) of the doc at (length, depth, sample index)."""
    rng = random.Random(f"{seed}/{length}/{depth}/{index}")
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}", str(rng.randint(10**6, 10**7 - 1))


def fixed_tokens(tok, key: str, value: str) -> int:
    """Tokens of a prompt's text that is not haystack: the instruction, the needle, the newline, the question."""
    parts = (INSTRUCTION, NEEDLE.format(key=key, value=value), "\n", QUESTION.format(key=key))
    return sum(len(tok(t, add_special_tokens=False).input_ids) for t in parts)


def shortest(tok, lengths, depths, samples: int, seed: int = 0) -> tuple[int, int] | None:
    """(the first length too short for one of its docs, the least length that doc needs), or None when every
    length holds each of its docs' fixed text and MIN_HAYSTACK tokens of book. Cheap: tokenizes the short parts."""
    for n in lengths:
        need = max(fixed_tokens(tok, *draw(int(n), float(d), i, seed)) for d in depths for i in range(int(samples)))
        if n <= need + MIN_HAYSTACK:
            return int(n), need + MIN_HAYSTACK + 1
    return None


def sample(tok, words: str, length: int, depth: float, index: int, seed: int) -> dict:
    """One doc: ``prompt``, ``question``, ``answer`` and what drew them (length, depth, measured depth, tokens)."""
    key, value = draw(length, depth, index, seed)
    needle, question = NEEDLE.format(key=key, value=value), QUESTION.format(key=key)
    fixed = fixed_tokens(tok, key, value)
    if length <= fixed + MIN_HAYSTACK:
        raise ValueError(f"length={length}: too short for a needle and its question ({fixed} tokens); "
                         f"allowed: > {fixed + MIN_HAYSTACK}")
    start = random.Random(f"{seed}/{length}/{index}").randrange(max(1, len(words) - 10 * length))
    hay, offsets = haystack(tok, words, start, length - fixed)
    at, measured = insert_at(hay, offsets, depth)
    prompt = INSTRUCTION + splice(hay, at, needle) + "\n"
    return {"prompt": prompt, "question": question, "answer": value, "key": key, "length": length,
            "depth": depth, "needle_depth": round(measured, 4), "sample": index,
            "prompt_tokens": len(tok(prompt + question, add_special_tokens=False).input_ids)}


def docs(tokenizer: str, lengths, depths, samples: int, text: str = "austen", seed: int = 0) -> list[dict]:
    """Every cell's docs, lengths outer, then depths, then samples."""
    tok = load_tokenizer(str(tokenizer))
    words = book(text)
    return [{**sample(tok, words, int(n), float(d), i, seed), "haystack": text}
            for n in lengths for d in depths for i in range(int(samples))]


def dataset(tokenizer: str | None = None, pretrained: str | None = None, lengths=(1024,),
            depths=(0.1, 0.5, 0.9), samples: int = 2, text: str = "austen", seed: int = 0, **_other):
    """lm-eval's ``custom_dataset`` hook: a DatasetDict with the ``test`` split (other metadata is ignored)."""
    import datasets

    rows = docs(tokenizer_path(tokenizer, pretrained), lengths, depths, samples, text, seed)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def tokenizer_path(tokenizer: str | None, pretrained: str | None) -> str:
    """The metadata's ``tokenizer`` (else ``pretrained``); ValueError (one line) when neither is a path."""
    path = tokenizer or pretrained
    if not isinstance(path, str) or not path:
        raise ValueError("task niah needs the tokenizer: --metadata '{\"tokenizer\": \"<path>\"}' or "
                         "--model_args pretrained=<path>")
    return path


def found(generation: str, answer: str) -> bool:
    """Exact match: the first run of digits in the generation is the number."""
    m = DIGITS.search(generation)
    return m is not None and m.group() == answer


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: ``exact_match`` of the greedy generation."""
    return {"exact_match": float(found(results[0], doc["answer"]))}
