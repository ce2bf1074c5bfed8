"""One run's config checked once into its typed spec (h2o.pipeline.spec): each group built once by Hydra's own
``instantiate``, the folder and identity derived from the spec, committed records found and reused where they are,
the Slurm launcher one path under both spellings, CLI helpers outside core, comments that explain.

The run folders of every experiment's jobs are compared with tests/run_folders.json (recorded before the spec
existed) where those sweeps are expanded anyway: tests/test_experiments.py and tests/test_paper_grids.py.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from h2o.assets.paths import CONF, REPO
from h2o.core.policies import PolicyError
from h2o.core.policies.h2o_reference import H2OReference
from h2o.core.validate import ConfigError
from h2o.pipeline import launch, run, spec
from h2o.pipeline.jobs import classify
from h2o.store.folders import runs_root
from h2o.store.identity import check_reusable, identity, record_identity
from h2o.pipeline.spec import RunSpec, Settings, build, prepare
from h2o.pipeline.sweep import _compose
from run_folders import recorded  # tests/run_folders.py

TINY = ["model=tiny-llama", "task=bb_copa", "task.limit=2", "task.shots=0"]


def counting(monkeypatch) -> list[str]:
    """The ``_target_`` of every hydra.utils.instantiate call from here on."""
    import hydra.utils

    calls, real = [], hydra.utils.instantiate

    def instantiate(config, *args, **kwargs):
        target = config["_target_"]
        calls.append(target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}")
        return real(config, *args, **kwargs)

    monkeypatch.setattr(hydra.utils, "instantiate", instantiate)
    return calls


# ------------------------------------------------------------------------------------------- the spec
def test_a_config_is_checked_once_into_typed_values(hydra_ctx, monkeypatch):
    calls = counting(monkeypatch)
    s = prepare(_compose([*TINY, "policy=h2o", "policy.budget=0.3", "seed=7", "threads=1"]))
    assert isinstance(s, RunSpec) and isinstance(s.settings, Settings)
    assert (s.settings.seed, s.settings.threads, s.settings.experiment_name, s.settings.fail_fast) == (7, 1, "adhoc",
                                                                                                      False)
    # one instantiate per group: policy, task, model (quant=none builds nothing)
    assert calls == ["h2o.core.policies.make_policy", "h2o.tasks.multiple_choice.LmEvalTask",
                     "h2o.assets.model_spec.ModelSpec"]
    assert s.named is s.policy and s.quant is None and s.semantics == "simulated"
    assert s.identity == identity(s.cfg, s.policy, "simulated") and s.identity["seed"] == 7
    assert s.path.relative_to(runs_root(s.cfg)).parts == ("adhoc", "tiny-llama", "bb_copa", "shots0", "h2o", "0.3",
                                                          "limit=2,seed=7")
    head = s.head()
    assert (head["seed"], head["experiment"], head["budget"], head["policy"]) == (7, "adhoc", 0.3, "h2o")
    assert s.full_path() == s.path.parents[2] / "full" / "1.0" / "limit=2,seed=7"


def test_h2o_reference_is_built_once_and_spelled_as_its_record(hydra_ctx, monkeypatch):
    calls = counting(monkeypatch)
    new = prepare(_compose([*TINY, "policy=h2o_reference", "policy.budget=0.4"]))
    assert calls.count("h2o.core.policies.make_policy") == 2  # the policy that runs, the record's (h2o) policy
    old = prepare(_compose([*TINY, "policy=h2o", "policy.budget=0.4", "semantics=reference"]))
    assert isinstance(new.policy, H2OReference) and isinstance(old.policy, H2OReference)
    assert new.named.name == "h2o" and new.cfg.policy.name == "h2o" and new.cfg.semantics == "reference"
    assert new.path == old.path and new.identity == old.identity and new.path.name == "limit=2,semantics=reference"


def state(obj):
    """A policy as (its class, its attributes), the policies inside it (fixed_h2's ``base``) likewise."""
    from h2o.core.policies import Policy

    return (type(obj), {k: state(v) for k, v in vars(obj).items()}) if isinstance(obj, Policy) else obj


def test_build_is_hydras_instantiate_of_the_group_node():
    """Every group file builds the object Hydra's instantiate makes of it (plain values: _convert_=all)."""
    from hydra.utils import instantiate

    for group in ("task", "model", "policy"):
        for f in sorted((CONF / group).glob("*.yaml")):
            node = OmegaConf.load(f)
            mine, hydra = build(group, node), instantiate(node, _convert_="all")
            assert state(mine) == state(hydra), f"{group}={f.stem}"


@pytest.mark.parametrize("node, message", [
    ({"_target_": "h2o.nope.Task", "name": "x"}, "task._target_='h2o.nope.Task': cannot import"),
    ({"_target_": "h2o.tasks.perplexity.PerplexityTask", "name": "x", "window": "long"},
     "task.window='long': expected an int"),
    ({"_target_": "h2o.tasks.perplexity.PerplexityTask", "name": "x", "windw": 3},
     "task.windw: no such option for task=x"),
    ({"name": "x"}, "task: no _target_ in its config"),
])
def test_a_bad_group_node_is_one_line(node, message):
    with pytest.raises(ConfigError) as err:
        build("task", OmegaConf.create(node))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_policy_error_comes_through_instantiate_as_it_is():
    with pytest.raises(PolicyError, match=r"budget=1.5"):
        build("policy", OmegaConf.create({"_target_": "h2o.core.policies.make_policy", "name": "h2o", "budget": 1.5}))


def test_settings_refuse_bad_root_values_in_one_line(hydra_ctx):
    for override, words in [("seed=-1", "seed=-1: expected an int in [0, 2**32)"),
                            ("threads=0", "threads=0: expected a positive int or null"),
                            ("fail_fast=3", "fail_fast=3: expected true or false"),
                            ("experiment_name=a/b", "experiment_name='a/b': allowed: 1-80 characters")]:
        with pytest.raises(ConfigError) as err:
            prepare(_compose([*TINY, override]))
        assert str(err.value).startswith(words), str(err.value)


# ------------------------------------------------------------------------------------------- old records
def test_committed_records_are_found_and_reused_where_they_are(hydra_ctx, tmp_path):
    """The default's records (studies/default/records, made before the spec existed) from their own config.yaml:
    the spec names their folder, their identity reads back equal, and the job classifier calls them done."""
    shutil.copytree(REPO / "studies" / "default" / "records", tmp_path / "default")  # 232 KB
    folders = sorted(p.parent for p in (tmp_path / "default").rglob("metrics.json"))
    assert len(folders) == 8 + 3  # the default's 8 paper-era runs and its long generation's 3
    run_specs = []
    for folder in folders:
        cfg = OmegaConf.load(folder / "config.yaml")
        cfg.runs_dir = str(tmp_path)
        s = prepare(cfg)  # check_reusable: a finished record of another identity would be refused here
        assert s.path == folder
        assert record_identity(s.path) == s.identity
        run_specs.append(s)
    assert [w.state for w in classify([[]] * len(run_specs), run_specs)] == ["done"] * len(folders)


def test_the_defaults_sweeps_find_their_committed_records_done(hydra_ctx, tmp_path):
    """experiment=default_long_generation crosses ``++policy.compress=null,interval``: full's record (no compress
    key) is its null cell's identity, so the default and its companion call all 8 + 3 records done."""
    from h2o.pipeline.sweep import expand

    shutil.copytree(REPO / "studies" / "default" / "records", tmp_path / "default")
    for exp, n in (("default", 8), ("default_long_generation", 3)):
        sweep = expand([f"experiment={exp}", f"runs_dir={tmp_path}"], multirun=True)
        assert [w.state for w in classify(sweep.jobs, sweep.specs)] == ["done"] * n


def test_a_null_schedule_option_is_the_policys_own_default_in_the_identity(hydra_ctx, tmp_path):
    """``++policy.compress=null`` is the folder's and the identity's no option at all; a set value is neither, and
    the refusal names the key the record lacks as absent (not as None)."""
    runs = f"runs_dir={tmp_path}"
    bare = prepare(_compose([*TINY, runs, "policy=h2o"]))
    null = prepare(_compose([*TINY, runs, "policy=h2o", "++policy.compress=null", "++policy.interval=null"]))
    assert (null.path, null.identity) == (bare.path, bare.identity) and null.cfg.policy.compress is None
    decode = prepare(_compose([*TINY, runs, "policy=h2o", "++policy.compress=decode"]))
    assert decode.path != bare.path and decode.identity["policy"]["compress"] == "decode"
    bare.path.mkdir(parents=True)
    (bare.path / "config.yaml").write_text(OmegaConf.to_yaml(bare.cfg, resolve=True))
    (bare.path / "metrics.json").write_text(json.dumps({**bare.head(), "metrics": {}, "n_samples": 0, "wall_s": 0}))
    assert record_identity(bare.path) == null.identity
    with pytest.raises(ConfigError, match=r"policy.compress: absent there, 'decode' here"):
        check_reusable(bare.path, decode.identity)


def test_every_recorded_experiment_still_exists():
    assert set(recorded()) <= {f.stem for f in (CONF / "experiment").glob("*.yaml")}
    assert len(recorded()["fig4"]) == 882 and len(set(recorded()["fig4"])) == 630


# ------------------------------------------------------------------------------------------- one Slurm path
def test_make_sweep_on_slurm_is_h2o_run_with_the_slurm_launcher():
    for extra, tail in ((["LAUNCHER=slurm"], []), (["DRY=1"], ["--dry", "--list"])):
        out = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/installed", "sweep", "EXP=table1",
                              *extra], cwd=REPO, capture_output=True, text=True, timeout=60)
        line = next(ln for ln in out.stdout.splitlines() if "python" in ln)
        assert line.split()[1:] == ["-m", "h2o.pipeline.run", "-m", "experiment=table1", "hydra/launcher=slurm",
                                    *tail], line


