"""Offline data: BIG-bench task files, Jane Austen's novels, Moby-Dick, and lm-eval-ready JSONL.

Everything comes from package registries (see ``docs/protocols.md``, "Data without a model hub") and lands
in the cache folder (``h2o.assets.paths.cache_dir()``)::

    <cache>/bigbench/<task>/task.json        8 BIG-bench task files (gem/xsum, cause_and_effect/...)
    <cache>/books/austen/<slug>.txt          the six novels, one file each (lines as in the R package)
    <cache>/books/austen.txt                 the six novels concatenated (long-book perplexity)
    <cache>/books/moby_dick.txt              Moby-Dick (from the R package ``tokenizers``)
    <cache>/lm_eval/v1/<task>/{train,test}.jsonl   converted multiple-choice and XSUM tasks

Sources and how they are fetched:

* ``bigbench==1.0.0`` (PyPI sdist, 358 MB). ``pip download`` unpacks it, then rejects its metadata
  ("cannot declare direct URL dependencies": it depends on a ``bleurt`` zip inside the sdist) and
  deletes the tarball. We run it with ``--no-clean`` and a private ``TMPDIR`` so the unpacked tree stays, copy
  the eight ``task.json`` files out (about 7 MB) and delete the rest (1.8 GB unpacked).
* Debian packages ``r-cran-janeaustenr`` and ``r-cran-tokenizers`` (``apt-get download``, then
  ``dpkg-deb -x``): the texts are R objects in a lazy-load database (``data/Rdata.rdb`` + ``.rdx``),
  read by the small R-serialization parser below (``unserialize``, ``read_rdb``).

Every fetch is idempotent (a second call only checks that the files exist) and guarded by a file
lock; a failed download raises ``FetchError`` with one line naming what failed and what to do.
``python -m h2o.assets.data`` fetches everything.

Splits of the lm-eval tasks are deterministic: groups of related examples (the same event pair,
the same premise, the same Winograd sentence) are shuffled with ``random.Random(SPLIT_SEED)`` and the
first ``n_train`` groups form the ``train`` split (the few-shot pool), the rest ``test``; within a
split the original BIG-bench order is kept. See ``TASKS`` for the sizes.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

from h2o.assets.paths import atomic_write_text, cache_dir, cache_lock

BIGBENCH_VERSION = "1.0.0"
#: BIG-bench tasks copied out of the sdist (paths under ``bigbench/benchmark_tasks/``).
BIGBENCH_TASKS = (
    "gem/xsum",
    "cause_and_effect/one_sentence",
    "cause_and_effect/two_sentences",
    "elementary_math_qa/question_only",
    "physical_intuition",
    "winowhy",
    "analytic_entailment",
    "presuppositions_as_nli",
)
#: Object names in ``janeaustenr``'s data base -> titles, in publication order.
AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
SPLIT_SEED = 1234
LM_EVAL_FORMAT = "v1"  # bump when the JSONL layout changes: old files are then ignored


class FetchError(RuntimeError):
    """A download or extraction failed; the message is one line saying what to do."""


def _log(msg: str) -> None:
    print(f"[h2o.assets.data] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# R serialization (XDR format, versions 2 and 3) -- just enough for data objects.
# --------------------------------------------------------------------------------------------


class RVector(list):
    """An R vector (character, integer, double, logical, list) with its R type and attributes.

    ``NA`` elements are ``None``. ``attrs`` maps attribute names (``names``, ``class``, ...) to values.
    """

    def __init__(self, items: Iterable[Any] = (), rtype: int = 19, attrs: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attrs = attrs or {}

    @property
    def names(self) -> list[str] | None:
        return self.attrs.get("names")

    def as_dict(self) -> dict[str, Any]:
        """A named vector or list as a dict (raises if it has no names)."""
        if self.names is None:
            raise ValueError("R vector has no names")
        return dict(zip(self.names, self))


class RSymbol(str):
    """An R symbol (its name)."""


_NA_INT = -(2**31)
_VECTOR_TYPES = {10: ">i", 13: ">i", 14: ">d", 15: ">d"}  # LGL, INT, REAL, CPLX (two doubles)


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated R serialization")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def attributes(self) -> dict[str, Any]:
        pairs = self.item()
        out: dict[str, Any] = {}
        for tag, value in pairs or []:
            out[str(tag)] = value
        return out

    def item(self) -> Any:  # noqa: C901 - one switch, as in R's serialize.c
        flags = self.int()
        rtype, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if rtype == 254:  # NILVALUE_SXP
            return None
        if rtype in (253, 252, 251, 250, 242, 241):  # global/unbound/missing/base env markers
            return RSymbol(f"<special {rtype}>")
        if rtype == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if rtype in (247, 248, 249):  # PERSISTSXP, PACKAGESXP, NAMESPACESXP: a string vector
            self.int()
            value = RVector([self.item() for _ in range(self.int())], rtype=16)
            self.refs.append(value)
            return value
        if rtype == 1:  # SYMSXP
            sym = RSymbol(self.item() or "")
            self.refs.append(sym)
            return sym
        if rtype == 4:  # ENVSXP: locked, enclosure, frame, hash table, attributes
            env: dict[str, Any] = {}
            self.refs.append(env)
            self.int()
            env["enclos"], env["frame"], env["hashtab"], env["attrib"] = (self.item() for _ in range(4))
            return env
        if rtype in (2, 3, 5, 6, 17):  # LISTSXP, CLOSXP, PROMSXP, LANGSXP, DOTSXP: a pairlist
            out: list[tuple[Any, Any]] = []
            while True:
                if has_attr:
                    self.attributes()
                tag = self.item() if has_tag else None
                out.append((tag, self.item()))
                flags = self.int()  # the CDR, read in place to avoid deep recursion
                rtype = flags & 0xFF
                has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
                if rtype not in (2, 3, 5, 6, 17):
                    self.pos -= 4
                    self.item()  # usually NILVALUE
                    return out
        if rtype == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            raw = self.take(n)
            return raw.decode("latin-1") if levels & 4 else raw.decode("utf-8", errors="replace")
        if rtype in (7, 8):  # SPECIALSXP, BUILTINSXP
            return RSymbol(self.take(self.int()).decode())
        if rtype == 238:  # ALTREP_SXP: class info, state, attributes
            info, state, attr = self.item(), self.item(), self.item()
            return _altrep(info, state, attr)
        if rtype in _VECTOR_TYPES:
            n = self.length()
            fmt = _VECTOR_TYPES[rtype]
            count = 2 * n if rtype == 15 else n
            size = 8 if fmt == ">d" else 4
            vals = list(struct.unpack(f">{count}{fmt[1]}", self.take(size * count)))
            if rtype in (10, 13):
                vals = [None if v == _NA_INT else (bool(v) if rtype == 10 else v) for v in vals]
            if rtype == 15:
                vals = [complex(vals[i], vals[i + 1]) for i in range(0, count, 2)]
            value = RVector(vals, rtype=rtype)
        elif rtype == 16 or rtype in (19, 20):  # STRSXP, VECSXP, EXPRSXP
            value = RVector([self.item() for _ in range(self.length())], rtype=rtype)
        elif rtype == 24:  # RAWSXP
            value = RVector(self.take(self.length()), rtype=rtype)
        elif rtype == 25:  # S4SXP
            value = RVector([], rtype=rtype)
        else:
            raise ValueError(f"unsupported R object type {rtype} in serialization")
        if has_attr:
            value.attrs = self.attributes()
        return value


def _altrep(info: Any, state: Any, attr: Any) -> RVector:
    """Materialise the ALTREP classes R writes for data: compact sequences and wrappers."""
    cls = str(info[0][1]) if info else ""
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = state
        vals = [start + i * step for i in range(int(n))]
        out = RVector([int(v) for v in vals] if cls == "compact_intseq" else vals, rtype=13 if "int" in cls else 14)
    elif cls.startswith("wrap_"):
        out = RVector(state[0], rtype=getattr(state[0], "rtype", 19))
    else:
        raise ValueError(f"unsupported ALTREP class {cls!r} in R serialization")
    if attr:
        out.attrs = {str(t): v for t, v in attr}
    return out


def unserialize(data: bytes) -> Any:
    """Decode one object in R's XDR serialization format (``X\\n``, versions 2 and 3).

    Character vectors come back as ``RVector`` of ``str`` (``None`` for NA); lists as ``RVector``;
    attributes in ``.attrs``; pairlists as lists of ``(tag, value)``.
    """
    if data[:2] != b"X\n":
        raise ValueError(f"not an R XDR serialization (starts with {data[:2]!r})")
    r = _Reader(data)
    r.pos = 2
    version = r.int()
    r.int(), r.int()  # writer's R version, minimal reader version
    if version == 3:
        r.take(r.int())  # native encoding name
    elif version != 2:
        raise ValueError(f"unsupported R serialization version {version}")
    return r.item()


def _decompress(data: bytes) -> bytes:
    """Undo the compression of an .rds file (gzip, bzip2, xz or none)."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def read_rds(path: str | Path) -> Any:
    """Read an ``.rds`` file (``saveRDS`` output) into Python values."""
    return unserialize(_decompress(Path(path).read_bytes()))


