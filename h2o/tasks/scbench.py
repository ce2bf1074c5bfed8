"""SCBench (SharedContextBench, microsoft/MInference, arXiv 2412.10319) through the evicting cache: one shared
context asked its requests (conf/task/scbench.yaml; docs/many-questions.md).

* ``mode=questions``: SCBench's shared context, different queries ("scdq"): the context prompt is prefilled once
  into the policy's cache (cut at its end under either timing) and each request is answered from its own copy of
  it (h2o.tasks.many_questions.ask).
* ``mode=turns``: SCBench's multi-turn mode on one cache, each request fed after the previous answer, the model's
  own answer kept (SCBench's ``disable_golden_context``; its default writes the reference answer of each turn into
  the next prompt instead, which this task does not do).

Subsets, with SCBench's own prompt texts (no chat template) and scorers (its compute_scores.py):
``scbench_kv`` (a value from a JSON object of UUID pairs) and ``scbench_prefix_suffix`` (a string by its prefix and
suffix): correct when the reference is in the answer; ``scbench_vt`` (variable tracking): the share of the
reference names in the answer, lower-cased; ``scbench_qa_eng`` (questions on a book): correct when a reference is
in the answer, upper-cased; ``scbench_choice_eng`` (four options): the letter or option chosen
(:func:`choice`); ``scbench_summary``: ROUGE-Lsum F1. The context prompt is the subset's instruction, a blank line
and the context (the context alone where SCBench has no instruction); each request is fed as a blank line and its
query (:func:`request`: the ``input``, or for qa and choice SCBench's question template). A context longer than
``max_context_tokens`` (null: the model's positions less :data:`ROOM`) keeps its first and last halves (SCBench's
middle truncation to its model's window). Greedy, up to ``max_gen_toks`` (SCBench's per subset: kv and prefix_suffix
150, vt 30, qa and choice 40, summary 200) or the end-of-sequence token. (SCBench's Chinese qa, its code and math
subsets and the mixed ones are not built.)

Data: ``data/<subset>.jsonl`` of the hub data set ``microsoft/SCBench`` (fields ``context``, ``multi_turns``:
``[{input, answer}]``, choice_eng's with ``options``), fetched into the Hugging Face cache by ``make prefetch``;
``data_files``: a local JSONL in the same form (tests, offline).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from h2o.tasks.base import Result, TaskSpec, adds_bos, check, check_fetched, positive_or_none

REPO = "microsoft/SCBench"
INSTRUCTIONS = {"scbench_kv": "Extract the value corresponding to the specified key in the JSON object below.",
                "scbench_prefix_suffix": None, "scbench_vt": None,
                "scbench_qa_eng": "Read the book and answer the question. Be very concise in your answer.",
                "scbench_choice_eng": "Read the book and answer the question.", "scbench_summary": None}
MAX_GEN_TOKS = {"scbench_kv": 150, "scbench_prefix_suffix": 150, "scbench_vt": 30, "scbench_qa_eng": 40,
                "scbench_choice_eng": 40, "scbench_summary": 200}
MODES = ("questions", "turns")
ROOM = 2048  # tokens kept free for the requests and their answers (SCBench's contexts have ~5 requests)


def contains(text: str, target) -> float:
    """kv and prefix_suffix: 1.0 when the reference is in the answer (case kept)."""
    return float(str(target) in text)


def share_found(text: str, target) -> float:
    """vt: the share of the reference names found in the answer, lower-cased, to 2 decimals (SCBench's)."""
    refs = target if isinstance(target, list) else [target]
    return round(sum(str(r).lower() in text.lower() for r in refs) / len(refs), 2)


def any_label(text: str, target) -> float:
    """qa_eng (SCBench scores it as InfiniteBench's longdialogue_qa_eng): 1.0 when one of the references is in the
    answer, both upper-cased."""
    refs = target if isinstance(target, list) else [target]
    return float(any(str(r).upper() in text.strip().upper() for r in refs))


def choice(text: str, target: list) -> float:
    """choice_eng (InfiniteBench's longbook_choice_eng), ``target`` [the option's text, its letter]: the answer's
    first character when it is a letter A-D; else the whole answer equal to the option; else what follows the first
    answer phrase ("answer is:", "answer:", "answer is", "option is") after punctuation is blanked; else its first
    word that is a substring of "ABCD" (SCBench's test, kept)."""
    pred = text.strip()
    if not pred:
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in target)
    if pred in target:
        return 1.0
    for c in "\n\"'.,?!{}":
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for phrase in ("answer is:", "answer:", "answer is", "option is"):
        at = pred.find(phrase)
        if at >= 0:
            after = pred[at + len(phrase) + 1:]
            return float(len(pred) >= at + len(phrase) + 1 and any(after.startswith(t) for t in target))
    return next((float(word in target) for word in pred.split() if word in "ABCD"), 0.0)