def test_the_slurm_spelling_calls_the_launcher_in_process(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "main", lambda argv: seen.append(argv) or 0)
    assert run.main(["-m", "experiment=table1", "hydra/launcher=slurm", "hydra.launcher.chunk=2", "--dry"]) == 0
    assert seen == [["experiment=table1", "hydra.launcher.chunk=2", "--dry"]]


def test_a_slurm_setting_has_two_spellings(capsys):
    assert launch.cluster_config(["hydra.launcher.chunk=3", "cluster.partition=gpu"]).chunk == 3
    assert launch.cluster_config(["hydra.launcher.partition=gpu"]) == launch.cluster_config(["cluster.partition=gpu"])
    assert launch.main(["experiment=table1", "hydra.launcher.timeout_min=5", "--dry"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: hydra.launcher.timeout_min: no such cluster setting; allowed: partition")


# ------------------------------------------------------------------------------------------- layout
def test_core_validate_holds_only_the_errors_and_checks_of_policies_and_models():
    tree = ast.parse((REPO / "h2o" / "core" / "validate.py").read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert names == {"BadInput", "ConfigError", "check", "is_int", "is_number"}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert imported <= {"annotations", "math", "Any"}  # no argparse, sys, os or paths


def test_the_cli_guard_turns_bad_input_into_one_line_and_exit_2(capsys):
    from h2o.cli.args import ArgParser, guard

    @guard
    def main(argv):
        parser = ArgParser(prog="prog")
        parser.add_argument("--n", type=int)
        parser.parse_args(argv)
        return 0

    assert main(["--n", "x"]) == 2
    assert capsys.readouterr().err.strip() == "error: prog: argument --n: invalid int value: 'x'"


HISTORY = re.compile(r"\bissue \d+|\bissue's\b|~\d+ before\b|\bwas \d|\bno longer\b|\bformerly\b|\bolder (spelling|home|"
                     r"place|way|name)s?\b|\bstill works\b|\bmoved (here )?from\b|\bused to (live|be)\b", re.I)


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment (``#``) and, for Python, each docstring line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [(i, ln.split("#", 1)[1]) for i, ln in enumerate(text.splitlines(), 1) if "#" in ln]
    import io
    import tokenize

    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out += [(node.body[0].lineno + i, ln) for i, ln in enumerate(doc.splitlines())]
    return out


def test_comments_explain_and_never_narrate_history():
    files = [*(REPO / "h2o").rglob("*.py"), *(REPO / "analysis").rglob("*.py"), *(REPO / "tools").rglob("*.py"),
             *(REPO / "conf").rglob("*.yaml"), REPO / "Makefile"]
    found = [f"{f.relative_to(REPO)}:{i}: {c.strip()}" for f in files for i, c in comments(f) if HISTORY.search(c)]
    assert found == []


def test_spec_reads_hydra_internals_only_where_its_sweep_module_says_why():
    users = [p.relative_to(REPO).as_posix() for p in (REPO / "h2o").rglob("*.py")
             if "hydra._internal" in p.read_text(encoding="utf-8")]
    assert users == ["h2o/pipeline/sweep.py"]
    doc = ast.get_docstring(ast.parse((REPO / "h2o/pipeline/sweep.py").read_text(encoding="utf-8")))
    assert "hydra._internal" in doc and "public" in doc
    assert "structured-config schema" in (spec.__doc__ or "")


def test_no_module_over_400_lines():
    long = {p.relative_to(REPO).as_posix(): n for p in [*(REPO / "h2o").rglob("*.py"), *(REPO / "analysis").rglob("*.py")]
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}
