"""Offline tasks: BIG-bench examples converted to lm-eval-ready JSONL, and the hooks lm-eval calls.

    <cache>/lm_eval/v1/<source>/<task>/{train,test}.jsonl   converted multiple-choice and XSUM tasks

``<source>`` is the first 16 hex digits of the BIG-bench files' digest (:func:`h2o.assets.fetch.bigbench_digest`),
so conversions of different files (the real ones, the test suite's stand-ins) never stand in for each other.

Splits are deterministic: groups of related examples (the same event pair, the same premise, the same Winograd
sentence) are shuffled with ``random.Random(SPLIT_SEED)`` and the first ``n_train`` groups form the ``train``
split (the few-shot pool), the rest ``test``; within a split the original BIG-bench order is kept. See ``TASKS``
for the sizes. ``python -m h2o.assets.data`` fetches every source (:mod:`h2o.assets.fetch`) and writes every task.
"""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable

from h2o.assets.fetch import (FetchError, bigbench_digest, bigbench_dir, bigbench_task, fetch_austen,
                              fetch_moby_dick)
from h2o.assets.paths import cache_dir
from h2o.store.files import atomic_write_text

SPLIT_SEED = 1234
LM_EVAL_FORMAT = "v1"  # bump when the JSONL layout changes: old files are then ignored


# --------------------------------------------------------------------------------------------
# Converters: BIG-bench -> lm-eval JSONL
# --------------------------------------------------------------------------------------------
# Multiple-choice rows: {"id", "query", "choices", "gold", "source"}; lm-eval scores
# `query + " " + choices[i]`. XSUM rows: {"id", "document", "summary", "article"} where "article"
# is the document cut to 512 words (HELM's doc_max_length).


def _gold(scores: dict[str, float]) -> int:
    values = list(scores.values())
    return values.index(max(values))


def _choice_lines(choices: list[str]) -> str:
    return "".join(f"\nchoice: {c}" for c in choices)


def convert_copa() -> list[dict]:
    """COPA-like: ``cause_and_effect`` one_sentence + two_sentences (51 event pairs, 102 rows).

    BIG-bench lists the right answer first; we swap the two choices on odd pairs so the gold index
    alternates 0/1. The group key is the pair index, so both phrasings of a pair share a split.
    """
    prompts = {
        "one_sentence": "Which of the following sentences makes more sense?",
        "two_sentences": "Two events are given. Which event caused the other?",
    }
    rows = []
    for sub, question in prompts.items():
        for i, ex in enumerate(bigbench_task(f"cause_and_effect/{sub}")["examples"]):
            choices = list(ex["target_scores"])
            gold = _gold(ex["target_scores"])
            if i % 2:
                choices.reverse()
                gold = len(choices) - 1 - gold
            rows.append({"id": f"{sub}-{i}", "group": f"pair-{i}",
                         "query": f"{question}{_choice_lines(choices)}\nAnswer:",
                         "choices": choices, "gold": gold, "source": f"bigbench/cause_and_effect/{sub}"})
    return rows


def _plain_mc(task: str, template: str, group: Callable[[dict, int], str] | None = None) -> list[dict]:
    rows = []
    for i, ex in enumerate(bigbench_task(task)["examples"]):
        rows.append({"id": f"{task.replace('/', '-')}-{i}", "group": group(ex, i) if group else str(i),
                     "query": template.format(input=ex["input"].strip()),
                     "choices": list(ex["target_scores"]), "gold": _gold(ex["target_scores"]),
                     "source": f"bigbench/{task}"})
    return rows


def convert_mathqa() -> list[dict]:
    """MathQA-like: ``elementary_math_qa/question_only`` (7,688 word problems, 3-10 numeric choices)."""
    return _plain_mc("elementary_math_qa/question_only", "Question: {input}\nAnswer:")


def convert_piqa() -> list[dict]:
    """PiQA-like: ``physical_intuition`` (81 questions, 2-5 choices), lm-eval's PiQA prompt."""
    return _plain_mc("physical_intuition", "Question: {input}\nAnswer:")