def rouge_lsum(text: str, target) -> float:
    """summary: ROUGE-Lsum F1 of the answer against the reference (SCBench's, through Hugging Face evaluate's
    rouge: rouge-score, no stemmer)."""
    return lsum_scorer().score(str(target), text)["rougeLsum"].fmeasure


@lru_cache(maxsize=1)
def lsum_scorer():
    """rouge-score's ROUGE-Lsum scorer, built once (h2o.cli.process.rouge_scorer: its import's log handler kept)."""
    from h2o.cli.process import rouge_scorer

    return rouge_scorer().RougeScorer(["rougeLsum"], use_stemmer=False)


SCORERS = {"scbench_kv": contains, "scbench_prefix_suffix": contains, "scbench_vt": share_found,
           "scbench_qa_eng": any_label, "scbench_choice_eng": choice, "scbench_summary": rouge_lsum}


def request(subset: str, turn: dict, k: int, mode: str) -> str:
    """The text of request ``k`` fed after the context (or the previous answer): a blank line, then SCBench's query
    for the subset (its texts, its typo "The the" kept; the multi-turn mode's later choice turns ask "The letter of
    the correct answer is", as its follow-up template does)."""
    if subset == "scbench_qa_eng":
        return f"\n\nQuestion: {turn['input']}\nAnswer:"
    if subset == "scbench_choice_eng":
        options = "".join(f"\n{letter}. {option}" for letter, option in zip("ABCD", turn["options"]))
        ask = "The letter of the correct answer is" if mode == "turns" and k > 0 else "The the correct answer is"
        return f"\n\nQuestion: {turn['input']}{options}\n\n{ask}"
    return "\n\n" + turn["input"]


def reference(subset: str, turn: dict):
    """What request ``turn``'s answer is scored against: choice_eng [the option, its letter], qa_eng a list."""
    answer = turn["answer"]
    if subset == "scbench_choice_eng":
        return [answer, "ABCD"[turn["options"].index(answer)]]
    if subset == "scbench_qa_eng":
        return answer if isinstance(answer, list) else [answer]
    return answer


