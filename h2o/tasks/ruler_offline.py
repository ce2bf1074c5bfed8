"""lm-eval's RULER offline: ONE hook at the loader of its essay haystack.

lm-eval 0.4.13's ``ruler`` group builds every sample itself (no data set to download) except the haystack of its
essay tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): ``get_haystack("essay")`` in
``lm_eval/tasks/ruler/prepare_niah.py`` loads Paul Graham's essays from the hub (``baber/paul_graham_essays``;
``essays.py`` beside it scrapes the same essays from the web). :func:`use_haystack` replaces that one loader, in the
module and where ``niah_utils`` imported it, so that ``"essay"`` returns the words of one of the project's
public-domain books instead (h2o.assets.fetch; whitespace runs made one space and split on spaces, as lm-eval
splits the essays); the other haystacks (``repeat``, ``needle``) are untouched. ``haystack=essays`` leaves lm-eval
as it is (a cluster with the hub reachable).

The same hook makes the module importable offline: importing ``prepare_niah`` asks nltk to download its
``punkt_tab`` sentence model when it is not installed; the hook imports it with that download switched off and,
without ``punkt_tab``, splits the haystack's sentences with nltk's Punkt tokenizer with untrained parameters
(sentence ends at . ! ? before a space, minus nothing learnt: recorded as ``sentences``). Prompts are as lm-eval
builds them, no chat template. Needs ``wonderwords`` (pinned in pyproject.toml; lm-eval's ``ruler`` extra).

    python -m h2o.tasks.lm_eval_cli --model h2o --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2 \\
        --tasks niah_single_2 --metadata '{"max_seq_lengths": [1024], "tokenizer": "<path>"}' --limit 10
    (H2O_RULER_HAYSTACK=austen | moby_dick | essays; default austen)
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from functools import cache

HAYSTACKS = ("austen", "moby_dick", "essays")
ENV = "H2O_RULER_HAYSTACK"
_state: dict = {}  # what the installed hook does: {"haystack", "sentences"}


@contextmanager
def no_nltk_download():
    """nltk.download replaced by a refusal (it would reach the network) while lm-eval's RULER modules import;
    their stdout is dropped meanwhile (lm-eval prints "Downloaded punkt_tab" whatever the download did)."""
    import io
    from contextlib import redirect_stdout

    import nltk

    download = nltk.download
    nltk.download = lambda *a, **k: False
    try:
        with redirect_stdout(io.StringIO()):
            yield
    finally:
        nltk.download = download


def punkt_installed() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        return True
    except LookupError:
        return False


def use_haystack(haystack: str = "austen") -> dict:
    """Install the hook (idempotent; a second call may switch the book) -> what the record states:
    ``{"haystack": <name>, "sentences": "punkt_tab" | "punkt_untrained"}``."""
    if haystack not in HAYSTACKS:
        from h2o.core.validate import ConfigError

        raise ConfigError(f"haystack={haystack!r} (task.text or ${ENV}): allowed: {', '.join(HAYSTACKS)}")
    with no_nltk_download():
        from lm_eval.tasks.ruler import niah_utils, prepare_niah
    if "upstream" not in _state:
        _state["upstream"] = prepare_niah.get_haystack
        _state["sent_tokenize"] = prepare_niah.sent_tokenize
    upstream = _state["upstream"]
    sentences = "punkt_tab" if punkt_installed() else "punkt_untrained"
    if sentences == "punkt_untrained":
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        prepare_niah.sent_tokenize = PunktSentenceTokenizer().tokenize
    else:
        prepare_niah.sent_tokenize = _state["sent_tokenize"]
    prepare_niah.cached_sent_tokenize.cache_clear()
    if haystack == "essays":
        loader = upstream
    else:
        def loader(type_haystack):
            if type_haystack != "essay":
                return upstream(type_haystack)
            return book_words(haystack)
    prepare_niah.get_haystack = niah_utils.get_haystack = loader
    use_cached_qa()
    _state.update(haystack=haystack, sentences=sentences)
    return {"haystack": haystack, "sentences": sentences}


def qa_urls() -> dict[str, str]:
    """lm-eval's qa tasks -> the JSON file each downloads (the default ``url`` of its reader in ``qa_utils``)."""
    import inspect

    from lm_eval.tasks.ruler import qa_utils

    return {task: inspect.signature(reader).parameters["url"].default
            for task, reader in (("ruler_qa_squad", qa_utils.read_squad), ("ruler_qa_hotpot", qa_utils.read_hotpotqa))}


