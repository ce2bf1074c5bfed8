"""Stand-ins for BIG-bench's eight task files, written in BIG-bench's own ``task.json`` format.

The test suite reads no third-party data set: ``tests/conftest.py`` writes these files into a folder of its own and
names it in ``H2O_BIGBENCH``, so every ``bb_*`` task goes through the real converters (h2o.assets.data), the real
lm-eval task YAMLs (tasks/) and the real runs, on text made here. Each task's layout is the one its converter parses
(COPA's choices, the NLI and entailment sentence forms, WinoWhy's ``The '<pronoun>'`` reasons, XSUM's documents);
``SIZES`` gives each file's example count, from which the tests derive every expected count.

The texts are deterministic (``random.Random(SEED)``) and short, so a 5-shot prompt stays small on tiny models.
The real files' contents are checked only where they are present (tests/test_data.py, ``real_bigbench``).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 2026
#: task path -> examples written (every converter's split keeps groups whole: see h2o.assets.data.TASKS)
SIZES = {
    "cause_and_effect/one_sentence": 45,     # 45 event pairs, as many rows
    "cause_and_effect/two_sentences": 45,
    "elementary_math_qa/question_only": 130,
    "physical_intuition": 40,
    "presuppositions_as_nli": 60,            # 2 pairs per example_id: 30 groups
    "analytic_entailment": 40,
    "winowhy": 80,                           # 2 reasons per schema sentence: 40 groups
    "gem/xsum": 110,
}
XSUM_LONG = 7  # this XSUM document runs past HELM's 512-word cut

WORDS = ("the river farmer garden letter window morning soldier village bright quiet heavy storm horse "
         "teacher bridge road winter summer market kitchen candle orchard captain sister doctor lantern "
         "harbour meadow carriage station ribbon basket valley mountain evening".split())
NAMES = ("Anne Elinor Henry Fanny Edmund Harriet Frederick Jane Robert Lucy".split())


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _event(rng: random.Random) -> tuple[str, str]:
    """A cause and its effect, as two clauses."""
    who = rng.choice(NAMES)
    return f"{who} saw the {_phrase(rng, 2)}", f"{who} walked to the {_phrase(rng, 2)}"


def _copa(rng: random.Random, n: int, two: bool) -> list[dict]:
    rows = []
    for _ in range(n):
        cause, effect = _event(rng)
        if two:  # BIG-bench's two_sentences: "<effect>. <cause>." style, the right order first
            right, wrong = f"{cause}. {effect}.", f"{effect}. {cause}."
        else:
            right, wrong = f"{effect} because {cause}.", f"{cause} because {effect}."
        rows.append({"input": "", "target_scores": {right: 1, wrong: 0}})
    return rows


def _mc(rng: random.Random, n: int, template: str, choices: tuple[int, int], numeric: bool = False) -> list[dict]:
    rows = []
    for _ in range(n):
        k = rng.randint(*choices)
        options = ([str(v) for v in rng.sample(range(1, 500), k)] if numeric
                   else [f"{_phrase(rng, 3)}" for _ in range(k)])
        options = list(dict.fromkeys(options))
        gold = rng.randrange(len(options))
        rows.append({"input": template.format(_phrase(rng, 8)),
                     "target_scores": {o: int(i == gold) for i, o in enumerate(options)}})
    return rows


def _nli(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        label = ("entailment", "neutral", "contradiction")[i % 3]
        premise = f"{rng.choice(NAMES)} kept the {_phrase(rng, 3)}."
        hypothesis = f"There was a {_phrase(rng, 2)}."
        rows.append({"input": f"Sentence 1: {premise}\nSentence 2: {hypothesis}\n\nThe answer is: ",
                     "target_scores": {k: int(k == label) for k in ("entailment", "neutral", "contradiction")},
                     "comment": {"example_id": i // 2}})
    return rows


def _analytic(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        joint = ("So", "Therefore,")[i % 2]
        text = f"{rng.choice(NAMES)} is a {_phrase(rng, 2)}. {joint} {rng.choice(NAMES)} owns a {_phrase(rng, 2)}."
        label = ("entailment", "no-entailment")[rng.randrange(2)]
        rows.append({"input": text, "target_scores": {k: int(k == label) for k in ("entailment", "no-entailment")}})
    return rows


def _winowhy(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n // 2):
        a, b = rng.sample(NAMES, 2)
        sentence = f"{a} thanked {b} because she {_phrase(rng, 3)}."
        for verdict, who in (("correct", a), ("incorrect", b)):
            rows.append({"input": f"{sentence} The 'she' refers to {who} because {_phrase(rng, 5)}.",
                         "target_scores": {"correct": int(verdict == "correct"),
                                           "incorrect": int(verdict == "incorrect")}})
    return rows


def _xsum(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        words = 530 if i == XSUM_LONG else rng.randint(20, 59)  # a quarter within bb_xsum's 50-150-word pool
        sentences = [_phrase(rng, 10).capitalize() + "." for _ in range(words // 10)]
        rows.append({"input": " ".join(sentences), "target": f"{rng.choice(NAMES)} and the {_phrase(rng, 4)}.",
                     "comment": f"xsum-test-{i}"})
    return rows


def examples(task: str) -> list[dict]:
    """The stand-in examples of one BIG-bench task path (deterministic)."""
    rng = random.Random(f"{SEED}-{task}")
    n = SIZES[task]
    return {
        "cause_and_effect/one_sentence": lambda: _copa(rng, n, two=False),
        "cause_and_effect/two_sentences": lambda: _copa(rng, n, two=True),
        "elementary_math_qa/question_only": lambda: _mc(rng, n, "What is the {} worth in coins?", (3, 6), True),
        "physical_intuition": lambda: _mc(rng, n, "Why does the {} fall?", (2, 5)),
        "presuppositions_as_nli": lambda: _nli(rng, n),
        "analytic_entailment": lambda: _analytic(rng, n),
        "winowhy": lambda: _winowhy(rng, n),
        "gem/xsum": lambda: _xsum(rng, n),
    }[task]()


def write(root: Path) -> Path:
    """Write every stand-in ``<root>/<task>/task.json`` (BIG-bench's layout) and return ``root``."""
    for task in SIZES:
        body = {"name": task.split("/")[-1], "description": f"test-suite stand-in for BIG-bench's {task}",
                "keywords": ["stand-in"], "metrics": ["multiple_choice_grade"], "examples": examples(task)}
        (root / task).mkdir(parents=True, exist_ok=True)
        (root / task / "task.json").write_text(json.dumps(body, indent=1), encoding="utf-8")
    return root
