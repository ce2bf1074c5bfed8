"""The wandb mirror, read back offline: one run per record (ids, names, groups, job types, tags from the folder),
numbers as numbers, samples as typed tables, streaming as history against tokens, idempotent syncs, the
experiment's summary run (Fig. 4 as native line plots, analysis tables and figures, the report), and wandb never
failing a run nor being needed at import."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from wandb_offline import read_runs  # noqa: E402

from h2o.pipeline import wandb_sync  # noqa: E402
from h2o.pipeline.wandb_mirror import identity, run_id  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXP = "fig4x"
ACC = {("full", 1.0): 0.8, ("local", 0.1): 0.4, ("local", 0.2): 0.6, ("h2o", 0.1): 0.7, ("h2o", 0.2): 0.78}


def write(folder: Path, record: dict, samples: list[dict] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (folder / "metrics.json").write_text(json.dumps(record))
    return folder


def make_records(root: Path) -> dict[str, dict]:
    """Records as the runner and the bench CLIs write them: {name under root: record}."""
    out = {}
    for (policy, budget), acc in ACC.items():
        name = f"{EXP}/tiny-llama/bb_copa/shots0/{policy}/{budget}"
        rec = {"experiment": EXP, "model": "tiny-llama", "task": "bb_copa", "task_kind": "multiple_choice",
               "policy": policy, "budget": budget, "shots": 0, "semantics": "simulated", "scoring": "mean",
               "seed": 0, "limit": 4, "n_samples": 4, "wall_s": 1.25, "policy_options": {},
               "metrics": {"acc": acc, "acc_stderr": 0.1}}
        write(root / name, rec, [{"doc_id": i, "acc": float(i % 2), "target": "a", "resps": [[-1.5, False]]}
                                 for i in range(4)])
        out[name] = rec
    name = f"{EXP}/tiny-llama/austen/shots0/h2o/64tok"
    rec = {"experiment": EXP, "model": "tiny-llama", "task": "bench_streaming", "task_kind": "streaming",
           "policy": "h2o", "budget": 64, "semantics": "real", "n_samples": 96, "wall_s": 2.0,
           "metrics": {"ppl": 30.5, "tokens": 96, "wall_s": 2.0, "ppl_past_context": None}}
    write(root / name, rec, [{"tokens": 32 * (i + 1), "ppl": 40.0 - i, "cache_tokens": min(64, 32 * (i + 1))}
                             for i in range(3)])
    out[name] = rec
    name = f"{EXP}/tiny-llama/real_h2o_0.2_512_8_1_each"  # a bench CLI folder: no config.yaml, nested ratios
    rec = {"experiment": EXP, "model": "tiny-llama", "policy": "h2o", "budget": 0.2, "semantics": "real",
           "prompt_len": 512, "gen_len": 8, "batch_size": 1,
           "metrics": {"decode_tok_s": 20.5, "kv_bytes": 1024, "vs_full": {"decode_tok_s": 1.5, "kv_bytes": 0.2}}}
    write(root / name, rec, [{"policy": "full", "metrics": {"decode_tok_s": 13.0}}])
    out[name] = rec
    return out


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    return tmp_path


def offline_dirs(root: Path) -> list[Path]:
    return sorted((root / ".wandb").rglob("offline-run-*"))


def test_sync_logs_one_run_per_record_and_a_second_sync_creates_none(offline, capsys):
    root = offline / "runs"
    recs = make_records(root)
    sweep = offline / "multirun" / EXP / "2026-01-01_00-00-00"  # the runner's job log names the sweep
    sweep.mkdir(parents=True)
    (sweep / "jobs.jsonl").write_text(json.dumps({"status": "done", "run_dir": str(root / next(iter(recs)))}) + "\n")
    assert wandb_sync.main([str(root), "--multirun", str(offline / "multirun")]) == 0
    assert "7 logged, 0 unchanged, 0 failed" in capsys.readouterr().out
    runs = {r.name: r for r in read_runs(root / ".wandb")}
    assert set(runs) == set(recs)
    for name, rec in recs.items():
        run = runs[name]
        assert run.id == run_id(EXP, name) == identity(rec, name)["id"] and run.id.startswith(f"{EXP}-")
        assert run.group == EXP and run.config["experiment"] == EXP and run.config["record"] == name
        assert run.job_type == rec.get("task", "benchmark")
        budget = "1.0" if rec["policy"] == "full" else "64tok" if rec["budget"] == 64 else str(rec["budget"])
        assert set(run.tags) == {f"model:{rec['model']}", f"policy:{rec['policy']}", f"budget:{budget}",
                                 f"semantics:{rec['semantics']}", *([f"scoring:{rec.get('scoring')}"] * ("scoring" in rec))}
        last = run.history[-1]
        for key, value in rec["metrics"].items():
            if isinstance(value, (int, float)):
                key = f"metric_{key}" if key in rec and key != "metrics" else key
                assert last[key] == value and type(last[key]) in (int, float), (name, key)  # a number, not text
    assert [r.config.get("sweep") for r in runs.values()].count(str(sweep)) == 1
    assert runs[next(iter(recs))].config["sweep"] == str(sweep)
    copa = runs[f"{EXP}/tiny-llama/bb_copa/shots0/h2o/0.1"]
    assert copa.config["budget"] == 0.1 and copa.config["scoring"] == "mean" and copa.history[-1]["n_samples"] == 4
    samples = copa.table("samples")
    assert samples["columns"] == ["doc_id", "acc", "target", "resps"]
    assert [r[:3] for r in samples["data"]] == [[i, float(i % 2), "a"] for i in range(4)]
    assert all(type(r[0]) is int and type(r[1]) in (int, float) and r[3] == "[[-1.5, false]]" for r in samples["data"])
    bench = runs[f"{EXP}/tiny-llama/real_h2o_0.2_512_8_1_each"].history[-1]  # nested ratios, flattened
    assert bench["vs_full.decode_tok_s"] == 1.5 and bench["vs_full.kv_bytes"] == 0.2 and bench["kv_bytes"] == 1024
    assert runs[f"{EXP}/tiny-llama/real_h2o_0.2_512_8_1_each"].table("samples")["columns"] == [
        "policy", "metrics.decode_tok_s"]
    stream = runs[f"{EXP}/tiny-llama/austen/shots0/h2o/64tok"]  # a line against tokens: one step per sample
    assert stream.step_metrics == {"stream/tokens": "", "stream/*": "stream/tokens"}
    steps = [h for h in stream.history if "stream/tokens" in h]
    assert [(h["stream/tokens"], h["stream/ppl"], h["stream/cache_tokens"]) for h in steps] == [
        (32, 40.0, 32), (64, 39.0, 64), (96, 38.0, 64)]
    assert stream.history[-1]["ppl"] == 30.5 and stream.history[-1]["metric_wall_s"] == 2.0

    before = offline_dirs(root)
    assert wandb_sync.main([str(root)]) == 0  # again: everything is unchanged, nothing is logged
    assert "0 logged, 7 unchanged, 0 failed" in capsys.readouterr().out
    assert offline_dirs(root) == before
    one = root / f"{EXP}/tiny-llama/bb_copa/shots0/full/1.0"  # forced, from a folder below the root
    assert wandb_sync.main([str(one), "--force"]) == 0
    again = read_runs(root / ".wandb")
    assert len(again) == 8 and {r.id for r in again} == {r.id for r in runs.values()}  # the same run, resumed
    assert [r.name for r in again].count(f"{EXP}/tiny-llama/bb_copa/shots0/full/1.0") == 2


def test_summary_run_has_fig4_line_plots_tables_figures_and_the_report(offline):
    from h2o.pipeline.wandb_mirror import Settings
    from h2o.pipeline.wandb_summary import summarize

    root = offline / "runs"
    make_records(root)
    report = offline / "REPORT.md"
    report.write_text("# Paper vs ours\n\n| table | cell | paper | ours | verdict |\n|---|---|---|---|---|\n"
                      "| 1 | copa H2O | 0.81 | 0.78 ±0.1 | within |\n")
    assert summarize(root, EXP, Settings(mode="offline"), report)
    (run,) = read_runs(root / ".wandb")
    assert (run.name, run.group, run.job_type, run.tags) == (f"{EXP}/summary", EXP, "summary", ["summary"])
    plots = {k.split("/", 2)[2]: v["panel_config"] for k, v in run.config.items() if k.startswith("_wandb/visualize/")}
    fig4 = "fig4/tiny-llama bb_copa 0-shot simulated scoring=mean: acc"
    assert plots[fig4]["panelDefId"] == "wandb/line/v0"
    assert plots[fig4]["fieldSettings"] == {"x": "budget", "y": "acc", "stroke": "policy"}
    points = {(p, b): a for p, b, a in run.table(fig4 + "_table")["data"]}
    assert points == {**{k: v for k, v in ACC.items() if k[0] != "full"}, ("full", 0.1): 0.8, ("full", 0.2): 0.8}
    stream = plots["streaming/tiny-llama bench_streaming"]
    assert stream["fieldSettings"] == {"x": "tokens", "y": "ppl", "stroke": "line"}
    last = run.history[-1]
    tables = {k[:-len("/path")]: run.table(k[:-len("/path")]) for k in last if re.fullmatch(r"tables/.*/path", k)}
    assert f"tables/{EXP}_multiple_choice" in tables or "tables/table1" in tables  # analysis' names (issue 9 or not)
    accuracy = [row for t in tables.values() for row in t["data"] if "tiny-llama" in row and "bb_copa" in row]
    assert any(0.78 in row for row in accuracy)  # H2O at 0.2: a number, not text
    figures = [k for k in last if re.fullmatch(r"figures/.*budget_curves/_type", k)]
    assert figures and all(last[k] == "image-file" for k in figures) and last["report/_type"] == "html-file"
    assert run.table("report/0")["data"] == [[1.0, "copa H2O", 0.81, 0.78, 0.1, "within"]]


def test_fig4_curves_keep_protocols_apart_and_tables_parse_typed():
    from h2o.pipeline.wandb_mirror import typed_rows
    from h2o.pipeline.wandb_summary import curves, markdown_tables, typed_table_rows

    base = {"task_kind": "multiple_choice", "model": "m", "task": "copa", "shots": 0, "semantics": "simulated",
            "scoring": "mean", "limit": None, "seed": 0}
    recs = [("e/m/copa/shots0/full/1.0", {**base, "policy": "full", "budget": 1.0, "metrics": {"acc": 0.9}}),
            ("e/m/copa/shots0/h2o/0.2", {**base, "policy": "h2o", "budget": 0.2, "metrics": {"acc": 0.8}}),
            ("e/m/copa/shots0/h2o/0.2/seed=1", {**base, "policy": "h2o", "budget": 0.2, "seed": 1,
                                                 "metrics": {"acc": 0.6}}),
            ("e/m/copa/shots0/h2o/0.2/scoring=sum", {**base, "policy": "h2o", "budget": 0.2, "scoring": "sum",
                                                      "metrics": {"acc": 0.1}}),
            ("e/m/copa/shots0/streaming_llm/0.2/sinks=8", {**base, "policy": "streaming_llm", "budget": 0.2,
                                                            "metrics": {"acc": 0.7}}),
            ("e/m/copa/shots0/h2o/64tok", {**base, "policy": "h2o", "budget": 64, "metrics": {"acc": 0.5}})]
    got = curves(recs)  # a token budget is not Fig. 4's axis; every other record is its own protocol's point
    key = ("acc", "m", "copa", 0, "simulated", "mean", None, 0)
    assert got == {(*key, ""): [{"policy": "h2o", "budget": 0.2, "acc": 0.8}, {"policy": "full", "budget": 0.2, "acc": 0.9}],
                   (*key[:-1], 1, "seed=1"): [{"policy": "h2o", "budget": 0.2, "acc": 0.6}],
                   (*key[:5], "sum", None, 0, "scoring=sum"): [{"policy": "h2o", "budget": 0.2, "acc": 0.1}],
                   (*key, "sinks=8"): [{"policy": "streaming_llm", "budget": 0.2, "acc": 0.7}]}
    (header, rows), = markdown_tables("x\n\n| a | b | c | d | e |\n|---|:-:|---|---|---|\n"
                                      "| 0.5 ±0.1 | — | 1.9x | n/a | 85.00 · 84.0 [75.6, 89.9]† · −1.0 |\n"
                                      "| 2 | 3 | 45% | 1 | 43.20 · not run |\n")
    assert typed_table_rows(header, rows) == [
        {"a": 0.5, "a ±": 0.1, "b": None, "c": 1.9, "d": "n/a",
         "e paper": 85.0, "e": 84.0, "e lo": 75.6, "e hi": 89.9, "e diff": -1.0},
        {"a": 2.0, "a ±": None, "b": 3.0, "c": 45.0, "d": "1",
         "e paper": 43.2, "e": None, "e lo": None, "e hi": None, "e diff": None}]
    cols, data = typed_rows([{"n": 1, "x": {"y": 2.5}, "t": [1]}, {"n": None, "x": {"y": 3}, "t": "s", "f": True}])
    assert cols == ["n", "x.y", "t", "f"] and data == [[1, 2.5, "[1]", None], [None, 3, "s", True]]


def test_wandb_is_optional_and_its_failure_loses_nothing(tmp_path, monkeypatch, capsys):
    import ast

    for path in (REPO / "h2o").rglob("*.py"):  # no module imports wandb when it is imported
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(x == "wandb" or x.startswith("wandb.") for x in names), path
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    root = tmp_path / "runs"
    make_records(root)
    folder = root / EXP / "tiny-llama/bb_copa/shots0/h2o/0.2"
    from h2o.pipeline.wandb_mirror import Settings, mirror_folder

    assert mirror_folder(folder, Settings()) == "failed"
    assert wandb_sync.main([str(root)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"[h2o] wandb mirror failed for {folder} (ModuleNotFoundError: import of wandb halted; None in "
        "sys.modules); the run record is intact", "error: wandb is not installed; `pip install wandb` to mirror records"]
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json", "samples.jsonl"]
    assert not (root / ".wandb").exists()


def test_sync_imports_no_torch(tmp_path):
    """``import h2o`` is lazy (PEP 562): the sync command line runs where torch cannot be imported."""
    import subprocess

    from no_torch import blocker

    code = blocker() + (f"from h2o.pipeline.wandb_sync import main\nsys.exit(main([{str(tmp_path)!r}, '--mode', "
                        "'disabled']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 logged, 0 unchanged, 0 failed" in out.stdout
