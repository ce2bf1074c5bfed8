"""Fetching offline data into the cache: BIG-bench task files, Jane Austen's novels, Moby-Dick.

Everything comes from package registries and lands in the cache folder (``h2o.assets.paths.cache_dir()``)::

    <cache>/bigbench/<task>/task.json        8 BIG-bench task files (gem/xsum, cause_and_effect/...)
    <cache>/books/austen/<slug>.txt          the six novels, one file each (lines as in the R package)
    <cache>/books/austen.txt                 the six novels concatenated (long-book perplexity)
    <cache>/books/moby_dick.txt              Moby-Dick (from the R package ``tokenizers``)

Sources and how they are fetched:

* BIG-bench's task files: from the folder named by ``$H2O_BIGBENCH`` when set (read in place), else from
  ``<cache>/bigbench``, else from the ``bigbench==1.0.0`` sdist where an index still offers it (PyPI offers
  0.0.1 only, which holds no task files). ``pip download`` unpacks the sdist, then rejects its
  metadata ("cannot declare direct URL dependencies") and deletes the tarball. We run it with ``--no-clean`` and a
  private ``TMPDIR`` so the unpacked tree stays, copy the eight ``task.json`` files out (about 7 MB) and delete the
  rest (1.8 GB unpacked). Without any of the three, the refusal is one line naming ``H2O_BIGBENCH``
  (:data:`BIGBENCH_DOOR`).
* Debian packages ``r-cran-janeaustenr`` and ``r-cran-tokenizers`` (``apt-get download``, then
  ``dpkg-deb -x``): the texts are R objects in a lazy-load database (``data/Rdata.rdb`` + ``.rdx``),
  read by :func:`h2o.assets.r_data.read_rdb`.

Every fetch is idempotent (a second call only checks that the files exist) and guarded by a file lock
(:func:`fetch_once`); a failed download raises ``FetchError`` with one line naming what failed and what to do.
``python -m h2o.assets.data`` fetches everything and writes the lm-eval tasks.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from h2o.assets.paths import cache_dir, cache_lock
from h2o.store.files import atomic_write_text
from h2o.assets.r_data import read_rdb

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


class FetchError(RuntimeError):
    """A download or extraction failed; the message is one line saying what to do."""


LOG_PREFIX = "[h2o.assets.fetch] "  # the progress lines of a fetch on stderr begin so


def _log(msg: str) -> None:
    print(f"{LOG_PREFIX}{msg}", file=sys.stderr, flush=True)


def fetch_once(done: Callable[[], bool], lock: str, what: str, build: Callable[[], None], force: bool = False) -> None:
    """Run ``build`` unless ``done()``: checked, then under the cache lock ``lock`` checked again; logs the time."""
    if done() and not force:
        return
    with cache_lock(lock):
        if done() and not force:
            return
        t0 = time.time()
        _log(f"fetching {what} ...")
        build()
        _log(f"{what} ready ({time.time() - t0:.1f} s)")


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


BIGBENCH_ENV = "H2O_BIGBENCH"  # a folder holding BIG-bench's task files (<dir>/<task>/task.json): read, never fetched
#: Where the files can be had when no index offers the sdist (one line, in every refusal).
BIGBENCH_DOOR = (f"set {BIGBENCH_ENV}=<dir> to a folder holding BIG-bench's task.json files as "
                 f"<dir>/<task>/task.json for {', '.join(BIGBENCH_TASKS)} (e.g. bigbench/benchmark_tasks of a BIG-bench "
                 f"checkout), or copy them into <cache>/bigbench; on a cluster with the hub, lm-eval's own tasks need "
                 f"none (task=copa, piqa, mathqa, rte, winogrande, xsum)")


def bigbench_missing(root: Path) -> list[str]:
    """The tasks of ``BIGBENCH_TASKS`` whose ``task.json`` is not under ``root``."""
    return [t for t in BIGBENCH_TASKS if not (root / t / "task.json").is_file()]


def bigbench_here(named: str | None = None) -> tuple[Path, list[str]]:
    """Where the BIG-bench task files are read from, and the tasks of ``BIGBENCH_TASKS`` missing there (nothing is
    fetched): the folder ``named`` (default: ``$H2O_BIGBENCH``) when set, as it is, else ``<cache>/bigbench``."""
    named = os.environ.get(BIGBENCH_ENV) if named is None else named
    root = Path(named).expanduser() if named else cache_dir() / "bigbench"
    return root, bigbench_missing(root)


def bigbench_dir() -> Path:
    """The folder holding the BIG-bench task files (:func:`bigbench_here`): ``$H2O_BIGBENCH`` when set (a missing
    file is one line naming it), else ``<cache>/bigbench``, fetched on first use from the sdist while an index
    offers it."""
    root, missing = bigbench_here()
    named = os.environ.get(BIGBENCH_ENV)
    if named and missing:
        raise FetchError(f"{BIGBENCH_ENV}={named}: no {missing[0]}/task.json there ({len(missing)} of "
                         f"{len(BIGBENCH_TASKS)} task files missing); {BIGBENCH_DOOR}")
    return root if named or not missing else fetch_bigbench()


def bigbench_digest(root: Path | None = None) -> str:
    """sha256 over the task files (in ``BIGBENCH_TASKS`` order) of ``root`` (default: :func:`bigbench_dir`):
    which BIG-bench files a conversion and a run read. Computed once per folder in a process (the files of a
    folder are not replaced under a running process; another folder is another digest)."""
    return _digest(str(Path(bigbench_dir() if root is None else root).absolute()))


@functools.lru_cache(maxsize=None)
def _digest(root: str) -> str:
    digest = hashlib.sha256()
    for task in BIGBENCH_TASKS:
        digest.update(f"{task}\0".encode())
        digest.update(hashlib.sha256((Path(root) / task / "task.json").read_bytes()).digest())
    return digest.hexdigest()


def pip_refusal(spec: str, stderr: str) -> str:
    """Why ``pip download spec`` failed, told apart: the index answered without this version, or it was not reached."""
    offered = re.search(r"\(from versions: ([^)]*)\)", stderr or "")
    if offered and offered.group(1).strip() not in ("", "none"):
        return f"the package index no longer offers {spec} (it offers {offered.group(1).strip()})"
    if re.search(r"Could not fetch URL|Max retries|Failed to establish|Temporary failure in name resolution|"
                 r"NewConnectionError|ConnectTimeout|Network is unreachable", stderr or ""):
        return f"the package index could not be reached for {spec} ({_last_line(stderr)})"
    return f"the package index does not offer {spec} ({_last_line(stderr)})"


def fetch_bigbench(force: bool = False) -> Path:
    """Copy the ``task.json`` of every task in ``BIGBENCH_TASKS`` from the bigbench sdist into the cache.

    Costs one 358 MB download and 1.8 GB of temporary disk (inside the cache folder), ~30 s, where an index still
    offers ``bigbench==1.0.0`` (PyPI offers 0.0.1 only, without task files: :data:`BIGBENCH_DOOR` says what to do).
    """
    root = cache_dir() / "bigbench"
    spec = f"bigbench=={BIGBENCH_VERSION}"

    def build() -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-bigbench-", dir=cache_dir()))
        try:
            (tmp / "pip-tmp").mkdir()
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-clean", "--no-cache-dir", "--disable-pip-version-check", spec, "-d", str(tmp / "dl")]
            proc = _run(cmd, spec, BIGBENCH_DOOR, env={**os.environ, "TMPDIR": str(tmp / "pip-tmp")},
                        stdout=subprocess.DEVNULL)
            # pip unpacks the sdist, then refuses its metadata (a direct-URL dependency): the unpacked
            # tree survives thanks to --no-clean. Should a later pip accept it, the tarball is in dl/.
            trees = glob.glob(str(tmp / "pip-tmp" / "pip-*" / "bigbench*" / "bigbench" / "benchmark_tasks"))
            tarballs = glob.glob(str(tmp / "dl" / "bigbench-*.tar.gz"))
            if trees:
                for task in BIGBENCH_TASKS:
                    src = Path(trees[0]) / task / "task.json"
                    if not src.exists():
                        raise FetchError(f"{spec} has no benchmark_tasks/{task}/task.json; {BIGBENCH_DOOR}")
                    (root / task).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, root / task / "task.json")
            elif tarballs:
                _extract_from_tarball(Path(tarballs[0]), root)
            else:
                raise FetchError(f"BIG-bench's task files are not here and {pip_refusal(spec, proc.stderr)}; "
                                 f"{BIGBENCH_DOOR}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    fetch_once(lambda: not bigbench_missing(root), "bigbench",
               f"{len(BIGBENCH_TASKS)} task files from the {spec} sdist (358 MB download) into {root}", build, force)
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

    def build() -> None:
        objs = _r_package_data("r-cran-janeaustenr", "janeaustenr")
        texts = []
        for key, title in AUSTEN_TITLES.items():
            if key not in objs:
                raise FetchError(f"r-cran-janeaustenr has no object {key!r} (found {sorted(objs)})")
            text = _lines_to_text(objs[key])
            atomic_write_text(books / "austen" / f"{_slug(title)}.txt", text)
            texts.append(text)
        atomic_write_text(joined, "\n\n".join(texts))

    fetch_once(joined.exists, "austen", "Jane Austen's novels (Debian package r-cran-janeaustenr, 1.6 MB)", build,
               force)
    return joined


def austen_novels() -> dict[str, str]:
    """The six novels, ``{title: text}`` in publication order (fetched on first use)."""
    fetch_austen()
    folder = cache_dir() / "books" / "austen"
    return {t: (folder / f"{_slug(t)}.txt").read_text(encoding="utf-8") for t in AUSTEN_TITLES.values()}


def austen_text() -> str:
    """All six novels concatenated (about 718k words): the long book for perplexity runs."""
    return fetch_austen().read_text(encoding="utf-8")


def fetch_moby_dick(force: bool = False) -> Path:
    """Write Moby-Dick (R package ``tokenizers``' data object ``mobydick``) to ``<cache>/books``."""
    path = cache_dir() / "books" / "moby_dick.txt"

    def build() -> None:
        objs = _r_package_data("r-cran-tokenizers", "tokenizers")
        if "mobydick" not in objs:
            raise FetchError(f"r-cran-tokenizers has no object 'mobydick' (found {sorted(objs)})")
        atomic_write_text(path, _strip_gutenberg(_lines_to_text(objs["mobydick"])))

    fetch_once(path.exists, "moby_dick", "Moby-Dick (Debian package r-cran-tokenizers, 0.7 MB)", build, force)
    return path


def moby_dick() -> str:
    """The full text of Moby-Dick (fetched on first use)."""
    return fetch_moby_dick().read_text(encoding="utf-8")
