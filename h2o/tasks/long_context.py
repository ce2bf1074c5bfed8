"""Long-context retrieval through lm-eval's ``generate_until`` and the real evicting cache (conf/task/niah.yaml,
conf/task/ruler_*.yaml).

* ``niah``: the project's needle-in-a-haystack task (tasks/niah.yaml, h2o.tasks.niah): ``lengths`` x ``depths``
  cells of ``samples`` docs each, from the book ``text``.
* RULER (lm-eval's own ``ruler`` tasks, e.g. ``niah_single_2``): ``lengths`` are its ``max_seq_lengths``; the
  essay haystack is the book ``text`` through h2o.tasks.ruler_offline (``essays``: lm-eval's own, from the hub);
  ``limit`` docs per length (lm-eval draws 500 per length).

The model is h2o.tasks.lm_eval_model.H2OLM around the loaded model: each left-padded batch of prompts is
prefilled with full attention, then the cache keeps the policy's budget (a ratio of each prompt) while decoding
(the paper's protocol); the tokens kept per prompt are recorded (``kept_ratio``). ``question``: ``prompt`` (the
question ends the compressed prompt) or ``after`` (kvpress's query-agnostic protocol: the context less the question
is the prompt, compressed alone, then the question is fed: h2o.tasks.question_after; niah and RULER; the record's
``kept_ratio`` and ``mean_prompt_tokens`` are then of the context alone). Greedy, no chat template, no BOS
(``add_bos_token``, as multiple choice). Per-request results go to lm-eval's request cache inside the run
(h2o.tasks.progress.lm_eval_cache): an interrupted run resumes where it stopped.

Metrics: ``acc`` (the mean per-sample score: exact match of the number for niah, lm-eval's ``string_match`` for
RULER) with ``acc_stderr``; ``info.cells``: accuracy per (length, depth) for niah, per length for RULER;
``info.question``. Samples: doc id, length (and depth, measured needle depth, prompt tokens, question tokens for
niah; question tokens for RULER with ``question=after``), target, generation, ``acc``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import lru_cache

from h2o.tasks.base import (Result, TaskSpec, adds_bos, cells, check, check_fetched, check_room, clamped,
                            positive_or_none, stderr)
from h2o.tasks.batching import BatchSize, Sizing, check_batch_size, record
from h2o.tasks.kv_held import END, batch_fields
from h2o.tasks.question_after import QUESTIONS, check_many_task, ruler_pattern

NIAH = "niah"
TEXTS = ("austen", "moby_dick")


def ruler_folder():
    """lm-eval's own ``ruler`` task folder (loaded alone: TaskManager(include_defaults=False) is instant)."""
    from pathlib import Path

    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "ruler"


MAX_DRAWN = 1000  # niah's samples per (length, depth) cell, RULER's split tasks' contexts per length (RULER: 500)


def check_drawn(key: str, value) -> None:
    """ConfigError unless ``value`` (niah's samples per cell, RULER's split tasks' contexts per length) is null or
    1-:data:`MAX_DRAWN`: every doc is drawn, and measured, before the model loads. h2o-run and the lm-eval wrapper's
    ``--metadata samples``."""
    check(value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DRAWN),
          f"{key}={value!r}: docs drawn per cell, each built before the model loads; allowed: {key} in 1-{MAX_DRAWN}")


