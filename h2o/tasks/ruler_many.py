"""RULER's multi-key and multi-query needle tasks asked one question per needle over a shared context: lm-eval tasks
``niah_multikey_1_questions`` and ``niah_multiquery_questions`` (tasks/niah_*_questions.yaml), for ``--model h2o``
with ``questions=K`` or ``turns=K`` (h2o.tasks.lm_eval_many).

    python -m h2o.tasks.lm_eval_cli --model h2o --tasks niah_multiquery_questions --include_path tasks \\
        --model_args pretrained=smollm2-135m,policy=snapkv,budget=0.2,questions=4 \\
        --metadata '{"max_seq_lengths": [1024]}'

Each of lm-eval's samples (lm-eval 0.4.13's ``niah_multikey_1`` / ``niah_multiquery``: four keys with one 7-digit
number each in an essay haystack, one key queried / all four) is split into up to K docs that share its context
(the input before RULER's question, h2o.tasks.question_after's pattern): doc ``j`` asks key ``j`` alone, the keys
the sample queries first, then the others in the order their needles stand, in RULER's one-key wording ("What is
the special magic number for <key> mentioned in the provided text?", and the answer prefix "The special magic
number for <key> mentioned in the provided text is"); its ``outputs`` are that key's numbers, scored as RULER scores
(``common_utils.process_results``: each number found in the answer). K is ``questions`` or ``turns`` from the
metadata (``--model_args`` reach it: lm-eval merges them in), else 1 (the first queried key). ``samples`` in the
metadata draws that many samples per length with lm-eval's generator (default: lm-eval's 500, slow on a CPU).

The haystack: the project's book as for every RULER essay task (h2o.tasks.ruler_offline; ``$H2O_RULER_HAYSTACK``,
installed here when no run installed one).
"""
from __future__ import annotations

import re

from h2o.tasks.ruler_offline import SPLIT_SOURCES as SOURCES  # split task -> its RULER source

NEEDLE = re.compile(r"One of the special magic (\w+) for (.+?) is: (.+?)\.")


def needles(context: str) -> tuple[str, dict[str, list[str]]]:
    """A RULER context -> (the kind of value, e.g. ``numbers``; {key: its values}, in the order they stand)."""
    found: dict[str, list[str]] = {}
    kind = "numbers"
    for m in NEEDLE.finditer(context):
        kind = m.group(1)
        found.setdefault(m.group(2), []).append(m.group(3))
    return kind, found


def split(doc: dict, k: int, context_index: int) -> list[dict]:
    """One RULER sample -> up to ``k`` docs sharing its context, one key each (see the module docstring)."""
    from h2o.tasks.question_after import RULER_QUESTION

    starts = [m.start() for m in RULER_QUESTION["niah"].finditer(doc["input"])]
    context = doc["input"][:starts[-1]]
    kind, found = needles(context)
    asked = [key for key, values in found.items() if set(values) <= set(doc["outputs"])]
    keys = asked + [key for key in found if key not in asked]
    rows = []
    for j, key in enumerate(keys[:k]):
        one = len(found[key]) == 1
        what = f"special magic {kind[:-1] if one else kind} for {key} mentioned in the provided text"
        rows.append({**doc, "input": context + (f"What is the {what}?" if one else f"What are all the {what}?"),
                     "outputs": found[key], "gen_prefix": f"The {what} {'is' if one else 'are'}",
                     "context": context_index, "question_index": j})
    return rows


def dataset(task: str, questions: int = 1, turns: int = 1, samples: int | None = None, **metadata):
    """The split docs of lm-eval's RULER task ``task`` (``niah_multikey_1`` | ``niah_multiquery``). ``samples``: the
    samples per length lm-eval's generator draws (None: lm-eval's task function, 500)."""
    import datasets

    from h2o.core.validate import check, is_int
    from h2o.tasks import ruler_offline
    from h2o.tasks.question_after import check_many

    many = check_many(questions, turns, "RULER metadata ")
    check(samples is None or (is_int(samples) and samples >= 1),
          f"RULER metadata samples={samples!r}: allowed: an int >= 1 (absent: lm-eval's 500)")
    if "haystack" not in ruler_offline._state:
        ruler_offline.from_env()  # before lm-eval's RULER modules import (offline: h2o.tasks.ruler_offline)
    from lm_eval.tasks.ruler import niah_utils

    base = getattr(niah_utils, task)(**metadata)["test"] if samples is None else drawn(task, samples, metadata)
    rows = [row for c, doc in enumerate(base) for row in split(doc, many[1] if many else 1, c)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def drawn(task: str, samples: int, metadata: dict) -> list[dict]:
    """lm-eval's RULER generator (``prepare_niah.generate_samples``) with ``task``'s settings (its ``niah_utils``
    function's, h2o.tasks.ruler_offline.NIAH_SHAPES), ``samples`` per length of ``max_seq_lengths``."""
    from lm_eval.tasks.ruler import niah_utils, prepare_niah
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS, get_tokenizer, resolve_tokenizer_name

    from h2o.tasks.ruler_offline import NIAH_SHAPES

    kind, key_type, value_type, keys, values, queries = NIAH_SHAPES[task]
    tok = get_tokenizer(resolve_tokenizer_name(metadata))
    return [row for seq in metadata.get("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
            for row in prepare_niah.generate_samples(
                niah_utils.get_haystack(type_haystack=kind), max_seq_length=seq, template=niah_utils.TEMPLATE,
                type_haystack=kind, type_needle_k=key_type, type_needle_v=value_type, num_needle_k=keys,
                num_needle_v=values, num_needle_q=queries, num_samples=samples, TOKENIZER=tok)]


def multikey_1(**metadata):
    """lm-eval's ``custom_dataset`` hook of ``niah_multikey_1_questions``."""
    return dataset("niah_multikey_1", **metadata)


def multiquery(**metadata):
    """lm-eval's ``custom_dataset`` hook of ``niah_multiquery_questions``."""
    return dataset("niah_multiquery", **metadata)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's scoring (lm-eval's ``common_utils.process_results``)."""
    from lm_eval.tasks.ruler.common_utils import process_results as ruler

    return ruler(doc, results)


def aggregate(scores: list[float]) -> float:
    """RULER's aggregation (lm-eval's ``common_utils.aggregate_metrics``: the mean over the samples of a length)."""
    from lm_eval.tasks.ruler.common_utils import aggregate_metrics

    return aggregate_metrics(scores)
