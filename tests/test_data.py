"""Offline data: the R lazy-load reader, splits, fetching errors, converters and lm-eval tasks.

BIG-bench's tasks are read from the suite's stand-ins (tests/bigbench_standins.py, named in H2O_BIGBENCH by
conftest): counts come from them. The tests of the real files' contents take the ``real_bigbench`` fixture and skip
(one line) where the files are absent. Tests marked ``slow`` fetch Austen and Moby-Dick into the cache folder on
first use (the Debian archive once); afterwards they run offline in a few seconds.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from h2o.assets import data, fetch
from h2o.assets.r_data import read_rdb
from h2o.assets.paths import cache_dir
from tests import bigbench_standins as standins

REPO = Path(__file__).resolve().parents[1]
MC_TASKS = ("bb_copa", "bb_mathqa", "bb_piqa", "bb_entailment")


# --- a tiny R serializer, written from R's serialize.c, to build test blobs by hand ----------


def _ints(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def _char(s: str | None, latin1: bool = False) -> bytes:
    if s is None:
        return _ints(9, -1)
    raw = s.encode("latin-1" if latin1 else "utf-8")
    levels = 4 if latin1 else 8  # LATIN1_MASK / UTF8_MASK, stored in flags >> 12
    return _ints(9 | (levels << 12), len(raw)) + raw


def _strsxp(items, attrs: bytes = b"") -> bytes:
    flags = 16 | ((1 << 9) if attrs else 0)
    return _ints(flags, len(items)) + b"".join(_char(s) for s in items) + attrs


def _names_attr(names, first_use: bool = True) -> bytes:
    """Attribute pairlist ``names = c(...)``; the symbol is a back-reference after its first use."""
    tag = _ints(1) + _char("names") if first_use else _ints(255 | (1 << 8))  # SYMSXP or REFSXP #1
    return _ints(2 | (1 << 10)) + tag + _strsxp(names) + _ints(254)


def _header(version: int = 3) -> bytes:
    head = b"X\n" + _ints(version, 0x040201, 0x030500)
    return head + (_ints(5) + b"UTF-8" if version == 3 else b"")


def _record(payload: bytes) -> bytes:
    """One lazy-load database record: 4-byte big-endian length, then the zlib stream."""
    return struct.pack(">I", len(payload)) + zlib.compress(payload)


# --- the reader ------------------------------------------------------------------------------


def test_read_rdb_lazy_load_database(tmp_path):
    objs = {"emma": ["EMMA", "", "By Jane Austen"], "persuasion": ["Persuasion", None]}
    rdb, index = b"", {}
    for name, lines in objs.items():
        rec = _record(_header() + _strsxp(lines))
        index[name] = (len(rdb), len(rec))
        rdb += rec
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    variables = _ints(19 | (1 << 9), len(index)) + b"".join(_ints(13, 2, *v) for v in index.values())
    variables += _names_attr(list(index))
    rdx = (_header() + _ints(19 | (1 << 9), 3) + variables + _ints(19, 0) + _ints(10, 1, 1)
           + _names_attr(["variables", "references", "compressed"], first_use=False))
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(rdx))
    out = read_rdb(tmp_path / "Rdata.rdb")
    assert out == {"emma": ["EMMA", "", "By Jane Austen"], "persuasion": ["Persuasion", None]}
    assert fetch._lines_to_text(out["persuasion"]) == "Persuasion\n"


# --- splits, paths, errors -----------------------------------------------------------------


def test_split_rows_is_deterministic_and_keeps_groups_together():
    rows = [{"id": i, "group": f"g{i // 3}"} for i in range(30)]  # 10 groups of 3
    a, b = data.split_rows(rows, 4), data.split_rows(rows, 4)
    assert a == b
    assert len(a["train"]) == 12 and len(a["test"]) == 18
    train_groups = {r["group"] for r in a["train"]}
    assert train_groups.isdisjoint({r["group"] for r in a["test"]})
    assert [r["id"] for r in a["train"]] == sorted(r["id"] for r in a["train"])  # original order kept
    assert data.split_rows(rows, 4, seed=7)["train"] != a["train"]


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_failed_bigbench_download_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    monkeypatch.delenv(fetch.BIGBENCH_ENV)  # no folder named: the cache, then the index
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index, no links: pip cannot find the package
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_bigbench()
    msg = str(err.value)
    assert "\n" not in msg and "bigbench==1.0.0" in msg and "H2O_BIGBENCH=<dir>" in msg
    assert "gem/xsum" in msg and "task=copa" in msg  # the files it expects, and the cluster's path
    assert not list(tmp_path.glob(".tmp-*"))  # temporary files are cleaned up


@pytest.mark.parametrize("stderr, says", [
    ("ERROR: Could not find a version that satisfies the requirement bigbench==1.0.0 (from versions: 0.0.1)\n"
     "ERROR: No matching distribution found for bigbench==1.0.0", "no longer offers bigbench==1.0.0 (it offers 0.0.1)"),
    ("WARNING: Retrying (Retry(total=4...)) after connection broken by 'NewConnectionError(...)'\n"
     "ERROR: Could not find a version that satisfies the requirement bigbench==1.0.0 (from versions: none)",
     "could not be reached"),
    ("ERROR: Could not find a version that satisfies the requirement bigbench==1.0.0 (from versions: none)",
     "does not offer bigbench==1.0.0"),
])
def test_pip_refusal_tells_a_vanished_version_from_an_unreachable_index(stderr, says):
    assert says in fetch.pip_refusal("bigbench==1.0.0", stderr)


def test_named_bigbench_folder_is_read_in_place_and_checked(tmp_path, monkeypatch):
    root = standins.write(tmp_path / "bb")
    monkeypatch.setenv(fetch.BIGBENCH_ENV, str(root))
    assert fetch.bigbench_dir() == root
    assert len(fetch.bigbench_task("winowhy")["examples"]) == standins.SIZES["winowhy"]
    (root / "winowhy" / "task.json").unlink()
    with pytest.raises(fetch.FetchError) as err:
        fetch.bigbench_dir()
    msg = str(err.value)
    assert "\n" not in msg and f"H2O_BIGBENCH={root}: no winowhy/task.json there" in msg


def test_conversions_of_other_files_never_stand_in_for_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    first, second = standins.write(tmp_path / "a"), standins.write(tmp_path / "b")
    monkeypatch.setenv(fetch.BIGBENCH_ENV, str(first))
    rows = data.task_rows("bb_piqa", "train") + data.task_rows("bb_piqa", "test")
    assert fetch.bigbench_digest(first) == fetch.bigbench_digest(second)  # same bytes, one conversion
    monkeypatch.setenv(fetch.BIGBENCH_ENV, str(second))
    assert data.task_rows("bb_piqa", "train") + data.task_rows("bb_piqa", "test") == rows
    third = standins.write(tmp_path / "c")
    task = json.loads((third / "physical_intuition" / "task.json").read_text())
    task["examples"] = task["examples"][:-1]
    (third / "physical_intuition" / "task.json").write_text(json.dumps(task))
    monkeypatch.setenv(fetch.BIGBENCH_ENV, str(third))
    assert len(data.task_rows("bb_piqa", "train") + data.task_rows("bb_piqa", "test")) == len(rows) - 1
    assert len(list((tmp_path / "cache" / "lm_eval" / data.LM_EVAL_FORMAT).iterdir())) == 2


def test_the_bigbench_digest_reads_a_folder_once_and_bigbench_here_is_the_one_lookup(tmp_path, monkeypatch):
    """The digest a conversion's folder is named by is computed once per folder (no stat nor read per task_rows
    call); the folder is found by one rule, ``bigbench_here``, that bigbench_dir, ``make sources`` and the tests'
    real_bigbench fixture share."""
    from h2o.assets import sources

    root = standins.write(tmp_path / "bb")
    touched = []
    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", lambda self, real=Path.read_bytes: touched.append(self.parent.name) or real(self))
        first = fetch.bigbench_digest(root)
        assert sorted(touched) == sorted(t.split("/")[-1] for t in fetch.BIGBENCH_TASKS)  # each file read once
        m.setattr(Path, "stat", lambda self, **kw: touched.append(self) or os.stat(self, **kw))
        assert [fetch.bigbench_digest(root) for _ in range(3)] == [first] * 3 and len(touched) == 8
    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(fetch.BIGBENCH_ENV)
    assert fetch.bigbench_here() == (tmp_path / "cache" / "bigbench", list(fetch.BIGBENCH_TASKS))
    assert sources._bigbench_here() == "no"
    standins.write(tmp_path / "cache" / "bigbench")
    assert fetch.bigbench_here() == (tmp_path / "cache" / "bigbench", []) and fetch.bigbench_dir() == tmp_path / \
        "cache" / "bigbench"
    assert sources._bigbench_here() == str(tmp_path / "cache" / "bigbench")
    monkeypatch.setenv(fetch.BIGBENCH_ENV, str(root))
    assert fetch.bigbench_here() == (root, []) and sources._bigbench_here() == f"H2O_BIGBENCH={root}"
    (root / "winowhy" / "task.json").unlink()
    assert fetch.bigbench_here() == (root, ["winowhy"]) == fetch.bigbench_here(str(root))
    assert sources._bigbench_here() == "no (H2O_BIGBENCH lacks winowhy)"
    assert fetch.bigbench_here("")[0] == tmp_path / "cache" / "bigbench"  # conftest: no user folder named

def test_missing_apt_get_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get on PATH
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_austen()
    msg = str(err.value)
    assert "\n" not in msg and "r-cran-janeaustenr" in msg and "apt-get" in msg


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown BIG-bench task"):
        fetch.bigbench_task("not_a_task")
    with pytest.raises(ValueError, match="unknown offline task"):
        data.write_task("bb_nope")


# --- data fetched once into the cache (Austen, Moby-Dick) and BIG-bench's stand-ins ---------------------


@pytest.fixture(scope="module")
def fetched():
    return data.fetch_all()


@pytest.mark.slow
def test_fetch_all_is_idempotent_and_fast_the_second_time(fetched):
    # fast: the second call fetches and writes nothing (no file it returns, or below a folder it returns, is created
    # or rewritten), which a wall-clock limit would check only on an idle machine
    def stamps() -> dict:
        files = [f for p in fetched.values() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
        return {f: f.stat().st_mtime_ns for f in files}

    before = stamps()
    again = data.fetch_all()
    assert stamps() == before
    assert again == fetched
    for task in fetch.BIGBENCH_TASKS:
        assert (fetched["bigbench"] / task / "task.json").exists()
    assert not list(cache_dir().glob(".tmp-*"))


@pytest.mark.slow
def test_austen_novels(fetched):
    novels = fetch.austen_novels()
    assert list(novels) == list(fetch.AUSTEN_TITLES.values())
    assert "It is a truth universally acknowledged" in novels["Pride and Prejudice"]
    assert novels["Emma"].startswith("EMMA")
    text = fetch.austen_text()
    assert 700_000 < len(text.split()) < 740_000  # about 718k words
    assert all(n.strip() in text for n in novels.values())
    # byte-identical to the text the project's earlier hand-written R parser produced (digest recorded from it)
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "32432b75ad045648fc586b923f9d38cddee6ecfa14cfe8968b9a028c36a19c23")


@pytest.mark.slow
def test_moby_dick(fetched):
    text = fetch.moby_dick()
    assert "Call me Ishmael." in text
    assert "\r" not in text and "PROJECT GUTENBERG EBOOK" not in text
    assert 200_000 < len(text.split()) < 220_000
    assert hashlib.sha256(text.encode()).hexdigest() == (  # as the earlier hand-written parser produced
        "858be2f546e087411d09f4f566dccd8ade5756e01a8e6454fa84e59ef4d50527")


def check_multiple_choice(task: str, n_train: int, n_test: int, n_choices: set[int]) -> None:
    train, test = data.task_rows(task, "train"), data.task_rows(task, "test")
    assert (len(train), len(test)) == (n_train, n_test)
    assert {r["group"] for r in train}.isdisjoint(r["group"] for r in test)
    for row in train + test:
        assert set(row) == {"id", "group", "query", "choices", "gold", "source"}
        assert len(row["choices"]) in n_choices and all(c.strip() for c in row["choices"])
        assert 0 <= row["gold"] < len(row["choices"])
        assert row["source"].startswith("bigbench/")
    assert len({r["id"] for r in train + test}) == n_train + n_test


def _standin_groups(task: str) -> tuple[int, int]:
    """(train rows, test rows) the split must give on the stand-ins: from their sizes and the groups they write."""
    sizes = standins.SIZES
    per_group, rows = {"bb_copa": (2, 2 * sizes["cause_and_effect/one_sentence"]),
                       "bb_mathqa": (1, sizes["elementary_math_qa/question_only"]),
                       "bb_piqa": (1, sizes["physical_intuition"]),
                       "bb_entailment": (2, sizes["presuppositions_as_nli"]),
                       "bb_analytic_entailment": (1, sizes["analytic_entailment"]),
                       "bb_winowhy": (2, sizes["winowhy"])}[task]
    n_train = data.TASKS[task][1] * per_group
    return n_train, rows - n_train


@pytest.mark.parametrize("task, n_choices", [
    ("bb_copa", {2}), ("bb_mathqa", {3, 4, 5, 6}), ("bb_piqa", {2, 3, 4, 5}), ("bb_entailment", {3}),
    ("bb_analytic_entailment", {2}), ("bb_winowhy", {2})])
def test_multiple_choice_conversions(task, n_choices):
    check_multiple_choice(task, *_standin_groups(task), n_choices)


def test_copa_and_entailment_contents():
    rows = data.task_rows("bb_copa", "train") + data.task_rows("bb_copa", "test")
    first = next(r for r in rows if r["id"] == "one_sentence-0")
    right = next(iter(standins.examples("cause_and_effect/one_sentence")[0]["target_scores"]))
    assert first["choices"][first["gold"]] == right and first["gold"] == 0  # pair 0 keeps BIG-bench's order
    assert first["query"].endswith("\nAnswer:") and first["choices"][0] in first["query"]
    odd = next(r for r in rows if r["id"] == "two_sentences-1")
    assert odd["gold"] == 1  # odd pairs swapped: the gold index alternates
    golds = [r["gold"] for r in rows]
    n = standins.SIZES["cause_and_effect/one_sentence"]
    assert golds.count(0) == 2 * ((n + 1) // 2) and golds.count(1) == 2 * (n // 2)
    nli = data.task_rows("bb_entailment", "train") + data.task_rows("bb_entailment", "test")
    assert {r["choices"][r["gold"]] for r in nli} == {"True", "Neither", "False"}
    assert all("True, False or Neither?" in r["query"] and "Sentence" not in r["query"] for r in nli)
    analytic = data.task_rows("bb_analytic_entailment", "test")
    assert all(r["query"].endswith("True or False?\nAnswer:") and " So " not in r["query"] for r in analytic)


def test_xsum_examples():
    allx = data.xsum_examples("all")
    n = standins.SIZES["gem/xsum"]
    assert len(allx) == n and len(data.xsum_examples("train")) == 100 and len(data.xsum_examples()) == n - 100
    source = standins.examples("gem/xsum")
    assert [r["id"] for r in allx] == [ex["comment"] for ex in source]
    assert allx[0]["summary"] == source[0]["target"]
    for row in allx:
        assert row["document"] and row["summary"]
        assert len(row["article"].split()) == min(512, len(row["document"].split()))
    assert len(allx[standins.XSUM_LONG]["document"].split()) > 512  # the cut is exercised
    scores = data.xsum_process_results(allx[0], [allx[0]["summary"] + "\n###\nArticle: junk"])
    assert scores == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}


def test_lm_eval_tasks_load_and_build_requests():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(REPO / "tasks"), include_defaults=False)
    names = [*MC_TASKS, "bb_xsum"]
    assert set(names) <= set(tm.all_tasks)
    tasks = tm.load(names)["tasks"]
    for name in names:
        task = tasks[name]
        assert task.config.num_fewshot == 5
        assert len(task.fewshot_docs()) >= 5
        task.build_all_requests(limit=2, rank=0, world_size=1)
        req = task.instances[0]
        context = req.args[0]
        if name == "bb_xsum":
            assert req.request_type == "generate_until"
            assert context.count("###\nArticle: ") == 6  # 5 in-context examples + the open test block
            assert context.endswith("Summarize the above article in 1 sentence.")  # HELM: open block rstripped
            assert context.startswith("###\nArticle: ") and context.count("\n\n###\nArticle: ") == 5  # "summary\n" + "\n"
            assert context.count("in 1 sentence.\n") == 5  # each in-context block: instruction, newline, summary
            assert req.args[1]["until"] == ["###"] and req.args[1]["max_gen_toks"] == 64
        else:
            doc = task.test_docs()[0]
            assert req.request_type == "loglikelihood"
            assert len(task.instances) == len(doc["choices"]) + len(task.test_docs()[1]["choices"])
            assert context.endswith(doc["query"]) and context.count("\nAnswer:") + context.count("reasoning is") >= 6
            assert req.args[1] == " " + doc["choices"][0]


# --- BIG-bench's real files: only where they are present (H2O_BIGBENCH or <cache>/bigbench) -----------------


def test_real_bigbench_task_files(real_bigbench):
    xsum = fetch.bigbench_task("gem/xsum")
    assert xsum["name"] == "xsum" and len(xsum["examples"]) == 1001
    assert len(fetch.bigbench_task("elementary_math_qa/question_only")["examples"]) == 7688
    assert len(fetch.bigbench_task("winowhy")["examples"]) == 2865


@pytest.mark.parametrize(
    "task, n_train, n_test, n_choices",
    [("bb_copa", 20, 82, {2}), ("bb_mathqa", 100, 7588, set(range(3, 11))), ("bb_piqa", 10, 71, {2, 3, 4, 5}),
     ("bb_entailment", 78, 657, {3}), ("bb_analytic_entailment", 10, 60, {2}), ("bb_winowhy", 292, 2573, {2})],
)
def test_real_multiple_choice_conversions(real_bigbench, task, n_train, n_test, n_choices):
    check_multiple_choice(task, n_train, n_test, n_choices)


def test_real_copa_and_entailment_contents(real_bigbench):
    rows = data.task_rows("bb_copa", "train") + data.task_rows("bb_copa", "test")
    first = next(r for r in rows if r["id"] == "one_sentence-0")
    assert first["choices"][first["gold"]] == "The child started crying because the child hurt their knee."
    golds = [r["gold"] for r in rows]
    assert golds.count(0) == golds.count(1) + 2  # alternated: pairs 0..50 give 26 x 0, 25 x 1 per phrasing
    nli = data.task_rows("bb_entailment", "test")
    assert {r["choices"][r["gold"]] for r in nli} == {"True", "Neither", "False"}


def test_real_xsum_examples(real_bigbench):
    allx = data.xsum_examples("all")
    assert len(allx) == 1001 and len(data.xsum_examples("train")) == 100 and len(data.xsum_examples()) == 901
    assert allx[0]["id"] == "xsum-test-0"
    assert allx[0]["summary"].startswith("Skiing on Scotland's snow slopes")