@dataclass
class LongContextTask(TaskSpec):
    name: str
    lm_eval_task: str = NIAH
    lengths: list = field(default_factory=lambda: [1024])
    depths: list = field(default_factory=lambda: [0.1, 0.5, 0.9])  # niah only
    samples: int = 2  # niah: docs per (length, depth) cell
    limit: int | None = None  # RULER: docs per length; LongBench: docs
    text: str = "austen"  # the haystack: austen | moby_dick (RULER also: essays, lm-eval's own from the hub)
    max_gen_toks: int | None = None  # None: the task's own (niah 12, RULER 128, qa 32, LongBench 32-512)
    seed: int = 0  # niah: the dataset's draw (keys, numbers, haystack starts)
    shots: int = 0  # no in-context examples (the run folder's shots<k> component)
    batch_size: BatchSize = 1
    add_bos_token: bool | None = False
    clip_to_model: bool = False  # true: lengths beyond the model's positions are dropped (the record has those run)
    question: str = "prompt"  # prompt | after: the question inside the compressed prompt or after it (niah, RULER);
    # with questions > 1: compressed once (prompt | after) or with each question inside its prompt (each)
    questions: int = 1  # niah and RULER's *_questions tasks: questions per context, each from a copy of the context
    # compressed once (h2o.tasks.many_questions; RULER's through lm-eval, h2o.tasks.lm_eval_many); RULER's split
    # tasks read ``limit`` as contexts per length (each asked its questions)
    turns: int = 1  # niah: questions asked in turn on one cache, answers kept (many_questions)

    kind = "retrieval"
    semantics = ("real",)
    quantizes = True

    def __post_init__(self):
        for key in ("lengths", "depths"):  # a bare value (task.lengths=512) or a text is not a list
            value = getattr(self, key)
            check(isinstance(value, (list, tuple)),
                  f"task.{key}={value!r}: expected a list, e.g. task.{key}=[{value!r}]; allowed: "
                  + ("a list of token counts (ints > 0)" if key == "lengths" else "a list of fractions in [0, 1]"))
        self.lengths, self.depths = list(self.lengths), list(self.depths)
        check(bool(self.lengths) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                         for n in self.lengths),
              f"task.lengths={self.lengths!r}: expected a list of token counts (ints > 0)")
        check(all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1 for d in self.depths)
              and bool(self.depths), f"task.depths={self.depths!r}: expected a list of fractions in [0, 1]")
        positive_or_none("task.samples", self.samples)
        positive_or_none("task.limit", self.limit)
        drawn = [("samples", self.samples)] + ([("limit", self.limit)] if self.split else [])
        for key, value in drawn:
            check_drawn(f"task.{key}", value)
        positive_or_none("task.max_gen_toks", self.max_gen_toks)
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
              f"task.seed={self.seed!r}: expected an int >= 0")
        check(self.shots == 0, f"task.shots={self.shots!r}: long-context tasks take no in-context examples; allowed: 0")
        check_batch_size(self.batch_size)
        texts = TEXTS if self.is_niah else (*TEXTS, "essays")
        check(self.text in texts, f"task.text={self.text!r}: allowed: {', '.join(texts)}")
        if not self.is_niah:
            from h2o.tasks.multiple_choice import yaml_task_names

            ruler = ", ".join(n for n in yaml_task_names(ruler_folder()) if n != "ruler")
            check(self.lm_eval_task in yaml_task_names(self.lm_eval_folder()),
                  f"task.lm_eval_task={self.lm_eval_task!r}: allowed: niah, lm-eval's RULER tasks ({ruler}) and its "
                  f"longbench_* tasks")
        self.check_many()
        each = self.questions > 1 and self.is_niah  # each: per question, with task.questions (niah)
        allowed = QUESTIONS + (("each",) if each else ())
        check(self.question in allowed, f"task.question={self.question!r}: allowed: {', '.join(allowed)}"
                                        + ("" if each else " (each: with task.questions > 1 on niah)"))
        splits = self.is_niah or (self.family == "ruler" and ruler_pattern(self.lm_eval_task) is not None)
        check(self.question == "prompt" or splits,
              f"task.question={self.question}: task {self.lm_eval_task}'s prompts hold no question to split off; "
              f"allowed: question=prompt (question=after: niah and lm-eval's RULER tasks)")
        check(self.family != "longbench" or len(self.lengths) == 1,
              f"task.lengths={self.lengths}: a LongBench run takes one length (its prompts' cut); allowed: [<n>]")

    def check_many(self) -> None:
        """``questions`` and ``turns``: positive ints, at most one above 1, above 1 on niah only."""
        for key in ("questions", "turns"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"task.{key}={value!r}: expected an int >= 1")
            check_many_task(key, value, self.lm_eval_task, "task.")
        check(min(self.questions, self.turns) == 1, f"task.questions={self.questions}, task.turns={self.turns}: "
                                                    f"allowed: one of them above 1")

    @property
    def many(self) -> int:
        """Questions per context beyond one (``questions`` or ``turns``), else 0: h2o.tasks.many_questions."""
        n = max(self.questions, self.turns)
        return n if n > 1 else 0

    @property
    def is_niah(self) -> bool:
        return self.lm_eval_task == NIAH

    @property
    def family(self) -> str:
        """niah (ours) | longbench | ruler (lm-eval's)."""
        return NIAH if self.is_niah else "longbench" if self.lm_eval_task.startswith("longbench_") else "ruler"

    @property
    def split(self) -> str | None:
        """The RULER task a ``*_questions`` task splits into one question per key over a shared context
        (h2o.tasks.ruler_many: ``niah_multikey_1``, ``niah_multiquery``), else None."""
        from h2o.tasks.ruler_many import SOURCES

        return SOURCES.get(self.lm_eval_task)

    def lm_eval_folder(self):
        """The lm-eval task folder that holds ``lm_eval_task`` (ours: niah and RULER's split tasks; or lm-eval's own
        ruler / longbench)."""
        from pathlib import Path

        from h2o.assets.paths import TASKS
        from h2o.tasks.longbench import folder

        if self.split:
            return Path(TASKS)
        return {NIAH: Path(TASKS), "longbench": folder()}.get(self.family) or ruler_folder()

    def check_model(self, model) -> None:
        """Lengths within the model's positions (``positions`` of its conf/model yaml, else its config.json;
        unknown: not checked here), a niah prompt with its generated tokens (past them lm-eval drops the prompt's
        start, the needle with it at depth 0); a RULER or LongBench length already holds them. ``clip_to_model``
        keeps the lengths that fit (LongBench: cuts its length to the positions), so one grid serves every model.
        Then each length holds the task's fixed text (:meth:`check_lengths`)."""
        gen = self.gen_tokens
        if not self.is_niah:  # a RULER length holds the prompt and the generated tokens (lm-eval's rule)
            check(gen < min(self.lengths), f"task.max_gen_toks={gen}: leaves no prompt in task.lengths="
                                           f"{self.lengths}; allowed: < {min(self.lengths)}")
        max_pos = model.max_positions()
        if max_pos is not None:
            check_room("task.max_gen_toks", gen, max_pos, model.name)
            room = max_pos - (gen if self.is_niah else 0)  # the longest length that fits (else lm-eval cuts it)
            plus = f" with {gen} generated tokens" if self.is_niah else ""
            if self.clip_to_model and self.family == "longbench":
                self.lengths = [min(self.lengths[0], room)]
            elif self.clip_to_model:
                fit = [n for n in self.lengths if n <= room]
                check(bool(fit), f"task.lengths={self.lengths}: none fits model {model.name}'s {max_pos} positions"
                                 f"{plus}; allowed: <= {room}")
                self.lengths = fit
            check(max(self.lengths) <= room, f"task.lengths={self.lengths}: beyond model {model.name}'s {max_pos} "
                                             f"positions{plus}; allowed: <= {room}")
        if self.family != "longbench":  # LongBench's prompts are its own, cut to the length
            self.check_lengths(model)

    def check_data(self) -> None:
        """RULER's qa files, RULER's essays (``text=essays``) and LongBench's hub data: the data a cluster run
        reads from the prefetched caches (h2o.tasks.long_context_data); a book is fetched by the task itself."""
        from h2o.tasks.long_context_data import not_fetched

        check_fetched(self.name, "; ".join(not_fetched(self)) or None,
                      f" (python -m h2o.pipeline.prefetch task={self.name} ...), on a machine with internet")

    def check_lengths(self, model) -> None:
        """Each length holds the task's fixed text, judged with the model's tokenizer (loaded alone, from this
        machine: not checked when it is not here yet): niah, the instruction, needle and question of each of its
        docs plus a few tokens of book (h2o.tasks.niah.shortest); RULER, lm-eval's least sample
        (h2o.tasks.ruler_offline.shortest_length)."""
        tok = local_tokenizer(model)
        if tok is None:
            return
        if self.is_niah and self.many:
            from h2o.tasks.niah_many import shortest

            short = shortest(tok, self.lengths, self.depths, self.samples, self.seed, self.many)
            what = f"its instruction, {self.many} needles and a question"
        elif self.is_niah:
            from h2o.tasks.niah import shortest

            short = shortest(tok, self.lengths, self.depths, self.samples, self.seed)
            what = "its instruction, needle and question"
        else:
            from h2o.tasks.ruler_offline import shortest_length

            need = shortest_length(tok, self.split or self.lm_eval_task, self.text)
            short = next(((n, need) for n in self.lengths if need and n < need), None)
            what = f"lm-eval's {self.lm_eval_task} prompt and the tokens it sizes generation with"
        n, need = short or (0, 0)
        check(short is None, f"task.lengths={self.lengths}: {n} tokens are too short for {what} ({model.name}'s "
                             f"tokenizer); allowed: lengths >= {need}")

    @property
    def gen_tokens(self) -> int:
        """Tokens generated per request: ``max_gen_toks`` or the task's own (niah 12, RULER 128)."""
        if self.max_gen_toks:
            return self.max_gen_toks
        if self.family == "longbench":
            from h2o.tasks.longbench import gen_tokens

            return gen_tokens(self.lm_eval_task)
        return 12 if self.is_niah else 32 if self.lm_eval_task.startswith("ruler_qa") else 128

    def tokens(self) -> int:
        """Prompt tokens of one run, plus the generated tokens as scored-token equivalents (the time estimates of
        h2o.pipeline.launch): niah lengths x depths x samples; RULER lengths x limit (500 without a limit);
        LongBench its docs (h2o.tasks.longbench.size)."""
        gen = self.gen_tokens
        if self.family == "longbench":
            from h2o.tasks.longbench import size

            return size(self.lm_eval_task, self.limit, self.lengths[0])
        docs = len(self.depths) * self.samples if self.is_niah else (self.limit or 500)
        asked = max(self.many, 1)  # each further question: its tokens (about 30) and its answer
        return docs * sum(n + asked * gen + (asked - 1) * 30 for n in self.lengths)

    def add_bos(self, tokenizer) -> bool:
        return adds_bos(tokenizer, self.add_bos_token)

    def protocol(self, tokenizer) -> dict:
        """TaskSpec's; ``question`` only where it is not the default (so a record without the field reads as the default)."""
        out = super().protocol(tokenizer)
        for key, default in (("question", "prompt"), ("questions", 1), ("turns", 1)):
            if out[key] == default:
                del out[key]
        return out

    def metadata(self, tokenizer) -> dict:
        """What lm-eval hands the task's dataset function (TaskManager(metadata=...))."""
        path = getattr(tokenizer, "name_or_path", None)
        check(bool(path), "the tokenizer has no name_or_path: long-context tasks size their prompts by it")
        if self.is_niah:
            return {"tokenizer": path, "lengths": self.lengths, "depths": self.depths, "samples": self.samples,
                    "text": self.text, "seed": self.seed}
        if self.family == "longbench":  # its docs come from the hub data set as they are
            return {}
        split = {"questions": self.questions, "turns": self.turns, "samples": self.limit} if self.split else {}
        return {"tokenizer": path, "max_seq_lengths": self.lengths, **split}

    @property
    def metric(self) -> str:
        """The per-sample score: ``acc`` (niah's exact match, RULER's string match) or LongBench's ``score``."""
        return "score" if self.family == "longbench" else "acc"

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.many and self.is_niah:  # compress once, ask many: the model's own loop (one request per context)
            from h2o.tasks.many_questions import run

            return run(self, model, tokenizer, policy, quant)
        cpu0 = time.process_time()
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from h2o.tasks.lm_eval_model import H2OLM
        from h2o.tasks.progress import lm_eval_cache

        haystack, cut = {"haystack": self.text}, {}
        if self.family == "ruler":
            from h2o.tasks.ruler_offline import use_haystack

            haystack = use_haystack(self.text)  # before the task's modules load
        elif self.family == "longbench":  # prompts over the length less the generated tokens keep both ends
            haystack, cut = {"truncation": "middle", "max_length": self.lengths[0]}, {"max_length": self.lengths[0]}
        lm = H2OLM(pretrained=model, tokenizer=tokenizer, policy=policy, quant=quant, batch_size=self.batch_size,
                   add_bos_token=self.add_bos_token, question=self.question, questions=self.questions,
                   turns=self.turns, **cut)
        lm.truncate = "middle" if cut else "left"
        tm = TaskManager(include_path=str(self.lm_eval_folder()), include_defaults=False,
                         metadata=self.metadata(tokenizer))
        gen = {"max_gen_toks": self.max_gen_toks} if self.max_gen_toks else None
        with lm_eval_cache() as cache:
            out = simple_evaluate(model=lm, tasks=[self.lm_eval_task], limit=None if self.split else self.limit,
                                  task_manager=tm, log_samples=True, gen_kwargs=gen, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                  use_cache=cache)
        samples = [self.sample_row(s, lm) for s in out["samples"][self.lm_eval_task]]
        scores = [s[self.metric] for s in samples]
        metrics = {self.metric: sum(scores) / len(scores), f"{self.metric}_stderr": stderr(scores)}
        budgets = lm.all_budgets()  # every generated prompt, those before an interruption included
        prompt, held = (sum(x) for x in zip(*budgets)) if budgets else (0, 0)
        info = {"headline": self.metric,  # the metric analysis draws and tabulates (analysis.figures.headline_metric)
                "cells": cells(samples, self.is_niah, self.metric), "lm_eval_task": self.lm_eval_task, **haystack,
                "question": "after" if self.many else self.question,  # several: the shared context compressed once
                "chat_template": False, "kept_ratio": round(held / prompt, 4) if prompt else None,
                "mean_prompt_tokens": round(prompt / len(budgets), 1) if budgets else None,
                "clamped_requests": clamped(policy, [n for n, _ in budgets]),  # a ratio of each prompt
                **batch_fields(lm.all_footprints(), END, token_digits=1),  # the cache at each generation's end
                "cpu_s": round(time.process_time() - cpu0, 1),  # this process's CPU time in the task, all threads
                **record(self.batch_size, [Sizing(self.batch_size, "fixed", f"task.batch_size={self.batch_size}")])}
        return Result(metrics, samples, info)

    def sample_row(self, s: dict, lm) -> dict:
        doc, generation = s["doc"], s["filtered_resps"][0]
        if self.is_niah:
            context = s["arguments"][0][0]
            return {"doc_id": s["doc_id"], "length": doc["length"], "depth": doc["depth"],
                    "needle_depth": doc["needle_depth"], "prompt_tokens": doc["prompt_tokens"],
                    "question_tokens": lm.question_tokens(context, doc, self.lm_eval_task), "target": doc["answer"],
                    "generation": generation, "acc": float(s["exact_match"])}
        if self.family == "longbench":
            return {"doc_id": s["doc_id"], "length": self.lengths[0], "target": doc.get("answers"),
                    "generation": generation, "score": float(s["score"])}
        length = int(doc["max_length"])
        asked = ({"question_tokens": lm.question_tokens(s["arguments"][0][0], s["doc"], self.lm_eval_task)}
                 if self.question == "after" else {})
        if self.split:  # its shared context and the question's index in it
            asked = {**asked, "context": doc["context"], "question": doc["question_index"]}
        return {"doc_id": s["doc_id"], "length": length, "target": doc["outputs"], **asked,
                "generation": generation, "acc": float(s[str(length)])}


def local_tokenizer(model):
    """The tokenizer of ``model`` (an h2o.assets.model_spec.ModelSpec) from this machine only -- a tiny model, a
    cached packaged model, a local folder or a hub id in the local cache -- or None (nothing is downloaded)."""
    return tokenizer_here(str(model.pretrained))


@lru_cache(maxsize=16)  # a sweep checks many runs of one model
def tokenizer_here(name: str):
    from transformers import AutoTokenizer

    from h2o.assets.model_spec import resolve_tiny
    from h2o.assets.packaged import is_checkpoint, packaged, packaged_dir

    folder = packaged_dir(packaged(name)) if packaged(name) else resolve_tiny(name)
    if packaged(name) and not is_checkpoint(folder):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None