@dataclass
class SCBenchTask(TaskSpec):
    name: str
    subset: str = "scbench_kv"
    mode: str = "questions"  # questions: each request from a copy of the context compressed once; turns: in turn
    limit: int | None = None  # contexts (null: every one)
    max_context_tokens: int | None = None  # longer contexts keep both ends (null: the model's positions less ROOM)
    max_gen_toks: int | None = None  # null: SCBench's for the subset
    data_files: str | None = None  # a local JSONL instead of the hub's data/<subset>.jsonl
    shots: int = 0
    batch_size: int = 1  # one context at a time

    kind = "shared_context"
    semantics = ("real",)

    def __post_init__(self):
        check(self.subset in SCORERS, f"task.subset={self.subset!r}: allowed: {', '.join(SCORERS)}")
        check(self.mode in MODES, f"task.mode={self.mode!r}: allowed: {', '.join(MODES)}")
        for key in ("limit", "max_context_tokens", "max_gen_toks"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check(self.shots == 0, f"task.shots={self.shots!r}: SCBench is zero-shot; allowed: 0")
        check(self.batch_size == 1, f"task.batch_size={self.batch_size!r}: one context at a time; allowed: 1")
        check(self.data_files is None or Path(str(self.data_files)).expanduser().is_file(),
              f"task.data_files={self.data_files!r}: no such file; allowed: null or a JSONL file of SCBench rows")
        if self.data_files:
            check_rows(self.subset, self.data_files)

    @property
    def gen_tokens(self) -> int:
        return self.max_gen_toks or MAX_GEN_TOKS[self.subset]

    def add_bos(self, tokenizer) -> bool:
        """The context starts with BOS where the tokenizer adds one (SCBench encodes with the tokenizer's default)."""
        return adds_bos(tokenizer, None)

    def check_model(self, model) -> None:
        """A context cap and :data:`ROOM` tokens for the requests and answers fit the model's positions, and an
        answer's ``max_gen_toks`` fits after the longest context kept."""
        max_pos, cap = model.max_positions(), self.max_context_tokens
        if max_pos is not None:
            check(max_pos > ROOM and (cap is None or cap + ROOM <= max_pos),
                  f"task.max_context_tokens={cap}: with {ROOM} tokens for the requests and answers, contexts must fit "
                  f"model {model.name}'s {max_pos} positions; allowed: null (its positions less {ROOM}) or an int "
                  f"<= {max_pos - ROOM}")
            context = cap or max_pos - ROOM  # a request and its answer follow the longest context kept
            check(self.gen_tokens < max_pos - context,
                  f"task.max_gen_toks={self.gen_tokens}: an answer after a context of {context} tokens passes model "
                  f"{model.name}'s {max_pos} positions; allowed: < {max_pos - context}")

    def context_cap(self, model) -> int | None:
        """Tokens a context keeps: ``max_context_tokens``, else the model's positions less :data:`ROOM` (SCBench
        truncates to its model's window), else None (whole: positions unknown)."""
        positions = getattr(model.config, "max_position_embeddings", None)
        return self.max_context_tokens or (positions - ROOM if positions else None)

    def hub_file(self) -> str:
        return f"data/{self.subset}.jsonl"

    def check_data(self) -> None:
        check_fetched(self.name, missing(self), " on a machine with internet, or task.data_files=<a local JSONL of "
                                                "SCBench rows>")

    def tokens(self) -> int:
        """Tokens of one run for the time estimates: SCBench's contexts run to ~128k tokens, 5 requests each."""
        contexts = self.limit or 100
        return contexts * ((self.max_context_tokens or 131072) + 5 * 8 * self.gen_tokens)

    def rows(self) -> list[dict]:
        path = self.data_files or local_file(self)
        with open(Path(str(path)).expanduser(), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return rows[:self.limit] if self.limit else rows

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        from h2o.tasks.many_questions import answer_contexts

        cpu0 = time.process_time()
        cap = self.context_cap(model)
        docs = [self.doc(tokenizer, row, cap) for row in self.rows()]
        eos = tokenizer.eos_token_id
        result = answer_contexts(model, tokenizer, policy, docs, self.mode, self.gen_tokens,
                                 lambda out: out[-1] == eos, SCORERS[self.subset], quant, cut=str.strip)
        result.info = {**result.info, "subset": self.subset, "context_cap": cap,
                       "truncated_contexts": sum(d["fields"]["truncated"] for d in docs),
                       "cpu_s": round(time.process_time() - cpu0, 1)}
        return result

    def doc(self, tok, row: dict, cap: int | None = None) -> dict:
        """One SCBench row as token ids: the context prompt (middle-truncated to ``cap`` tokens, default
        ``max_context_tokens``), each request, each reference."""
        context = row["context"] if "context" in row else row["input"]
        instruction = INSTRUCTIONS[self.subset]
        head = f"{instruction}\n\n" if instruction else ""
        ids = tok(head + str(context), add_special_tokens=self.add_bos(tok)).input_ids
        cap = cap or self.max_context_tokens
        truncated = cap is not None and len(ids) > cap
        if truncated:
            ids = ids[:cap // 2] + ids[len(ids) - (cap - cap // 2):]
        turns = row["multi_turns"]
        questions = [tok(request(self.subset, t, k, self.mode), add_special_tokens=False).input_ids
                     for k, t in enumerate(turns)]
        return {"context": ids, "questions": questions, "targets": [reference(self.subset, t) for t in turns],
                "fields": {"truncated": truncated}}


def check_rows(subset: str, path) -> None:
    """ConfigError (one line) unless every row of the JSONL ``path`` is one of ``subset``'s: a ``context`` (or
    ``input``) and ``multi_turns``, a non-empty list of requests each with ``input`` and ``answer`` (choice_eng's
    with its four ``options``, the answer among them)."""
    from h2o.cli.paths import abbrev
    from h2o.tasks.data_files import documents

    what = f"SCBench rows of task.subset={subset}"
    rows = documents("task.data_files", path, ("multi_turns",), what)
    name = f"task.data_files={abbrev(str(path))}"
    turn_fields = ("input", "answer", "options") if subset == "scbench_choice_eng" else ("input", "answer")
    allowed = (f"allowed: {what}: context, multi_turns (a list of requests with {', '.join(turn_fields)}"
               + (", the answer one of the four options)" if subset == "scbench_choice_eng" else ")"))
    for i, row in enumerate(rows):
        turns = row["multi_turns"]
        check("context" in row or "input" in row, f"{name}: row {i} has neither 'context' nor 'input'; {allowed}")
        check(isinstance(turns, list) and len(turns) > 0, f"{name}: row {i}'s multi_turns is "
                                                          f"{abbrev(turns, 60)}, not a list of requests; {allowed}")
        for k, turn in enumerate(turns):
            lacks = [f for f in turn_fields if not isinstance(turn, dict) or f not in turn]
            check(not lacks, f"{name}: row {i}'s request {k} lacks {', '.join(map(repr, lacks))}; {allowed}")
            if subset == "scbench_choice_eng":
                options = turn["options"]
                check(isinstance(options, list) and len(options) == 4 and turn["answer"] in options,
                      f"{name}: row {i}'s request {k}: options {abbrev(options, 80)} are not four texts holding the "
                      f"answer {abbrev(turn['answer'], 40)}; {allowed}")


def local_file(task: SCBenchTask) -> str:
    """The subset's file in the Hugging Face cache (no download): a ConfigError names what to fetch."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(REPO, task.hub_file(), repo_type="dataset")
    check(isinstance(path, str), f"task.subset={task.subset}: {REPO}/{task.hub_file()} is not in the Hugging Face "
                                 f"cache; allowed: `make prefetch EXP=<experiment>` first, or task.data_files=<JSONL>")
    return path


def missing(task: SCBenchTask) -> str | None:
    """Why the subset's file is not here, or None."""
    from huggingface_hub import try_to_load_from_cache

    if task.data_files or isinstance(try_to_load_from_cache(REPO, task.hub_file(), repo_type="dataset"), str):
        return None
    return f"hub data set {REPO} file {task.hub_file()} is not in the Hugging Face cache"


def fetch(task: SCBenchTask) -> str:
    """Download the subset's file into the Hugging Face cache (``make prefetch``)."""
    if task.data_files:
        return f"local {task.data_files}"
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(REPO, task.hub_file(), repo_type="dataset")
    return f"{REPO}/{task.hub_file()}: {sum(1 for _ in open(path, encoding='utf-8'))} contexts"
