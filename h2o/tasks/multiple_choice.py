"""Multiple-choice tasks through lm-eval (``conf/task/{copa,...,bb_copa,...}.yaml``).

lm-eval builds the few-shot prompts and scores every choice by its log-likelihood; the model is
:class:`h2o.tasks.lm_eval_model.H2OLM` around the already loaded model, so each forward pass runs under the policy's
simulated mask (budget = ratio of each request's length). Offline tasks load from ``include_path`` with
``TaskManager(include_path, include_defaults=False)`` (instant); lm-eval's own tasks index the built-in
catalogue (~10 s) and fetch their data with ``datasets``.

Both accuracies from one forward pass: lm-eval scores the summed log-likelihood (``acc``; ``acc_norm`` divides by
the continuation's bytes); from the same log-likelihoods and each continuation's token count this module adds
``acc_mean`` (+ ``acc_mean_stderr``), the paper code's per-token average. ``scoring`` (mean | sum) names the
headline accuracy of the run (``acc_mean`` | ``acc``) and is recorded; it changes no computation.
BOS: ``add_bos_token=false`` (default) encodes without special tokens, as the paper code
(``tokenizer(prompt, add_special_tokens=False)``); ``null`` is lm-eval's default, i.e. the tokenizer's, which adds
BOS for LLaMA and OPT (an attention sink that local evicts and H2O keeps).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from h2o.assets.model_spec import ConfigError
from h2o.assets.paths import REPO, TASKS
from h2o.cli.paths import abbrev, path_error
from h2o.tasks.base import Result, TaskSpec, adds_bos, as_run, check, check_hub_data, positive_or_none, stderr
from h2o.tasks.batching import BatchSize, Sizing, check_batch_size, record

METRICS = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
HEADLINE = {"mean": "acc_mean", "sum": "acc"}  # scoring -> the accuracy it names


def task_folder(include_path: str) -> Path:
    """``include_path`` as given if it exists, else relative to the repository root (``tasks``: the shipped task
    YAMLs, also from a wheel)."""
    path = Path(include_path).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return TASKS if path == Path("tasks") else REPO / path


def yaml_task_names(folder: Path) -> list[str]:
    """``task:`` names declared by the YAML files of a folder (a cheap scan, no YAML parsing)."""
    names = []
    for f in sorted(folder.glob("*.yaml")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.startswith("task:"):
                names.append(line.split(":", 1)[1].strip().strip("'\""))
    return names


def check_yaml(folder: Path) -> None:
    """ConfigError naming the first task YAML of ``folder`` that does not parse (lm-eval's ``!function`` tags
    and the like are accepted as plain values)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, tag, node: None)
    for f in sorted([*folder.glob("*.yaml"), *folder.glob("*_yaml")]):
        try:
            yaml.load(f.read_text(encoding="utf-8"), Loader=Loader)
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"task.include_path={str(folder)!r}: {f.name}{at} is not valid YAML "
                              f"({getattr(exc, 'problem', None) or type(exc).__name__}); expected lm-eval task YAMLs") from None


def offline_train_rows(task: str) -> int | None:
    """Rows of an offline task's train split (the few-shot pool), converted into the cache first if it is not
    there yet (a registry fetch, cheap beside loading a model); None if ``task`` is not one of the offline tasks."""
    from h2o.assets.data import TASKS, task_rows

    return len(task_rows(task, "train")) if task in TASKS else None


