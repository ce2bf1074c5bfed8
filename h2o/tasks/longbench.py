"""LongBench through lm-eval 0.4.13's own ``longbench_*`` tasks (conf/task/longbench.yaml, experiment
longbench_cluster): the subset the field reports and what the time estimates need.

The field's KV-cache papers (SnapKV, PyramidKV, Ada-KV; KVCache-Factory's scripts) report LongBench's 16 English
tasks: single-document QA (NarrativeQA, Qasper, MultiFieldQA-en), multi-document QA (HotpotQA, 2WikiMultihopQA,
MuSiQue), summarization (GovReport, QMSum, MultiNews), few-shot (TREC, TriviaQA, SAMSum), synthetic
(PassageCount, PassageRetrieval-en) and code (LCC, RepoBench-P); the five Chinese tasks are left out. Prompts as
lm-eval builds them, no chat template; a prompt longer than the run's length less its generated tokens keeps its
first and last halves (LongBench's own truncation, h2o.tasks.lm_eval_model.H2OLM.truncate); each task's metric
(F1, ROUGE-L, accuracy, edit similarity) is lm-eval's per-sample ``score``. Data: the hub data set
``Xnhyacinth/LongBench`` (``make prefetch``); scoring needs ``jieba``, ``fuzzywuzzy`` and ``rouge`` (lm-eval's
``longbench`` extra, pinned in pyproject.toml).
"""
from __future__ import annotations

import re
from pathlib import Path

# lm-eval task -> (documents in LongBench's test split, average length in words: LongBench's paper, Table 1)
ENGLISH = {"longbench_narrativeqa": (200, 18409), "longbench_qasper": (200, 3619),
           "longbench_multifieldqa_en": (150, 4559), "longbench_hotpotqa": (200, 9151),
           "longbench_2wikimqa": (200, 4887), "longbench_musique": (200, 11214),
           "longbench_gov_report": (200, 8734), "longbench_qmsum": (200, 10614),
           "longbench_multi_news": (200, 2113), "longbench_trec": (200, 5177),
           "longbench_triviaqa": (200, 8209), "longbench_samsum": (200, 6258),
           "longbench_passage_count": (200, 11141), "longbench_passage_retrieval_en": (200, 9289),
           "longbench_lcc": (500, 1235), "longbench_repobench-p": (500, 4206)}
TOKENS_PER_WORD = 1.3  # English prose with a Llama-style tokenizer (an estimate's constant, not a measurement)


def folder() -> Path:
    """lm-eval's own ``longbench`` task folder."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "longbench"


def gen_tokens(task: str) -> int:
    """The task's own ``max_gen_toks`` (its lm-eval YAML: 32-512), read without loading it."""
    text = (folder() / f"{task.removeprefix('longbench_')}.yaml").read_text(encoding="utf-8")
    m = re.search(r"max_gen_toks:\s*(\d+)", text)
    return int(m.group(1)) if m else 128


def size(task: str, limit: int | None, length: int) -> int:
    """Prompt plus generated tokens of one run, estimated: ``limit`` docs (all without one) of the task's average
    length, each cut to ``length``."""
    docs, words = ENGLISH.get(task, (200, 8000))
    return min(limit or docs, docs) * min(int(words * TOKENS_PER_WORD) + gen_tokens(task), length)
