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
    """nltk.download replaced by a refusal (it would reach the network) while lm-eval's RULER modules import."""
    import nltk

    download = nltk.download
    nltk.download = lambda *a, **k: False
    try:
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
    _state.update(haystack=haystack, sentences=sentences)
    return {"haystack": haystack, "sentences": sentences}


@cache
def book_words(text: str) -> list[str]:
    """The book as lm-eval splits its essays: whitespace runs to one space (h2o.tasks.niah.book), split on spaces."""
    from h2o.tasks.niah import book

    return book(text).split(" ")


def from_env() -> dict:
    """:func:`use_haystack` with ``$H2O_RULER_HAYSTACK`` (default austen): the lm-eval command line's hook."""
    return use_haystack(os.environ.get(ENV, "austen") or "austen")
