"""Reasoning tasks: lm-eval 0.4.13's own AIME 2024/2025, GSM8K (chain of thought, zero-shot) and MATH-500, answered
in the model's chat template, sampled as the field reports them, through the real evicting cache
(conf/task/aime24.yaml, aime25.yaml, gsm8k.yaml, math500.yaml; docs/reasoning.md).

Protocol: each problem's prompt is lm-eval's own (``doc_to_text``), put in the model's chat template by lm-eval
(``apply_chat_template``) after the ``system_prompt`` (null: none), with ``thinking`` handed to the template as
``enable_thinking`` where it is set (null: the template's default); ``think_end_token`` (e.g. ``</think>``): lm-eval
scores only the text after it. ``n`` samples per problem (lm-eval's ``repeats``) at ``temperature`` and ``top_p``
(temperature 0: greedy), at most ``max_gen_toks`` new tokens, stopped at lm-eval's stop texts or EOS. Each sample is
scored by lm-eval's own rule (the task's filters, then its ``process_results``), every sample, not only the first
(lm-eval scores only its first repeat); ``pass_at_1`` is the mean score over every sample, its interval the 95% one
over problems (each problem's mean over its samples is one observation: mean +- 1.96 x their standard error).

Each sample records its score under every filter of the task, its generated tokens, whether it stopped at the length
limit, the KV cache held when it ended and at its peak (token x KV head entries and their bytes), and its time
(h2o.tasks.generation_rows). ``data_files``: a local JSON file of documents in the data set's own fields, read
instead of the hub's (a stand-in task that includes lm-eval's own YAML: its prompt, stops and scoring untouched).
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from h2o.tasks.base import Result, TaskSpec, check, check_fetched, check_room, positive_or_none
from h2o.tasks.batching import BatchSize, Sizing, check_batch_size, record
from h2o.tasks.data_files import documents

# lm-eval task -> (its folder in lm-eval's tasks, the hub data set, the headline (filter, metric))
TASKS = {"aime24": ("aime", "Maxwell-Jia/AIME_2024", ("none", "exact_match")),
         "aime25": ("aime", "math-ai/aime25", ("none", "exact_match")),
         "gsm8k_cot_zeroshot": ("gsm8k", "openai/gsm8k", ("flexible-extract", "exact_match")),
         "hendrycks_math500": ("hendrycks_math", "HuggingFaceH4/MATH-500", ("none", "exact_match")),
         "minerva_math500": ("minerva_math", "HuggingFaceH4/MATH-500", ("none", "math_verify"))}
THINKING = (None, True, False)
# For the time estimates only (h2o.pipeline.launch), not measured here: the mean tokens of a 7-8B reasoning model's
# answer with the full cache (a compressed cache can make answers longer, up to max_gen_toks), the problems of each
# data set, and the cost of one generated token in scored prompt tokens (the model's ``s_per_mtok``): ~5 ms per
# answer token at batch 8 through ``generate`` (one step ~40 ms, the batch waiting for its longest answer) against
# ~0.15 ms per prompt token.
EXPECTED_TOKENS = {"aime24": 14000, "aime25": 14000, "gsm8k_cot_zeroshot": 1500, "hendrycks_math500": 4000,
                   "minerva_math500": 4000}
PROBLEMS = {"aime24": 30, "aime25": 30, "gsm8k_cot_zeroshot": 1319, "hendrycks_math500": 500, "minerva_math500": 500}
DECODE_COST = 30
# the fields lm-eval's prompt, target and scoring read from a document (a local ``data_files`` must hold them)
FIELDS = {"aime24": ("Problem", "Answer"), "aime25": ("problem", "answer"),
          "gsm8k_cot_zeroshot": ("question", "answer"), "hendrycks_math500": ("problem", "solution"),
          "minerva_math500": ("problem", "solution")}
# modules a task's scoring imports that lm-eval installs only with an extra: (module, the extra)
EXTRAS = {"minerva_math500": ("math_verify", "lm_eval[math]")}
MAX_SAMPLES = 1024  # task.n: lm-eval builds every sample's request (and keeps its answer) up front


def folder(lm_eval_task: str) -> Path:
    """lm-eval's own folder of the task's YAML."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / TASKS[lm_eval_task][0]