def _rdb_blob(blob: bytes, compressed: int) -> bytes:
    """Decode one record of a lazy-load database: 4-byte big-endian length, then the payload."""
    (size,) = struct.unpack(">I", blob[:4])
    if compressed in (2, 3):  # a type byte follows the length: Z(lib), 2 (bzip2), X(z), 0 (none)
        kind, body = blob[4:5], blob[5:]
        out = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}[kind](body)
    elif compressed:
        out = zlib.decompress(blob[4:])
    else:
        out = blob[4:]
    if len(out) != size:
        raise ValueError(f"R database record: expected {size} bytes, got {len(out)}")
    return out


def read_rdb(rdb: str | Path, rdx: str | Path | None = None) -> dict[str, Any]:
    """Read every object of an R lazy-load database (``X.rdb`` with its index ``X.rdx``)."""
    rdb = Path(rdb)
    index = read_rds(rdx or rdb.with_suffix(".rdx")).as_dict()
    compressed = index.get("compressed")
    compressed = int(compressed[0]) if compressed else 1
    raw = rdb.read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].as_dict().items():
        out[name] = unserialize(_rdb_blob(raw[int(offset) : int(offset) + int(length)], compressed))
    return out


# --------------------------------------------------------------------------------------------
# Downloads
# --------------------------------------------------------------------------------------------


