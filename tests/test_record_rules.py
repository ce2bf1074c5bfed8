"""The two rules of a run's record (h2o.pipeline.fields, h2o.pipeline.spec.ADDED): one merge of the run's fields, the
policy's described options and the task's info, which rebuilds every committed record as it is written; one rule for
the keys that older configs lack, which keeps their folders and identities."""
from __future__ import annotations

import inspect
import json
import re

import pytest
from omegaconf import OmegaConf, open_dict

from h2o.assets.paths import CONF, REPO, group_defaults
from h2o.core.policies import Policy, make_policy
from h2o.core.validate import ConfigError
from h2o.pipeline.fields import MEASURED, record_fields
from h2o.store.folders import runs_root
from h2o.store.identity import record_identity
from h2o.pipeline.spec import ADDED, prepare
from h2o.pipeline.sweep import _compose

TINY = ["model=tiny-llama", "task=bb_copa", "task.limit=2", "task.shots=0"]


def lacks_only_policy_window(text: str, mine: str) -> bool:
    """A committed record written without rule 3's ``policy_<name>``: a perplexity record whose policy has a
    ``window`` option (SnapKV's observation window, in its ``policy_options``) beside the task's own ``window``, and
    whose rebuild differs from it only by the ``policy_window`` line the rule adds there."""
    have, rebuilt = json.loads(text), json.loads(mine)
    return (have.get("task_kind") == "perplexity" and "window" in have
            and "window" in (have.get("policy_options") or {}) and set(rebuilt) - set(have) == {"policy_window"}
            and re.sub(r'\n  "policy_window": \d+,', "", mine) == text)


# ------------------------------------------------------------------------------------------- one merge rule
def test_the_rule_run_over_policy_task_over_both_and_the_policys_value_beside():
    run = {"seed": 0, "budget": 0.2, "policy_options": {"seed": 3, "window": 64}}
    described = {"seed": 3, "window": 64, "kernel": 5}
    out = record_fields(run, described, {"wall_s": 1.0, "batch_size": None}, {"window": 1152, "batch_size": 8,
                                                                              "context": 1024})
    assert out == {"seed": 0, "budget": 0.2, "policy_options": {"seed": 3, "window": 64}, "window": 1152,
                   "kernel": 5, "wall_s": 1.0, "batch_size": 8, "policy_window": 64, "context": 1024}
    assert list(out) == ["seed", "budget", "policy_options", "window", "kernel", "wall_s", "batch_size",
                         "policy_window", "context"]  # a replaced value keeps its place
    assert "policy_seed" not in record_fields(run, described, {}, {"seed": 0})  # the policy's seed never was shown


def test_execute_merges_once_with_the_policy_described_once(hydra_ctx, tmp_path, monkeypatch):
    """h2o.pipeline.job.execute (model load and task run replaced): metrics.json is the spec's record of what it
    measured (MEASURED, in that order) and the task's info, the policy's describe() called once."""
    from h2o.pipeline.job import execute
    from h2o.tasks.base import Result

    spec = prepare(_compose([*TINY, "policy=snapkv", "policy.compress=prefill", f"runs_dir={tmp_path}"]))
    calls, real = [], type(spec.policy).describe
    monkeypatch.setattr(type(spec.policy), "describe", lambda self: calls.append(1) or real(self))
    monkeypatch.setattr(type(spec.model), "load", lambda self: (object(), None))
    monkeypatch.setattr(type(spec.task), "protocol", lambda self, tok: {"scoring": "sum", "add_bos_token": False})
    monkeypatch.setattr(type(spec.task), "run",
                        lambda self, *a, **k: Result({"acc": 0.5}, [{"doc_id": 0}], {"window": 1152, "n": 1}))
    returned = execute(spec)
    written = json.loads((spec.path / "metrics.json").read_text())
    assert len(calls) == 1 and written == returned
    head = list(spec.head())
    assert list(written)[:len(head)] == head and written["window"] == 1152 and written["policy_window"] == 64
    assert list(written)[len(head):] == [*MEASURED, "policy_window", "n"]


def rebuilt(path, spec) -> str:
    """metrics.json at ``path`` rebuilt by the rule from ``spec`` (its config) and the fields the config cannot
    give: what the run measured and the task's info, read back from the record."""
    record = json.loads((path / "metrics.json").read_text())
    run, described = spec.run_fields(), spec.policy.describe()
    measured = {k: record[k] for k in MEASURED if k in record}
    info = {}
    for key, value in record.items():
        if key in run or key in measured or (key.startswith("policy_") and key[7:] in described):
            continue
        if key not in described or f"policy_{key}" in record or value != described[key]:
            info[key] = value  # a task's field (one that displaced the policy's value: rule 3)
    return json.dumps(record_fields(run, described, measured, info), indent=2, default=str) + "\n"