@dataclass
class LmEvalTask(TaskSpec):
    name: str
    lm_eval_task: str
    include_path: str | None = None
    shots: int = 5
    limit: int | None = None
    batch_size: BatchSize = 1  # or auto, auto:N (lm-eval's spelling; sized by h2o.tasks.batching)
    scoring: str = "mean"
    add_bos_token: bool | None = False

    kind = "multiple_choice"
    semantics = ("simulated", "reference")
    quantizes = True

    def __post_init__(self):
        check(isinstance(self.shots, int) and self.shots >= 0, f"task.shots={self.shots!r}: expected an int >= 0")
        positive_or_none("task.limit", self.limit)
        check_batch_size(self.batch_size, schedule=True)
        check(self.scoring in HEADLINE, f"task.scoring={self.scoring!r}: allowed: {', '.join(HEADLINE)}")
        check(self.add_bos_token in (None, True, False),
              f"task.add_bos_token={self.add_bos_token!r}: allowed: true, false, null (the tokenizer's default)")
        if self.include_path is not None:
            why = path_error(self.include_path) if isinstance(self.include_path, str) else "not a path"
            check(why is None, f"task.include_path={abbrev(self.include_path)}: {why}; expected a folder of task YAMLs")
            folder = task_folder(self.include_path)
            check(folder.is_dir(), f"task.include_path={self.include_path!r}: no such folder")
            names = yaml_task_names(folder)
            check(self.lm_eval_task in names, f"task.lm_eval_task={self.lm_eval_task!r}: not in {folder}; "
                                              f"allowed: {', '.join(names)}")
            check_yaml(folder)
            n_train = offline_train_rows(self.lm_eval_task)
            check(n_train is None or self.shots <= n_train, f"task.shots={self.shots}: task {self.lm_eval_task} has "
                                                            f"{n_train} train examples (the few-shot pool); allowed: 0-{n_train}")
        else:
            check(self.lm_eval_task not in yaml_task_names(TASKS),
                  f"task.include_path=null: {self.lm_eval_task} is a task of this project (tasks/), not one of "
                  f"lm-eval's built-in tasks; allowed: task.include_path=tasks")
            check_hub_data(self.name, f"lm-eval task {self.lm_eval_task}", (self.lm_eval_task,))

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from h2o.tasks.lm_eval_model import H2OLM
        from h2o.tasks.progress import lm_eval_cache

        lm = H2OLM(pretrained=model, tokenizer=tokenizer, policy=as_run(policy, semantics), quant=quant,
                   scoring="sum", batch_size=self.batch_size, add_bos_token=self.add_bos_token)
        tm = (TaskManager(include_path=str(task_folder(self.include_path)), include_defaults=False)
              if self.include_path else TaskManager())
        with lm_eval_cache() as cache:  # per-request results appended as they come: a requeued run resumes
            out = simple_evaluate(model=lm, tasks=[self.lm_eval_task], num_fewshot=self.shots, limit=self.limit,
                                  task_manager=tm, log_samples=True, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed, use_cache=cache)
        res = out["results"][self.lm_eval_task]
        metrics = {m: float(res[f"{m},none"]) for m in METRICS if res.get(f"{m},none") not in (None, "N/A")}
        samples = [sample_row(s, lm.n_cont_tokens) for s in out["samples"][self.lm_eval_task]]
        metrics.update(mean_accuracy(samples))
        stats = lm.row_stats()  # every scored row, those before an interruption included
        info = {"mean_seq_len": round(stats["tokens"] / max(stats["rows"], 1), 1),
                "clamped_requests": stats["clamped"],
                "headline": HEADLINE[self.scoring], "lm_eval_task": self.lm_eval_task,
                **record(self.batch_size, lm.sizings if isinstance(self.batch_size, str) else
                         [Sizing(self.batch_size, "fixed", f"task.batch_size={self.batch_size}")])}
        return Result(metrics, samples, info)

    def add_bos(self, tokenizer) -> bool:
        return adds_bos(tokenizer, self.add_bos_token)


def argmax(values: list[float]) -> int | None:
    return max(range(len(values)), key=values.__getitem__) if values else None


def sample_row(s: dict, n_cont_tokens) -> dict:
    """One lm-eval sample -> {"doc_id", "target", "loglikelihoods" (summed), "cont_tokens", "pred", "acc",
    "acc_norm", "pred_mean", "acc_mean"} (``*_mean``: the per-token average rule on the same log-likelihoods)."""
    lls = [float(r[0]) for r in s["filtered_resps"]]
    counts = [n_cont_tokens(*a[:2]) for a in s["arguments"]]  # (context, continuation) -> tokens
    means = [ll / max(n, 1) for ll, n in zip(lls, counts)]
    pred_mean = argmax(means)
    return {"doc_id": s["doc_id"], "target": s["target"], "loglikelihoods": lls, "cont_tokens": counts,
            "pred": argmax(lls), "acc": s.get("acc"), "acc_norm": s.get("acc_norm"), "pred_mean": pred_mean,
            "acc_mean": float(pred_mean == int(s["target"])) if pred_mean is not None else None}


def mean_accuracy(samples: list[dict]) -> dict[str, float]:
    """``acc_mean`` and its standard error (as lm-eval's mean_stderr: sample standard deviation / sqrt(n))."""
    hits = [s["acc_mean"] for s in samples if s["acc_mean"] is not None]
    return {"acc_mean": sum(hits) / len(hits), "acc_mean_stderr": stderr(hits)} if hits else {}