def _run(cmd: list[str], what: str, hint: str, **kw) -> subprocess.CompletedProcess:
    """Run a command; a missing program raises FetchError naming it."""
    try:
        return subprocess.run(cmd, stderr=subprocess.PIPE, text=True, **kw)
    except FileNotFoundError:
        raise FetchError(f"could not fetch {what}: `{cmd[0]}` is not installed; {hint}") from None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.startswith("WARNING")]
    return lines[-1] if lines else "no error output"


def bigbench_dir() -> Path:
    """The folder holding the BIG-bench task files (``<cache>/bigbench``), fetched on first use."""
    fetch_bigbench()
    return cache_dir() / "bigbench"


def fetch_bigbench(force: bool = False) -> Path:
    """Copy the ``task.json`` of every task in ``BIGBENCH_TASKS`` from the bigbench sdist into the cache.

    Costs one 358 MB download and 1.8 GB of temporary disk (inside the cache folder), ~30 s here.
    """
    root = cache_dir() / "bigbench"
    done = lambda: all((root / t / "task.json").exists() for t in BIGBENCH_TASKS)  # noqa: E731
    if done() and not force:
        return root
    with cache_lock("bigbench"):
        if done() and not force:
            return root
        spec = f"bigbench=={BIGBENCH_VERSION}"
        hint = "check that PyPI is reachable (pip download works) or copy the task.json files into " + str(root)
        t0 = time.time()
        _log(f"downloading the {spec} sdist (358 MB) with pip to copy {len(BIGBENCH_TASKS)} task files ...")
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-bigbench-", dir=cache_dir()))
        try:
            (tmp / "pip-tmp").mkdir()
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-clean", "--no-cache-dir", "--disable-pip-version-check", spec, "-d", str(tmp / "dl")]
            proc = _run(cmd, spec, hint, env={**os.environ, "TMPDIR": str(tmp / "pip-tmp")},
                        stdout=subprocess.DEVNULL)
            # pip unpacks the sdist, then refuses its metadata (a direct-URL dependency): the unpacked
            # tree survives thanks to --no-clean. Should a later pip accept it, the tarball is in dl/.
            trees = glob.glob(str(tmp / "pip-tmp" / "pip-*" / "bigbench*" / "bigbench" / "benchmark_tasks"))
            tarballs = glob.glob(str(tmp / "dl" / "bigbench-*.tar.gz"))
            if trees:
                for task in BIGBENCH_TASKS:
                    src = Path(trees[0]) / task / "task.json"
                    if not src.exists():
                        raise FetchError(f"{spec} has no benchmark_tasks/{task}/task.json")
                    (root / task).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, root / task / "task.json")
            elif tarballs:
                _extract_from_tarball(Path(tarballs[0]), root)
            else:
                raise FetchError(f"could not fetch {spec} with pip ({_last_line(proc.stderr)}); {hint}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log(f"bigbench task files ready in {root} ({time.time() - t0:.0f} s)")
    return root


def _extract_from_tarball(tarball: Path, root: Path) -> None:
    """Copy the wanted task.json members out of the sdist tarball."""
    wanted = {f"bigbench/benchmark_tasks/{t}/task.json": t for t in BIGBENCH_TASKS}
    with tarfile.open(tarball, "r:gz") as tf:
        for member in tf:
            rel = member.name.split("/", 1)[-1]
            if rel in wanted:
                (root / wanted[rel]).mkdir(parents=True, exist_ok=True)
                (root / wanted[rel] / "task.json").write_bytes(tf.extractfile(member).read())
    missing = [t for t in BIGBENCH_TASKS if not (root / t / "task.json").exists()]
    if missing:
        raise FetchError(f"{tarball.name} lacks the task files {missing}")


def bigbench_task(name: str) -> dict:
    """The parsed ``task.json`` of a BIG-bench task in ``BIGBENCH_TASKS`` (e.g. ``"gem/xsum"``)."""
    if name not in BIGBENCH_TASKS:
        raise ValueError(f"unknown BIG-bench task {name!r}; available offline: {', '.join(BIGBENCH_TASKS)}")
    return json.loads((bigbench_dir() / name / "task.json").read_text(encoding="utf-8"))


def _debian_package(package: str, dest: Path) -> Path:
    """``apt-get download`` a Debian package and unpack it (``dpkg-deb -x``) into ``dest``."""
    hint = "this needs a Debian/Ubuntu machine with apt-get and access to the Debian archive"
    dl = dest / "deb"
    dl.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    os.chmod(dl, 0o777)  # lets apt's sandbox user write there (else a harmless warning)
    proc = _run(["apt-get", "download", package], package, hint, cwd=dl, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:  # usually stale or missing package lists: refresh once, then retry
        _log(f"apt-get download {package} failed ({_last_line(proc.stderr)}); running apt-get update")
        _run(["apt-get", "update"], package, hint, stdout=subprocess.DEVNULL)
        proc = _run(["apt-get", "download", package], package, hint, cwd=dl, stdout=subprocess.DEVNULL)
    debs = sorted(dl.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not debs:
        raise FetchError(f"could not fetch Debian package {package} ({_last_line(proc.stderr)}); {hint}")
    root = dest / "root"
    proc = _run(["dpkg-deb", "-x", str(debs[0]), str(root)], package, hint)
    if proc.returncode != 0:
        raise FetchError(f"could not unpack {debs[0].name} ({_last_line(proc.stderr)}); {hint}")
    return root


def _r_package_data(package: str, r_name: str) -> dict[str, Any]:
    """All data objects of the R package ``r_name`` shipped as Debian package ``package``."""
    with tempfile.TemporaryDirectory(prefix=".tmp-deb-", dir=cache_dir()) as tmp:
        root = _debian_package(package, Path(tmp))
        rdb = root / "usr/lib/R/site-library" / r_name / "data" / "Rdata.rdb"
        if not rdb.exists():
            raise FetchError(f"Debian package {package} has no {rdb.relative_to(root)}")
        return read_rdb(rdb)


def _lines_to_text(lines: Iterable[str | None]) -> str:
    return "\n".join(line or "" for line in lines).strip("\n") + "\n"


def _strip_gutenberg(text: str) -> str:
    """Drop a byte-order mark, CRLF line ends and Project Gutenberg's header and licence footer."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG EBOOK.*$", text, re.M)
    end = re.search(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG EBOOK", text, re.M)
    if start and end:
        text = text[start.end() : end.start()]
    return text.strip("\n") + "\n"


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def fetch_austen(force: bool = False) -> Path:
    """Write the six Austen novels (one file each) and their concatenation into ``<cache>/books``."""
    books = cache_dir() / "books"
    joined = books / "austen.txt"
    if joined.exists() and not force:
        return joined
    with cache_lock("austen"):
        if joined.exists() and not force:
            return joined
        t0 = time.time()
        _log("fetching Jane Austen's novels (Debian package r-cran-janeaustenr, 1.6 MB) ...")
        objs = _r_package_data("r-cran-janeaustenr", "janeaustenr")
        texts = []
        for key, title in AUSTEN_TITLES.items():
            if key not in objs:
                raise FetchError(f"r-cran-janeaustenr has no object {key!r} (found {sorted(objs)})")
            text = _lines_to_text(objs[key])
            atomic_write_text(books / "austen" / f"{_slug(title)}.txt", text)
            texts.append(text)
        atomic_write_text(joined, "\n\n".join(texts))
        _log(f"Austen novels ready in {books} ({time.time() - t0:.1f} s)")
    return joined


def austen_novels() -> dict[str, str]:
    """The six novels, ``{title: text}`` in publication order (fetched on first use)."""
    fetch_austen()
    folder = cache_dir() / "books" / "austen"
    return {t: (folder / f"{_slug(t)}.txt").read_text(encoding="utf-8") for t in AUSTEN_TITLES.values()}


def austen_text() -> str:
    """All six novels concatenated (about 718k words): the long book for perplexity runs."""
    return fetch_austen().read_text(encoding="utf-8")


def austen_path() -> Path:
    """Path of the concatenated novels (``<cache>/books/austen.txt``), fetched on first use."""
    return fetch_austen()


def fetch_moby_dick(force: bool = False) -> Path:
    """Write Moby-Dick (R package ``tokenizers``' data object ``mobydick``) to ``<cache>/books``."""
    path = cache_dir() / "books" / "moby_dick.txt"
    if path.exists() and not force:
        return path
    with cache_lock("moby_dick"):
        if path.exists() and not force:
            return path
        t0 = time.time()
        _log("fetching Moby-Dick (Debian package r-cran-tokenizers, 0.7 MB) ...")
        objs = _r_package_data("r-cran-tokenizers", "tokenizers")
        if "mobydick" not in objs:
            raise FetchError(f"r-cran-tokenizers has no object 'mobydick' (found {sorted(objs)})")
        atomic_write_text(path, _strip_gutenberg(_lines_to_text(objs["mobydick"])))
        _log(f"Moby-Dick ready in {path} ({time.time() - t0:.1f} s)")
    return path


def moby_dick() -> str:
    """The full text of Moby-Dick (fetched on first use)."""
    return fetch_moby_dick().read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Converters: BIG-bench -> lm-eval JSONL
# --------------------------------------------------------------------------------------------
# Multiple-choice rows: {"id", "query", "choices", "gold", "source"}; lm-eval scores
# `query + " " + choices[i]`. XSUM rows: {"id", "document", "summary", "article"} where "article"
# is the document cut to 512 words (HELM's doc_max_length).


def _gold(scores: dict[str, float]) -> int:
    values = list(scores.values())
    return values.index(max(values))


def _choice_lines(choices: list[str]) -> str:
    return "".join(f"\nchoice: {c}" for c in choices)


def convert_copa() -> list[dict]:
    """COPA-like: ``cause_and_effect`` one_sentence + two_sentences (51 event pairs, 102 rows).

    BIG-bench lists the right answer first; we swap the two choices on odd pairs so the gold index
    alternates 0/1. The group key is the pair index, so both phrasings of a pair share a split.
    """
    prompts = {
        "one_sentence": "Which of the following sentences makes more sense?",
        "two_sentences": "Two events are given. Which event caused the other?",
    }
    rows = []
    for sub, question in prompts.items():
        for i, ex in enumerate(bigbench_task(f"cause_and_effect/{sub}")["examples"]):
            choices = list(ex["target_scores"])
            gold = _gold(ex["target_scores"])
            if i % 2:
                choices.reverse()
                gold = len(choices) - 1 - gold
            rows.append({"id": f"{sub}-{i}", "group": f"pair-{i}",
                         "query": f"{question}{_choice_lines(choices)}\nAnswer:",
                         "choices": choices, "gold": gold, "source": f"bigbench/cause_and_effect/{sub}"})
    return rows


def _plain_mc(task: str, template: str, group: Callable[[dict, int], str] | None = None) -> list[dict]:
    rows = []
    for i, ex in enumerate(bigbench_task(task)["examples"]):
        rows.append({"id": f"{task.replace('/', '-')}-{i}", "group": group(ex, i) if group else str(i),
                     "query": template.format(input=ex["input"].strip()),
                     "choices": list(ex["target_scores"]), "gold": _gold(ex["target_scores"]),
                     "source": f"bigbench/{task}"})
    return rows


def convert_mathqa() -> list[dict]:
    """MathQA-like: ``elementary_math_qa/question_only`` (7,688 word problems, 3-10 numeric choices)."""
    return _plain_mc("elementary_math_qa/question_only", "Question: {input}\nAnswer:")


def convert_piqa() -> list[dict]:
    """PiQA-like: ``physical_intuition`` (81 questions, 2-5 choices), lm-eval's PiQA prompt."""
    return _plain_mc("physical_intuition", "Question: {input}\nAnswer:")


_NLI_RE = re.compile(r"Sentence 1:(.*)\nSentence 2:(.*)\n\nThe answer is:\s*$", re.S)
_NLI_LABELS = {"entailment": "True", "neutral": "Neither", "contradiction": "False"}


def convert_entailment() -> list[dict]:
    """Entailment: ``presuppositions_as_nli`` (735 pairs, 3-way) in lm-eval's CommitmentBank prompt.

    ``{premise}\\nQuestion: {hypothesis} True, False or Neither?\\nAnswer:`` with choices
    True/Neither/False (entailment/neutral/contradiction). Grouped by BIG-bench's ``example_id``.
    """
    rows = []
    for i, ex in enumerate(bigbench_task("presuppositions_as_nli")["examples"]):
        m = _NLI_RE.match(ex["input"])
        if not m:
            raise ValueError(f"presuppositions_as_nli example {i} has an unexpected layout")
        premise, hypothesis = (s.strip() for s in m.groups())
        labels = list(ex["target_scores"])
        rows.append({"id": f"presuppositions_as_nli-{i}", "group": str(ex["comment"]["example_id"]),
                     "query": f"{premise}\nQuestion: {hypothesis} True, False or Neither?\nAnswer:",
                     "choices": [_NLI_LABELS[label] for label in labels],
                     "gold": _gold(ex["target_scores"]), "source": "bigbench/presuppositions_as_nli"})
    return rows


_ENTAIL_RE = re.compile(r"(.*?\.)\s+(?:So|Therefore),?\s+(.*)$", re.S)


def convert_analytic_entailment() -> list[dict]:
    """RTE-like, 2-way: ``analytic_entailment`` (70 pairs) in lm-eval's RTE prompt (True/False)."""
    rows = []
    for i, ex in enumerate(bigbench_task("analytic_entailment")["examples"]):
        m = _ENTAIL_RE.match(ex["input"].strip())
        if not m:
            raise ValueError(f"analytic_entailment example {i} has an unexpected layout")
        first, second = m.group(1), m.group(2)
        labels = {"entailment": "True", "no-entailment": "False"}
        rows.append({"id": f"analytic_entailment-{i}", "group": str(i),
                     "query": f"{first}\nQuestion: {second[:1].upper() + second[1:]} True or False?\nAnswer:",
                     "choices": [labels[k] for k in ex["target_scores"]], "gold": _gold(ex["target_scores"]),
                     "source": "bigbench/analytic_entailment"})
    return rows


def convert_winowhy() -> list[dict]:
    """Winograd-like: ``winowhy`` (2,865 reasons for 271 schema sentences): is the reasoning correct?"""
    return _plain_mc("winowhy", "{input}\nThe above reasoning is",
                     group=lambda ex, i: ex["input"].split(" The '")[0])


def convert_xsum() -> list[dict]:
    """XSUM: ``gem/xsum`` (1,001 BBC articles with their reference one-sentence summaries)."""
    rows = []
    for i, ex in enumerate(bigbench_task("gem/xsum")["examples"]):
        document = ex["input"].strip()
        words = document.split()
        rows.append({"id": ex.get("comment") or f"xsum-{i}", "group": str(i), "document": document,
                     "summary": ex["target"].strip(), "article": " ".join(words[:512])})
    return rows


#: lm-eval task name -> (converter, number of train groups; the rest is test).
TASKS: dict[str, tuple[Callable[[], list[dict]], int]] = {
    "bb_copa": (convert_copa, 10),  # 20 train / 82 test rows
    "bb_mathqa": (convert_mathqa, 100),  # 100 / 7,588
    "bb_piqa": (convert_piqa, 10),  # 10 / 71
    "bb_entailment": (convert_entailment, 20),  # 20 premises (~75 rows) / rest of 735
    "bb_analytic_entailment": (convert_analytic_entailment, 10),  # 10 / 60
    "bb_winowhy": (convert_winowhy, 27),  # 27 sentences (~280 rows) / rest of 2,865
    "bb_xsum": (convert_xsum, 100),  # 100 / 901
}


def split_rows(rows: list[dict], n_train_groups: int, seed: int = SPLIT_SEED) -> dict[str, list[dict]]:
    """Deterministic group split: shuffle the distinct groups with ``seed``, the first ``n`` are train.

    Rows keep their original order inside each split; rows of one group never straddle splits.
    """
    groups = list(dict.fromkeys(r["group"] for r in rows))
    random.Random(seed).shuffle(groups)
    train = set(groups[:n_train_groups])
    return {"train": [r for r in rows if r["group"] in train], "test": [r for r in rows if r["group"] not in train]}


def _task_dir(task: str) -> Path:
    return cache_dir() / "lm_eval" / LM_EVAL_FORMAT / task


def write_task(task: str, force: bool = False) -> Path:
    """Convert one task of ``TASKS`` to ``<cache>/lm_eval/v1/<task>/{train,test}.jsonl``."""
    if task not in TASKS:
        raise ValueError(f"unknown offline task {task!r}; available: {', '.join(TASKS)}")
    folder = _task_dir(task)
    if (folder / "test.jsonl").exists() and not force:
        return folder
    converter, n_train = TASKS[task]
    for split, rows in split_rows(converter(), n_train).items():
        atomic_write_text(folder / f"{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return folder


def task_rows(task: str, split: str = "test") -> list[dict]:
    """The rows of one split (``train`` or ``test``) of an offline task, converting on first use."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    path = write_task(task) / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def lm_eval_dataset(task: str, **_metadata: Any):
    """A ``datasets.DatasetDict`` (train, test) for an offline task: lm-eval's ``custom_dataset`` hook.

    lm-eval calls it as ``custom_dataset(**metadata, **dataset_kwargs)``; the YAML passes
    ``dataset_kwargs: {task: bb_copa}`` and anything else (model metadata) is ignored.
    """
    import datasets

    return datasets.DatasetDict({s: datasets.Dataset.from_list(task_rows(task, s)) for s in ("train", "test")})


def xsum_examples(split: str = "test") -> list[dict]:
    """XSUM rows ``{"id", "document", "summary", "article"}``: ``train`` (100, the in-context pool),
    ``test`` (901) or ``all`` (1,001, BIG-bench order). ``article`` is ``document`` cut to 512 words."""
    if split == "all":
        return sorted(task_rows("bb_xsum", "train") + task_rows("bb_xsum", "test"), key=lambda r: int(r["group"]))
    return task_rows("bb_xsum", split)


def xsum_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` for ``bb_xsum``: ROUGE-1/2/L F1 (stemmed, as HELM) of the generation."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    prediction = results[0].split("###")[0].strip()
    scores = scorer.score(doc["summary"], prediction)
    return {k: v.fmeasure for k, v in scores.items()}


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------


def fetch_all(force: bool = False, moby: bool = True) -> dict[str, Path]:
    """Fetch BIG-bench files, the Austen novels (and Moby-Dick) and write every lm-eval task."""
    out = {"bigbench": fetch_bigbench(force), "austen": fetch_austen(force)}
    if moby:
        out["moby_dick"] = fetch_moby_dick(force)
    for task in TASKS:
        out[task] = write_task(task, force)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m h2o.assets.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    parser.add_argument("--no-moby", action="store_true", help="skip Moby-Dick")
    args = parser.parse_args(argv)
    try:
        paths = fetch_all(force=args.force, moby=not args.no_moby)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"cache: {cache_dir()}")
    for name, path in paths.items():
        print(f"  {name:24s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
