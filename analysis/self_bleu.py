"""Self-BLEU (diversity of a set of generations; lower = more diverse), as in Texygen.

Texygen (Zhu et al. 2018, ``utils/metrics/SelfBleu.py``, the parallel/fast path) scores each
generation as the hypothesis against *all the other* generations as references and averages:

    self_bleu = mean_i  nltk.translate.bleu_score.sentence_bleu(
        references=[g_j for j != i], hypothesis=g_i,
        weights=(0.25, 0.25, 0.25, 0.25),                 # BLEU-4, uniform weights
        smoothing_function=SmoothingFunction().method1)    # epsilon 0.1 on zero n-gram counts

Differences from Texygen, stated: Texygen's class defaults to ``gram=3``; the H2O appendix
reports BLEU-4, so ``max_n=4`` here (pass ``max_n=3`` for Texygen's default). Texygen tokenizes
with ``nltk.word_tokenize`` (needs the ``punkt`` data, not installed); here a generation is
lowercased and split on whitespace. nltk's sentence_bleu returns 0 when no unigram matches,
and the brevity penalty uses the reference length closest to the hypothesis length.
The paper (appendix C.1, LLaMA-7B, 100 XSUM prompts): full 0.0057, H2O 0.0051, local 0.0436.
"""
from __future__ import annotations

import numpy as np


def tokenize(text: str) -> list[str]:
    return str(text).lower().split()


def self_bleu_scores(generations: list[str], max_n: int = 4) -> list[float]:
    """BLEU-``max_n`` of each generation against all the others (needs >= 2)."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu  # slow import: lazy
    tokens = [tokenize(g) for g in generations]
    if len(tokens) < 2:
        raise ValueError("Self-BLEU needs at least two generations")
    weights = (1.0 / max_n,) * max_n
    smooth = SmoothingFunction().method1
    return [sentence_bleu(tokens[:i] + tokens[i + 1:], hyp, weights=weights,
                          smoothing_function=smooth) for i, hyp in enumerate(tokens)]


def self_bleu(generations: list[str], max_n: int = 4) -> float:
    """Mean BLEU-``max_n`` of each generation against all the others (needs >= 2)."""
    scores = self_bleu_scores(generations, max_n)
    return sum(scores) / len(scores)


def add_self_bleu(df, experiment: str = "self_bleu", limit: int = 100):
    """Copy of ``df`` with ``self_bleu``, ``self_bleu_stderr`` (of the per-generation scores) and
    ``self_bleu_n`` columns, filled for the summarization runs of ``experiment`` only (a HELM run's
    generations never enter): Self-BLEU of the first ``limit`` generations of the run's
    samples.jsonl (the paper used 100 prompts) and how many were scored."""
    from analysis.records import load_samples
    cols = ["self_bleu", "self_bleu_stderr", "self_bleu_n"]
    df = df.assign(**{c: float("nan") for c in cols})
    todo = df[(df["task_kind"] == "summarization") & (df["experiment"] == experiment)]
    for idx, path in todo["path"].items():
        gens = [s["generation"] for s in load_samples(path) if "generation" in s][:limit]
        if len(gens) >= 2:
            scores = np.asarray(self_bleu_scores(gens))
            df.loc[idx, cols] = [scores.mean(), scores.std(ddof=1) / np.sqrt(len(scores)),
                                 len(scores)]
    return df