_NLI_RE = re.compile(r"Sentence 1:(.*)\nSentence 2:(.*)\n\nThe answer is:\s*$", re.S)
_NLI_LABELS = {"entailment": "True", "neutral": "Neither", "contradiction": "False"}


def convert_entailment() -> list[dict]:
    """Entailment: ``presuppositions_as_nli`` (735 pairs, 3-way) in lm-eval's CommitmentBank prompt.

    ``{premise}\\nQuestion: {hypothesis} True, False or Neither?\\nAnswer:`` with choices
    True/Neither/False (entailment/neutral/contradiction). Grouped by BIG-bench's ``example_id``.
    """
    rows = []
    for i, ex in enumerate(bigbench_task("presuppositions_as_nli")["examples"]):
        m = _NLI_RE.match(ex["input"])
        if not m:
            raise ValueError(f"presuppositions_as_nli example {i} has an unexpected layout")
        premise, hypothesis = (s.strip() for s in m.groups())
        labels = list(ex["target_scores"])
        rows.append({"id": f"presuppositions_as_nli-{i}", "group": str(ex["comment"]["example_id"]),
                     "query": f"{premise}\nQuestion: {hypothesis} True, False or Neither?\nAnswer:",
                     "choices": [_NLI_LABELS[label] for label in labels],
                     "gold": _gold(ex["target_scores"]), "source": "bigbench/presuppositions_as_nli"})
    return rows


_ENTAIL_RE = re.compile(r"(.*?\.)\s+(?:So|Therefore),?\s+(.*)$", re.S)


def convert_analytic_entailment() -> list[dict]:
    """RTE-like, 2-way: ``analytic_entailment`` (70 pairs) in lm-eval's RTE prompt (True/False)."""
    rows = []
    for i, ex in enumerate(bigbench_task("analytic_entailment")["examples"]):
        m = _ENTAIL_RE.match(ex["input"].strip())
        if not m:
            raise ValueError(f"analytic_entailment example {i} has an unexpected layout")
        first, second = m.group(1), m.group(2)
        labels = {"entailment": "True", "no-entailment": "False"}
        rows.append({"id": f"analytic_entailment-{i}", "group": str(i),
                     "query": f"{first}\nQuestion: {second[:1].upper() + second[1:]} True or False?\nAnswer:",
                     "choices": [labels[k] for k in ex["target_scores"]], "gold": _gold(ex["target_scores"]),
                     "source": "bigbench/analytic_entailment"})
    return rows


def convert_winowhy() -> list[dict]:
    """Winograd-like: ``winowhy`` (2,865 reasons for 271 schema sentences): is the reasoning correct?"""
    return _plain_mc("winowhy", "{input}\nThe above reasoning is",
                     group=lambda ex, i: ex["input"].split(" The '")[0])


def convert_xsum() -> list[dict]:
    """XSUM: ``gem/xsum`` (1,001 BBC articles with their reference one-sentence summaries)."""
    rows = []
    for i, ex in enumerate(bigbench_task("gem/xsum")["examples"]):
        document = ex["input"].strip()
        words = document.split()
        rows.append({"id": ex.get("comment") or f"xsum-{i}", "group": str(i), "document": document,
                     "summary": ex["target"].strip(), "article": " ".join(words[:512])})
    return rows


#: lm-eval task name -> (converter, number of train groups; the rest is test).
TASKS: dict[str, tuple[Callable[[], list[dict]], int]] = {
    "bb_copa": (convert_copa, 10),  # 20 train / 82 test rows
    "bb_mathqa": (convert_mathqa, 100),  # 100 / 7,588
    "bb_piqa": (convert_piqa, 10),  # 10 / 71
    "bb_entailment": (convert_entailment, 20),  # 20 premises (~75 rows) / rest of 735
    "bb_analytic_entailment": (convert_analytic_entailment, 10),  # 10 / 60
    "bb_winowhy": (convert_winowhy, 27),  # 27 sentences (~280 rows) / rest of 2,865
    "bb_xsum": (convert_xsum, 100),  # 100 / 901
}


