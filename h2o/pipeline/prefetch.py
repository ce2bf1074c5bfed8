"""``make prefetch EXP=...``: fetch every model and data set an experiment needs into the caches, on a machine
with internet (the login node), so that array tasks run with the hub offline.

    python -m h2o.pipeline.prefetch experiment=table1          # models (safetensors when the repo has them) + data
    python -m h2o.pipeline.prefetch experiment=table1 --check  # only say what is missing (exit 1 if anything)

Models: hub ids go to the Hugging Face cache (``huggingface_hub.snapshot_download``: weights, config, tokenizer;
``*.bin`` skipped where the repo has ``*.safetensors``); packaged models (``smollm2-135m``, ``gemma3-270m``) and
``tiny:<arch>`` to the harness cache.
Data: lm-eval tasks are built once by lm-eval's TaskManager (which downloads their data sets with ``datasets``),
summarization tasks load their splits, perplexity tasks their book, long-context tasks what
h2o.tasks.long_context_data lists (books, RULER's essays, punkt_tab and qa files, LongBench's data), reasoning tasks
their lm-eval task's hub data set (h2o.tasks.reasoning), SCBench its subset's file (h2o.tasks.scbench). The
launcher calls :func:`missing_model` / :func:`missing_data` before it submits: a missing asset fails there, in one
line.
"""
from __future__ import annotations

import sys
from pathlib import Path

from h2o.assets.model_spec import ModelSpec
from h2o.assets.packaged import is_checkpoint, packaged, packaged_dir, packaged_path
from h2o.pipeline.sweep import BAD_INPUT, expand, split_args

WEIGHTS = ("*.safetensors", "*.bin")
KEEP = ("*.json", "*.model", "*.txt", "*.py", "*.tiktoken")  # config, tokenizer, generation config


def hub_id(spec: ModelSpec) -> str | None:
    """The hub repository of a model, or None (a packaged model, tiny:<arch>, a local folder)."""
    name = str(spec.pretrained)
    if name.startswith("tiny:") or packaged(name) or Path(name).expanduser().exists():
        return None
    return name if name.count("/") == 1 and not name.startswith((".", "/", "~")) else None


def missing_model(spec: ModelSpec) -> str | None:
    """Why the model cannot be loaded offline, or None."""
    name = str(spec.pretrained)
    if packaged(name):
        folder = packaged_dir(packaged(name))
        return None if is_checkpoint(folder) else f"{name} is not in {folder}"
    repo = hub_id(spec)
    if repo is None:
        return None if name.startswith("tiny:") or Path(name).expanduser().is_dir() else f"no folder {name}"
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return f"{repo} is not in the Hugging Face cache"
    return None


def missing_data(task) -> str | None:
    """Why a task's hub data set is not in the local cache, or None (offline tasks are fetched by the task)."""
    from h2o.tasks.base import hub_data_cached

    if task.kind == "retrieval":  # long-context tasks: books, RULER's essays and qa files, LongBench
        from h2o.tasks.long_context_data import missing

        return missing(task)
    if task.kind == "reasoning":  # lm-eval's AIME, GSM8K, MATH-500: their hub data sets
        from h2o.tasks.reasoning import missing as missing_reasoning

        return missing_reasoning(task)
    if task.kind == "shared_context":  # SCBench's subset files
        from h2o.tasks.scbench import missing as missing_scbench

        return missing_scbench(task)
    name = getattr(task, "lm_eval_task", None)
    if name and getattr(task, "include_path", None) is None and not hub_data_cached(name):
        return f"the data of lm-eval task {name} are not in the Hugging Face cache"
    return None


def fetch_model(spec: ModelSpec) -> str:
    repo = hub_id(spec)
    if repo is None:
        from h2o.assets.model_spec import resolve_tiny

        pkg = packaged(spec.pretrained)
        return str(packaged_path(pkg) if pkg else resolve_tiny(spec.pretrained))
    from huggingface_hub import list_repo_files, snapshot_download

    files = list_repo_files(repo)
    weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
    return snapshot_download(repo, allow_patterns=[*KEEP, *weights])


def fetch_data(task) -> str:
    kind = task.kind
    if kind == "multiple_choice":
        from lm_eval.tasks import TaskManager

        from h2o.tasks.multiple_choice import task_folder

        tm = (TaskManager(include_path=str(task_folder(task.include_path)), include_defaults=False)
              if task.include_path else TaskManager())
        tm.load_task_or_group([task.lm_eval_task])
        return f"lm-eval task {task.lm_eval_task}"
    if kind == "summarization":
        shots, test = task.examples()
        return f"{task.dataset}: {len(shots)} shots, {len(test)} test articles"
    if kind == "perplexity":
        from h2o.tasks.perplexity import book

        return f"{task.text}: {len(book(task.text))} characters"
    if kind == "retrieval":
        from h2o.tasks.long_context_data import fetch

        return fetch(task)
    if kind == "reasoning":
        from h2o.tasks.reasoning import fetch as fetch_reasoning

        return fetch_reasoning(task)
    if kind == "shared_context":
        from h2o.tasks.scbench import fetch as fetch_scbench

        return fetch_scbench(task)
    return "nothing to fetch"


def data_name(task) -> str:
    """A task by the data it reads: its name, and its subset where it has several (SCBench's files)."""
    subset = getattr(task, "subset", None)
    return f"{task.name} ({subset})" if subset else task.name


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in argv
    try:
        sweep = expand(split_args(argv)[2], multirun=True)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    models = {p.model.name: p.model for p in sweep.specs}
    tasks = {data_name(p.task): p.task for p in sweep.specs}
    missing = 0
    for kind, items, why_missing, fetch, cached in (
            ("model", models, missing_model, fetch_model, "cached"),
            ("task", tasks, missing_data, fetch_data, "cached (or fetched by the task itself)")):
        for name, spec in items.items():
            if check:
                why = why_missing(spec)
                missing += why is not None
                print(f"{kind} {name}: {why or cached}")
            else:
                print(f"{kind} {name}: {fetch(spec)}", flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
