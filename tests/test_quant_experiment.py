"""The quantization study as an experiment (conf/experiment/quant.yaml: austen_ppl x quant): its records hold what
one simulated pass over the same windows gives (tests/test_quant.py's reference), its table comes from them
(analysis/quant_tables.py), and one helper names kvquant's calibration file (h2o.assets.paths.calibration_file)."""
from __future__ import annotations

import json

import pytest

from analysis.quant_tables import quant_tables
from analysis.records import load_runs
from analysis.tables import all_tables
from h2o.assets.paths import calibration_file
from h2o.core.policies import make_policy
from h2o.core.quant import make_quant
from h2o.core.validate import BadInput
from h2o.pipeline import run
from h2o.pipeline.sweep import expand
from test_quant import perplexity

SMALL = ["model=tiny-llama", "threads=1", "task_overrides.austen_ppl.n_windows=2",
         "++task_overrides.austen_ppl.window=96"]


def test_quant_experiment_records_make_the_table_and_match_the_bench(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the tiny model's heads have 16 channels: groups of 16 (none ignores it)
    args = ["experiment=quant", *SMALL, "quant=none,uniform", "quant.bits=4,2", "++quant.group_size=16",
            f"runs_dir={tmp_path}/runs"]
    sweep = expand(args, multirun=True)
    assert {(p.policy.name, p.policy.budget if p.policy.name != "full" else 1.0) for p in sweep.specs} == {
        ("full", 1.0), ("h2o", 0.2)}
    assert run.main(["-m", *args, f"hydra.sweep.dir={tmp_path}/multirun/q"]) == 0
    records = {}
    for f in (tmp_path / "runs").rglob("metrics.json"):
        r = json.loads(f.read_text())
        q = r.get("quant")
        records[(r["policy"], "none" if q is None else f"{q['quant']}{q['bits']}")] = r["metrics"]["ppl"]
    assert len(records) == 6  # 2 policies x {none, uniform4, uniform2}; none x bits is one run

    (table,) = quant_tables(load_runs(tmp_path / "runs"))
    assert table.name == "quant_austen_ppl_quant" and table.header == ["model", "quant", "full 1", "H2O 0.2"]
    assert [r[:2] for r in table.rows] == [["tiny-llama", "none"], ["tiny-llama", "uniform4"], ["tiny-llama", "uniform2"]]
    for row in table.rows:
        for policy, cell in zip(("full", "h2o"), row[2:]):
            assert cell.startswith(f"{records[(policy, row[1])]:.2f} [")  # value, then its 95% interval
    assert any(t.name == "quant_austen_ppl_quant" for t in all_tables(load_runs(tmp_path / "runs")))

    # one simulated pass over the same windows gives the records' numbers
    spec = next(p for p in sweep.specs if p.policy.name == "h2o" and p.quant is not None and p.quant.bits == 2)
    model, tok = spec.model.load()
    windows = spec.task.windows(tok)
    assert windows.shape == (2, 96)
    for policy, label in (("full", "none"), ("h2o", "uniform4"), ("h2o", "uniform2")):
        pol = make_policy("full") if policy == "full" else make_policy("h2o", budget=0.2)
        quant = None if label == "none" else make_quant("uniform", bits=int(label[-1]), group_size=16)
        assert perplexity(model, windows, pol, quant, 1) == pytest.approx(records[(policy, label)], rel=1e-5)


def test_one_helper_names_the_calibration_file(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    assert calibration_file("tiny:llama") == tmp_path / "cache" / "kvquant" / "tiny-llama.pt"
    assert calibration_file("smollm2-135m", "mine/x.pt") == tmp_path / "cache" / "mine" / "x.pt"
    assert calibration_file("smollm2-135m", str(tmp_path / "abs.pt")) == tmp_path / "abs.pt"
    # the kvquant config's default is that file: a run without it stops in one line naming it
    with pytest.raises(BadInput) as err:
        expand(["experiment=quant", *SMALL, "quant=kvquant", "policy=full"], multirun=True)
    assert repr(str(calibration_file("tiny-llama"))) in str(err.value)