def split_rows(rows: list[dict], n_train_groups: int, seed: int = SPLIT_SEED) -> dict[str, list[dict]]:
    """Deterministic group split: shuffle the distinct groups with ``seed``, the first ``n`` are train.

    Rows keep their original order inside each split; rows of one group never straddle splits.
    """
    groups = list(dict.fromkeys(r["group"] for r in rows))
    random.Random(seed).shuffle(groups)
    train = set(groups[:n_train_groups])
    return {"train": [r for r in rows if r["group"] in train], "test": [r for r in rows if r["group"] not in train]}


def _task_dir(task: str) -> Path:
    return cache_dir() / "lm_eval" / LM_EVAL_FORMAT / bigbench_digest()[:16] / task


def write_task(task: str, force: bool = False) -> Path:
    """Convert one task of ``TASKS`` to ``<cache>/lm_eval/v1/<source>/<task>/{train,test}.jsonl``."""
    if task not in TASKS:
        raise ValueError(f"unknown offline task {task!r}; available: {', '.join(TASKS)}")
    folder = _task_dir(task)
    if (folder / "test.jsonl").exists() and not force:
        return folder
    converter, n_train = TASKS[task]
    for split, rows in split_rows(converter(), n_train).items():
        atomic_write_text(folder / f"{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return folder


def task_rows(task: str, split: str = "test") -> list[dict]:
    """The rows of one split (``train`` or ``test``) of an offline task, converting on first use."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    path = write_task(task) / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def lm_eval_dataset(task: str, **_metadata: Any):
    """A ``datasets.DatasetDict`` (train, test) for an offline task: lm-eval's ``custom_dataset`` hook.

    lm-eval calls it as ``custom_dataset(**metadata, **dataset_kwargs)``; the YAML passes
    ``dataset_kwargs: {task: bb_copa}`` and anything else (model metadata) is ignored.
    """
    import datasets

    return datasets.DatasetDict({s: datasets.Dataset.from_list(task_rows(task, s)) for s in ("train", "test")})


def xsum_examples(split: str = "test") -> list[dict]:
    """XSUM rows ``{"id", "document", "summary", "article"}``: ``train`` (100, the in-context pool),
    ``test`` (901) or ``all`` (1,001, BIG-bench order). ``article`` is ``document`` cut to 512 words."""
    if split == "all":
        return sorted(task_rows("bb_xsum", "train") + task_rows("bb_xsum", "test"), key=lambda r: int(r["group"]))
    return task_rows("bb_xsum", split)


def xsum_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` for ``bb_xsum``: ROUGE-1/2/L F1 (stemmed, as HELM) of the generation."""
    from h2o.cli.process import rouge_scorer

    scorer = rouge_scorer().RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    prediction = results[0].split("###")[0].strip()
    scores = scorer.score(doc["summary"], prediction)
    return {k: v.fmeasure for k, v in scores.items()}


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------


def fetch_all(force: bool = False, moby: bool = True) -> dict[str, Path]:
    """Find the BIG-bench files (:func:`h2o.assets.fetch.bigbench_dir`), fetch the Austen novels (and Moby-Dick)
    and write every lm-eval task."""
    out = {"austen": fetch_austen(force)}  # the books first: a missing BIG-bench folder leaves them fetched
    if moby:
        out["moby_dick"] = fetch_moby_dick(force)
    out["bigbench"] = bigbench_dir()
    for task in TASKS:
        out[task] = write_task(task, force)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m h2o.assets.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    parser.add_argument("--no-moby", action="store_true", help="skip Moby-Dick")
    from h2o.cli.args import one_line

    args = one_line(parser).parse_args(argv)
    try:
        paths = fetch_all(force=args.force, moby=not args.no_moby)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"cache: {cache_dir()}")
    for name, path in paths.items():
        print(f"  {name:24s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