def qa_file(url: str):
    """Where the prefetched copy of ``url`` lives: ``<cache>/ruler/<file name>``."""
    from pathlib import Path
    from urllib.parse import urlparse

    from h2o.assets.paths import cache_dir

    return cache_dir() / "ruler" / Path(urlparse(url).path).name


def use_cached_qa() -> None:
    """lm-eval's qa tasks read their JSON from :func:`qa_file` when it is there (``make prefetch`` put it there:
    compute nodes are offline), else download it as lm-eval does."""
    import json

    from lm_eval.tasks.ruler import qa_utils

    if "download_json" not in _state:
        _state["download_json"] = qa_utils.download_json
    upstream = _state["download_json"]

    def download_json(url):
        f = qa_file(url)
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else upstream(url)

    qa_utils.download_json = download_json
    qa_utils.read_squad.cache_clear()
    qa_utils.read_hotpotqa.cache_clear()


def fetch_qa(task: str) -> str:
    """Download the JSON of qa task ``task`` into :func:`qa_file` (once; a machine with internet)."""
    import requests

    from h2o.store.files import atomic_write_text

    url = qa_urls()[task]
    f = qa_file(url)
    if not f.is_file():
        response = requests.get(url, timeout=300)
        response.raise_for_status()
        atomic_write_text(f, response.text)
    return f"{task}: {f} ({f.stat().st_size / 1e6:.1f} MB)"


@cache
def book_words(text: str) -> list[str]:
    """The book as lm-eval splits its essays: whitespace runs to one space (h2o.tasks.niah.book), split on spaces."""
    from h2o.tasks.niah import book

    return book(text).split(" ")


def from_env() -> dict:
    """:func:`use_haystack` with ``$H2O_RULER_HAYSTACK`` (default austen): the lm-eval command line's hook."""
    return use_haystack(os.environ.get(ENV, "austen") or "austen")


# lm-eval 0.4.13's niah_utils task functions: (haystack, key type, value type, keys, values per key, queries)
NIAH_SHAPES = {"niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
               "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
               "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
               "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
               "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
               "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
               "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
               "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4)}
#: RULER's split tasks (tasks/niah_*_questions.yaml: one question per needle, h2o.tasks.ruler_many) -> their source
SPLIT_SOURCES = {"niah_multikey_1_questions": "niah_multikey_1", "niah_multiquery_questions": "niah_multiquery"}
QA_TASKS = ("ruler_qa_squad", "ruler_qa_hotpot")
SIZED_WITH = {"niah": 128, "qa": 32}  # the generated tokens lm-eval sizes its samples with (its defaults)


def shortest_length(tok, lm_eval_task: str, haystack: str = "austen") -> int | None:
    """A lower bound of the ``max_seq_length`` at which lm-eval can build any sample of ``lm_eval_task`` with
    tokenizer ``tok`` (below it lm-eval fails, after the model has loaded): niah tasks, lm-eval's own prompt (its
    ``generate_input_output``) around the smallest haystack it tries (one unit per needle) with empty keys and
    values, plus the tokens it sizes generation with; qa tasks, the template without documents plus those tokens
    (the gold documents need more: lm-eval skips the samples whose documents do not fit); None for other tasks."""
    import random

    if lm_eval_task in QA_TASKS:
        from lm_eval.tasks.ruler import qa_utils

        return len(tok(qa_utils.TEMPLATE.format(context="", query="")).input_ids) + SIZED_WITH["qa"]
    if lm_eval_task not in NIAH_SHAPES:
        return None
    use_haystack(haystack)  # imports lm-eval's module offline; its sentence splitter with or without punkt_tab
    from lm_eval.tasks.ruler import niah_utils, prepare_niah

    kind, key_type, value_type, keys, values, queries = NIAH_SHAPES[lm_eval_task]
    needles = max(keys, queries) * values
    units = ["the"] * needles if kind == "essay" else prepare_niah.get_haystack(kind)
    state, draw = random.getstate(), prepare_niah.generate_random  # lm-eval draws from the module-level generator
    prepare_niah.generate_random = lambda kind: ""  # any key or value only adds tokens
    try:
        text, _, _ = prepare_niah.generate_input_output(
            needles, units, type_haystack=kind, num_needle_k=max(keys, queries), type_needle_k=key_type,
            num_needle_v=values, type_needle_v=value_type, template=niah_utils.TEMPLATE, num_needle_q=queries)
    finally:
        prepare_niah.generate_random = draw
        random.setstate(state)
    return len(tok(text).input_ids) + SIZED_WITH["niah"]