def yaml_of(lm_eval_task: str) -> Path:
    """lm-eval's YAML file that defines ``lm_eval_task``."""
    for path in sorted(folder(lm_eval_task).glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if any(line.strip() == f"task: {lm_eval_task}" for line in text.splitlines()):
            return path
    raise FileNotFoundError(f"lm-eval has no YAML for task {lm_eval_task} in {folder(lm_eval_task)}")


def stand_in(lm_eval_task: str, data_files: str, into: Path, repeats: int | None = None) -> Path:
    """A task folder ``into`` whose YAML ``<lm_eval_task>.yaml`` includes lm-eval's own task and reads its documents
    from the local JSON ``data_files`` (the split lm-eval evaluates), ``repeats`` samples per problem where given
    (for ``--model h2o``: lm-eval's command line has no option for it); returns the folder."""
    import yaml

    from lm_eval.tasks._yaml_loader import load_yaml

    own = yaml_of(lm_eval_task)
    split = load_yaml(own, resolve_func=False).get("test_split") or "test"
    into.mkdir(parents=True, exist_ok=True)
    spec = {"include": str(own), "task": lm_eval_task, "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(Path(data_files).resolve())}},
            "training_split": None, "validation_split": None, "fewshot_split": None, "test_split": split,
            **({"repeats": repeats} if repeats else {})}
    (into / f"{lm_eval_task}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return into


def score_all(task, doc: dict, answers: list[str]) -> list[dict[str, dict]]:
    """lm-eval's own score of each answer alone: per answer, {filter: {metric: value}} (the task's filters, then
    its ``process_results``)."""
    out = []
    for answer in answers:
        scores = {}
        for ensemble in task._filters:
            resps = [[answer]]
            for make in ensemble.filters:
                resps = make().apply(resps, [doc])
            kept = list(resps)[0]
            scores[ensemble.name] = {k: float(v) for k, v in task.process_results(doc, [kept]).items()
                                     if isinstance(v, (int, float, bool))}
        out.append(scores)
    return out


def interval(per_problem: list[float]) -> tuple[float, float, float]:
    """(mean, its standard error, half the 95% interval) over problems; 0 spread for fewer than two."""
    n = len(per_problem)
    mean = sum(per_problem) / n if n else float("nan")
    if n < 2:
        return mean, 0.0, 0.0
    se = math.sqrt(sum((v - mean) ** 2 for v in per_problem) / (n - 1) / n)
    return mean, se, 1.96 * se


@dataclass
class ReasoningTask(TaskSpec):
    name: str
    lm_eval_task: str = "aime24"
    limit: int | None = None  # problems (null: all)
    n: int = 1  # samples per problem (lm-eval's repeats)
    temperature: float = 0.6  # 0: greedy
    top_p: float = 0.95
    max_gen_toks: int = 32768
    chat_template: bool = True
    system_prompt: str | None = None
    thinking: bool | None = None  # enable_thinking for the chat template (null: not passed, the template's default)
    think_end_token: str | None = None  # lm-eval scores the text after it (null: the whole answer)
    data_files: str | None = None  # a local JSON of documents instead of the hub data set (tests, offline)
    shots: int = 0
    batch_size: BatchSize = 1
    add_bos_token: bool | None = False  # the chat template writes its own BOS where the model has one

    kind = "reasoning"
    semantics = ("real",)

    def __post_init__(self):
        check(self.lm_eval_task in TASKS,
              f"task.lm_eval_task={self.lm_eval_task!r}: allowed: {', '.join(TASKS)}")
        positive_or_none("task.limit", self.limit)
        check(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_SAMPLES,
              f"task.n={self.n!r}: samples per problem (lm-eval builds every one's request up front); allowed: an "
              f"int in 1-{MAX_SAMPLES}")
        check_extra(self.lm_eval_task)
        check_sampling("task.", {"temperature": self.temperature, "top_p": self.top_p,
                                 "max_gen_toks": self.max_gen_toks})
        check(self.thinking in THINKING, f"task.thinking={self.thinking!r}: allowed: null, true, false")
        check(self.think_end_token is None or (isinstance(self.think_end_token, str) and self.think_end_token != ""),
              f"task.think_end_token={self.think_end_token!r}: allowed: null or a text (e.g. </think>)")
        check(self.thinking is not True or self.think_end_token is not None,
              "task.thinking=true with think_end_token=null: lm-eval scores the text after the end of the thinking; "
              "allowed: think_end_token=<its text> (e.g. </think>), or thinking=null|false")
        check(isinstance(self.chat_template, bool), f"task.chat_template={self.chat_template!r}: allowed: true, false")
        check(self.chat_template or (self.thinking is None and self.system_prompt is None),
              f"task.chat_template=false with thinking={self.thinking!r}, system_prompt={self.system_prompt!r}: both "
              f"go through the chat template; allowed: chat_template=true, or thinking=null and system_prompt=null")
        check(self.shots == 0, f"task.shots={self.shots!r}: reasoning tasks are zero-shot; allowed: 0")
        check(self.data_files is None or Path(str(self.data_files)).expanduser().is_file(),
              f"task.data_files={self.data_files!r}: no such file; allowed: null or a JSON file of documents")
        if self.data_files:
            documents("task.data_files", self.data_files, FIELDS[self.lm_eval_task],
                      f"lm-eval task {self.lm_eval_task}")
        check_batch_size(self.batch_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def gen_kwargs(self) -> dict:
        """lm-eval's generation arguments (merged into the task's own: its stop texts stay)."""
        sampling = {"do_sample": False, "temperature": 0.0} if self.greedy else \
            {"do_sample": True, "temperature": float(self.temperature), "top_p": float(self.top_p)}
        return {**sampling, "max_gen_toks": self.max_gen_toks}

    def check_model(self, model) -> None:
        max_pos = model.max_positions()
        check_room("task.max_gen_toks", self.max_gen_toks, max_pos, model.name)
        if self.chat_template:  # the tokenizer alone, from this machine (unknown here: left to lm-eval)
            from h2o.tasks.long_context import local_tokenizer

            tok = local_tokenizer(model)
            check(tok is None or bool(getattr(tok, "chat_template", None)),
                  f"task.chat_template=true: model {model.name}'s tokenizer has no chat template; allowed: "
                  f"task.chat_template=false (the problem as plain text), or a model whose tokenizer has one")
        if max_pos is not None and self.data_files:
            self.check_prompts(model, max_pos)

    def check_prompts(self, model, max_pos: int) -> None:
        """The longest prompt of a local ``data_files`` (lm-eval's own template, in the chat template where it is
        used, counted with the model's tokenizer from this machine; not checked when it is not here) and
        ``max_gen_toks`` fit the model's positions: past them lm-eval keeps only the prompt's last tokens."""
        from lm_eval.tasks._yaml_loader import load_yaml
        from lm_eval.utils import apply_template

        from h2o.tasks.long_context import local_tokenizer

        tok = local_tokenizer(model)
        template = load_yaml(yaml_of(self.lm_eval_task), resolve_func=False).get("doc_to_text")
        if tok is None or not isinstance(template, str) or "{{" not in template:
            return
        docs = documents("task.data_files", self.data_files, FIELDS[self.lm_eval_task],
                         f"lm-eval task {self.lm_eval_task}")
        docs = docs[:self.limit] if self.limit else docs
        self.check_fit(tok, [apply_template(template, doc) for doc in docs], max_pos, model.name, "task.data_files")

    def check_fit(self, tok, prompts: list[str], max_pos: int, model: str, where: str) -> None:
        """ConfigError when the longest of ``prompts`` (as lm-eval encodes them) and ``max_gen_toks`` pass the
        ``max_pos`` positions lm-eval gives a request (past them it keeps only the prompt's last tokens)."""
        longest = max((self.prompt_tokens(tok, text) for text in prompts), default=0)
        check(longest + self.max_gen_toks <= max_pos,
              f"task.max_gen_toks={self.max_gen_toks} and the longest prompt of {where} ({longest} tokens) pass "
              f"model {model}'s {max_pos} positions (lm-eval would keep only the prompt's last "
              f"{max(max_pos - self.max_gen_toks, 0)} tokens); allowed: max_gen_toks <= {max_pos - longest}")

    def prompt_tokens(self, tok, text: str) -> int:
        """Tokens of one prompt as lm-eval encodes it: in the chat template (after the system prompt) where used."""
        if not self.chat_template:
            return len(tok(text, add_special_tokens=bool(self.add_bos_token)).input_ids)
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": text}]
        thinking = {} if self.thinking is None else {"enable_thinking": self.thinking}
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **thinking)
        return len(tok(text, add_special_tokens=False).input_ids)

    def check_data(self) -> None:
        """The hub data set a cluster run reads from the prefetched cache (none with a local ``data_files``)."""
        check_fetched(self.name, missing(self), f" (python -m h2o.pipeline.prefetch task={self.name} ...), on a "
                                                "machine with internet, or task.data_files=<a local JSON file of "
                                                "problems>")

    def tokens(self) -> int:
        """Prompt tokens plus generated tokens (x :data:`DECODE_COST`) of one run, for the time estimates: the
        problems x ``n`` samples x (a 200-token prompt + the answer's expected length, at most ``max_gen_toks``)."""
        problems = min(self.limit or PROBLEMS[self.lm_eval_task], PROBLEMS[self.lm_eval_task])
        answer = min(EXPECTED_TOKENS[self.lm_eval_task], self.max_gen_toks)
        return problems * self.n * (200 + DECODE_COST * answer)

    def hub_dataset(self) -> str:
        return TASKS[self.lm_eval_task][1]

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        cpu0 = time.process_time()
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from h2o.tasks.lm_eval_model import H2OLM
        from h2o.tasks.progress import lm_eval_cache

        thinking = {} if self.thinking is None else {"enable_thinking": self.thinking}
        lm = H2OLM(pretrained=model, tokenizer=tokenizer, policy=policy, quant=quant, batch_size=self.batch_size,
                   add_bos_token=self.add_bos_token, think_end_token=self.think_end_token, **thinking)
        lm.track_rows = True
        with tempfile.TemporaryDirectory(prefix="h2o-reasoning-") as tmp:
            where = stand_in(self.lm_eval_task, self.data_files, Path(tmp)) if self.data_files \
                else folder(self.lm_eval_task)
            tm = TaskManager(include_path=str(where), include_defaults=False)
            task = tm.load([self.lm_eval_task])["tasks"][self.lm_eval_task]
            task.set_config(key="repeats", value=self.n)
            docs = list(task.eval_docs)[:self.limit] if self.limit else list(task.eval_docs)
            self.check_fit(tokenizer, [task.doc_to_text(d) for d in docs], lm.max_length,  # the hub's data: known now
                           getattr(model, "name_or_path", None) or "loaded",
                           "task.data_files" if self.data_files else f"the data set {self.hub_dataset()}")
            with lm_eval_cache() as cache:
                out = simple_evaluate(model=lm, tasks=[task], limit=self.limit, log_samples=True,
                                      gen_kwargs=self.gen_kwargs(), apply_chat_template=self.chat_template,
                                      system_instruction=self.system_prompt, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                      use_cache=cache)
        samples, per_problem = self.samples(out["samples"][self.lm_eval_task], task, lm.generations)
        mean, se, half = interval(per_problem)
        metrics = {"pass_at_1": mean, "pass_at_1_stderr": se, "pass_at_1_ci95_low": mean - half,
                   "pass_at_1_ci95_high": mean + half}
        gen = [s["gen_tokens"] for s in samples if s["gen_tokens"] is not None]
        limit_hits = [s["at_limit"] for s in samples if s["at_limit"] is not None]
        info = {"headline": "pass_at_1", "lm_eval_task": self.lm_eval_task, "problems": len(per_problem),
                "samples_per_problem": self.n, "sampling": "greedy" if self.greedy else "sample",
                "scored_by": "/".join(TASKS[self.lm_eval_task][2]),
                "chat_template": self.chat_template, "system_prompt": self.system_prompt,
                "thinking": self.thinking, "think_end_token": self.think_end_token,
                "prompt_example": next(iter(out["samples"][self.lm_eval_task]), {}).get("arguments", [[None]])[0][0],
                "mean_gen_tokens": round(sum(gen) / len(gen), 1) if gen else None,
                "at_limit_share": round(sum(limit_hits) / len(limit_hits), 4) if limit_hits else None,
                **{f"mean_{k}": mean_of(samples, k) for k in ("kv_tokens_end", "kv_tokens_peak", "kv_bytes_peak")},
                "cpu_s": round(time.process_time() - cpu0, 1),
                **record(self.batch_size, [Sizing(self.batch_size, "fixed", f"task.batch_size={self.batch_size}")])}
        return Result(metrics, samples, info)

    def samples(self, logged: list[dict], task, generations: list[dict]) -> tuple[list[dict], list[float]]:
        """One record per (problem, sample): its answer, its score (the headline filter and metric) and every
        filter's, its generation's fields; and each problem's mean score."""
        from h2o.tasks.generation_rows import FIELDS

        head_filter, head_metric = TASKS[self.lm_eval_task][2]
        rows = {(g["doc_id"], g["repeat"]): g for g in generations}
        out, per_problem = [], []
        first = logged[0]["filter"] if logged else None
        for s in (x for x in logged if x["filter"] == first):  # one logged row per filter: each problem once
            answers = [r[0] if isinstance(r, list) else r for r in s["resps"][0]]
            scores = score_all(task, s["doc"], answers)
            heads = [sc.get(head_filter, {}).get(head_metric, 0.0) for sc in scores]
            per_problem.append(sum(heads) / len(heads))
            for k, (answer, sc, head) in enumerate(zip(answers, scores, heads)):
                row = rows.get((s["doc_id"], k), {})
                out.append({"doc_id": s["doc_id"], "sample": k, "target": s["target"], "generation": answer,
                            "score": head, "scores": sc, **{f: row.get(f) for f in FIELDS}})
        return out, per_problem


def check_sampling(prefix: str, values: dict) -> None:
    """ConfigError (one line) for a bad sampling value of ``values`` (those present): ``temperature`` a finite
    number >= 0, ``top_p`` in (0, 1], ``max_gen_toks`` an int >= 1. One rule for ``task.*`` (prefix ``task.``) and
    the lm-eval wrapper's ``--gen_kwargs`` (prefix ``--gen_kwargs ``)."""
    from h2o.core.validate import is_int, is_number

    if "temperature" in values:
        t = values["temperature"]
        check(is_number(t) and t >= 0, f"{prefix}temperature={t!r}: allowed: a number >= 0 (0: greedy)")
    if "top_p" in values:
        p = values["top_p"]
        check(is_number(p) and 0 < p <= 1, f"{prefix}top_p={p!r}: allowed: a number in (0, 1]")
    if "max_gen_toks" in values:
        m = values["max_gen_toks"]
        check(is_int(m) and m >= 1, f"{prefix}max_gen_toks={m!r}: allowed: an int >= 1")


def check_extra(lm_eval_task: str) -> None:
    """ConfigError when the task's scoring imports a module lm-eval installs only with an extra (:data:`EXTRAS`)
    and this environment lacks it (lm-eval would fail on the import after the model loaded)."""
    from importlib.util import find_spec

    module, extra = EXTRAS.get(lm_eval_task, (None, None))
    ok = [t for t in TASKS if t not in EXTRAS]
    check(module is None or find_spec(module) is not None,
          f"task.lm_eval_task={lm_eval_task}: its scoring needs {module}, from lm-eval's extra `pip install "
          f"'{extra}'`, which is not installed here; allowed: {', '.join(ok)} (or install the extra)")


def mean_of(samples: list[dict], key: str):
    values = [s[key] for s in samples if s.get(key) is not None]
    return round(sum(values) / len(values), 1) if values else None


def missing(task: ReasoningTask) -> str | None:
    """Why the task's hub data set is not in the local cache, or None (a local ``data_files``: nothing to fetch)."""
    from h2o.tasks.base import hub_data_cached

    if task.data_files or hub_data_cached(task.hub_dataset()):
        return None
    return f"hub data set {task.hub_dataset()} (lm-eval task {task.lm_eval_task}) is not in the Hugging Face cache"


def fetch(task: ReasoningTask) -> str:
    """Load the task once through lm-eval (which downloads its data set into the ``datasets`` cache)."""
    if task.data_files:
        return f"local {task.data_files}"
    from lm_eval.tasks import TaskManager

    TaskManager(include_path=str(folder(task.lm_eval_task)), include_defaults=False) \
        .load_task_or_group([task.lm_eval_task])
    return f"{task.hub_dataset()} (lm-eval task {task.lm_eval_task})"