def test_every_committed_record_rebuilds_from_its_config_as_it_is_written(hydra_ctx, tmp_path, monkeypatch):
    """Every metrics.json under studies/ (and runs/): the head its config.yaml gives and the rule's merge equal
    the file byte for byte, its folder and identity are the spec's (kvquant's calibration file is not loaded)."""
    from h2o.assets import triattention
    from h2o.core.quant.kvquant import KVQuant

    monkeypatch.setattr(KVQuant, "load", lambda self, calibration: None)  # its describe() reads no calibration
    # triattention's calibration file is not on a fresh machine: the record's own (what its describe() writes)
    from h2o.core.policies.triattention import FIELDS

    written: dict = {}
    monkeypatch.setattr(triattention, "require", lambda model: {**dict.fromkeys(FIELDS), **written["calibration"]})
    folders = sorted(p.parent for p in [*REPO.glob("studies/**/metrics.json"), *REPO.glob("runs/**/metrics.json")])
    assert len(folders) >= 208
    equal, before = 0, []
    for folder in folders:
        written.update(calibration=json.loads((folder / "metrics.json").read_text()).get("calibration") or {})
        cfg = OmegaConf.load(folder / "config.yaml")
        cfg.runs_dir = str(tmp_path)
        spec = prepare(cfg)
        records = next((p for p in folder.parents if p.name in ("records", "runs")), None)
        if records is not None:  # <study>/records stands for <runs_dir>/<experiment_name>
            inside = spec.path.relative_to(runs_root(spec.cfg) / (spec.cfg.experiment_name if records.name ==
                                                                 "records" else ""))
            assert inside == folder.relative_to(records), folder
        assert record_identity(folder) == spec.identity, folder
        text, mine = (folder / "metrics.json").read_text(), rebuilt(folder, spec)
        if mine == text:
            equal += 1
            continue
        assert lacks_only_policy_window(text, mine), folder
        before.append(folder)
    assert before
    print(f"{equal} of {len(folders)} byte-equal, {len(before)} lack only policy_window")


# ------------------------------------------------------------------------------------------- one rule for added keys
def drop(cfg, *keys):
    """A copy of ``cfg`` without the dotted ``keys`` it has."""
    cfg = cfg.copy()
    with open_dict(cfg):
        for key in keys:
            *group, name = key.split(".")
            (cfg[group[0]] if group else cfg).pop(name, None)
    return cfg


def test_a_key_older_configs_lack_takes_its_default_and_is_left_out_at_it(hydra_ctx, tmp_path):
    root = ["model=tiny-llama", "task=niah", "task.lengths=[512]", f"runs_dir={tmp_path}"]
    plain = prepare(_compose(root))
    assert "question" not in plain.cfg.task and "grid_only" not in plain.cfg and plain.task.question == "prompt"
    older = prepare(drop(_compose(root), *ADDED))  # a config written before every added key
    assert (older.path, older.identity, older.task.question, older.model.positions, older.settings.grid_only) == (
        plain.path, plain.identity, "prompt", None, [])
    spelled = prepare(_compose([*root, "task.question=prompt", "++model.positions=null", "grid_only=[]"]))
    assert (spelled.path, spelled.identity, OmegaConf.to_yaml(spelled.cfg)) == (
        plain.path, plain.identity, OmegaConf.to_yaml(plain.cfg))
    kept = prepare(_compose([*root, "++model.positions=4096"]))  # not its default: kept (out of folders: IGNORED)
    assert kept.cfg.model.positions == 4096 and kept.path == plain.path


@pytest.mark.parametrize("key, words", [("task.limit", "task.limit: missing (removed?); every key of "
                                                       "conf/task/bb_copa.yaml is required"),
                                        ("seed", "seed: missing (removed?); it is required")])
def test_a_really_missing_key_is_one_line_naming_it(hydra_ctx, key, words):
    with pytest.raises(ConfigError) as err:
        prepare(drop(_compose(TINY), key))
    assert str(err.value) == words


def test_an_added_keys_default_is_its_class_default_or_the_root_configs():
    from hydra.utils import get_method

    root = OmegaConf.load(CONF / "config.yaml")
    checked = []
    for key, default in ADDED.items():
        *group, name = key.split(".")
        if not group:
            assert OmegaConf.to_container(root)[name] == default, key
            checked.append(key)
            continue
        for f in sorted((CONF / group[0]).glob("*.yaml")):
            conf = group_defaults(group[0], f.stem)
            target = get_method(conf["_target_"])
            if target is make_policy:  # a policy's options: its rule's class
                target = Policy.registry[conf["name"]]
            param = inspect.signature(target).parameters.get(name)
            if param is not None:
                assert param.default == default, f"{key} of {group[0]}={f.stem}: {param.default!r}"
                checked.append(key)
    assert set(checked) == set(ADDED)
