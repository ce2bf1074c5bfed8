"""What each long-context task reads at run time, whether this machine has it, and how ``make prefetch`` gets it
(on a machine with internet: compute nodes run with the hub offline, h2o.pipeline.launch).

* ``niah``: its book (``text``: Austen or Moby-Dick, Debian packages, h2o.assets.fetch).
* RULER's essay tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): the book, and
  lm-eval's own haystack, Paul Graham's essays (hub data set ``baber/paul_graham_essays``: needed with
  ``text=essays``, fetched in any case so a cluster can switch), and nltk's ``punkt_tab`` sentence model (without
  it the haystack is split by nltk's untrained Punkt, recorded as ``sentences``: optional).
* RULER's noise-haystack tasks (niah_single_1, niah_multikey_2/3): nothing.
* RULER's qa tasks (ruler_qa_squad, ruler_qa_hotpot): the JSON file lm-eval downloads (SQuAD 2.0 dev, HotpotQA dev
  distractor), kept in ``<cache>/ruler/`` and read from there (h2o.tasks.ruler_offline.use_cached_qa).
* LongBench (lm-eval's ``longbench_*`` tasks): the task's subset of the hub data set ``Xnhyacinth/LongBench``,
  loaded once by lm-eval's TaskManager into the ``datasets`` cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from h2o.tasks.ruler_offline import NIAH_SHAPES, QA_TASKS

ESSAYS = "baber/paul_graham_essays"
LONGBENCH = "Xnhyacinth/LongBench"


@dataclass
class Asset:
    what: str  # one line: the data set and where it lives
    cached: Callable[[], bool]
    fetch: Callable[[], str]
    needed: bool = True  # False: the run works without it (recorded), only fetched for fidelity


def book(text: str) -> Asset:
    from h2o.assets import fetch
    from h2o.assets.paths import cache_dir

    path = cache_dir() / "books" / f"{text}.txt"
    get = fetch.fetch_austen if text == "austen" else fetch.fetch_moby_dick
    return Asset(f"book {text} ({path})", path.exists, lambda: str(get()))


def essays(needed: bool) -> Asset:
    from h2o.tasks.base import hub_data_cached

    def get() -> str:
        import datasets

        return f"{ESSAYS}: {len(datasets.load_dataset(ESSAYS, split='train'))} essays"

    return Asset(f"RULER's essays (hub data set {ESSAYS})", lambda: hub_data_cached(ESSAYS), get, needed)


def punkt() -> Asset:
    from h2o.tasks.ruler_offline import punkt_installed

    def get() -> str:
        import nltk

        nltk.download("punkt_tab", quiet=True)
        return "nltk punkt_tab"

    return Asset("nltk's punkt_tab sentence model (else nltk's untrained Punkt splits the essays)",
                 punkt_installed, get, needed=False)


def qa(task: str) -> Asset:
    from h2o.tasks.ruler_offline import fetch_qa, qa_file, qa_urls

    url = qa_urls()[task]
    return Asset(f"{task}'s JSON ({url} -> {qa_file(url)})", qa_file(url).is_file, lambda: fetch_qa(task))


def longbench(task) -> Asset:
    from h2o.tasks.base import hub_data_cached

    def get() -> str:
        from lm_eval.tasks import TaskManager

        tm = TaskManager(include_path=str(task.lm_eval_folder()), include_defaults=False)
        tm.load_task_or_group([task.lm_eval_task])
        return f"{LONGBENCH} ({task.lm_eval_task})"

    return Asset(f"{task.lm_eval_task}'s data (hub data set {LONGBENCH})", lambda: hub_data_cached(LONGBENCH), get)


def assets(task) -> list[Asset]:
    """What a long-context task (h2o.tasks.long_context.LongContextTask) reads at run time."""
    if task.is_niah:
        return [book(task.text)]
    if task.family == "longbench":
        return [longbench(task)]
    if task.lm_eval_task in QA_TASKS:
        return [qa(task.lm_eval_task)]
    if NIAH_SHAPES.get(task.lm_eval_task, ("",))[0] == "essay":
        return [*([book(task.text)] if task.text != "essays" else []), essays(task.text == "essays"), punkt()]
    return []


def missing(task) -> str | None:
    """Why the task cannot run offline here (a needed asset not on this machine), or None."""
    lost = [a.what for a in assets(task) if a.needed and not a.cached()]
    return f"not on this machine: {'; '.join(lost)}" if lost else None


def not_fetched(task) -> list[str]:
    """The needed assets of the task that are not on this machine and that a run does not fetch itself (all but
    the books: h2o.assets.fetch gets those at run time): what ``make prefetch`` must fetch first."""
    return [a.what for a in assets(task) if a.needed and not a.what.startswith("book ") and not a.cached()]


def fetch(task) -> str:
    """Fetch every asset of the task (those already here are only checked); one line of what it has."""
    return "; ".join(a.fetch() if not a.cached() else f"{a.what}: cached" for a in assets(task)) or "nothing to fetch"
