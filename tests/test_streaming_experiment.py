"""One entry point for the streaming benchmark: ``make stream`` is ``h2o-run -m experiment=streaming`` (policy x
budget x chunk), its records come from the runner (values equal to a direct call of the streaming function, a
finished run not run again; analysis.streaming_study compares the chunks), the task's live windows, and bad
values one line, exit 2, before the model loads."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from analysis import streaming_study as ss
from h2o.assets import model_spec
from h2o.assets.model_spec import resolve_tiny
from h2o.assets.models import load_model
from h2o.tasks.streaming import StreamingTask, load_text, stream, text_ids
from h2o.core.policies import make_policy
from h2o.assets.paths import REPO
from h2o.store.files import read_jsonl
from h2o.pipeline.run import main
from h2o.pipeline.sweep import expand
from h2o.tasks.progress import recording

TOKENS, BUDGET, WINDOW = 300, 32, 100


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(f"Chapter {i}. It is a truth universally acknowledged, said Emma to Mr. Knightley."
                             for i in range(40)))
    return path


def make_stream(*assignments: str, dry: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``make [-n] stream`` with the venv's install step taken as done and this Python."""
    cmd = ["make", "--no-print-directory", *(["-n"] if dry else []), "-o", ".venv/installed", "stream",
           f"PY={sys.executable}", *assignments]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def runner_args(dry_run: str) -> list[str]:
    """The overrides ``make -n stream`` passes to h2o.pipeline.run."""
    line = dry_run.replace("\\\n", " ")
    cmd = shlex.split(line[line.index("-m h2o.pipeline.run"):].split(";")[0])
    return cmd[2:]


def test_make_stream_is_the_experiment_with_the_knobs_as_overrides():
    out = make_stream("STREAM_TOKENS=500", "STREAM_BUDGETS=64,128", "STREAM_POLICIES=h2o,local")
    assert out.returncode == 0, out.stderr
    args = runner_args(out.stdout)
    assert args[:2] == ["-m", "experiment=streaming"]
    assert {"task.tokens=500", "policy=h2o,local", "policy.budget=64,128", "task.chunk=1,32"} <= set(args)
    assert "-m analysis.streaming_study ${H2O_RUNS:-runs}/streaming" in out.stdout  # then the chunk comparison
    sweep = expand(args[1:], True)
    jobs = sorted((p.policy.name, p.policy.budget, p.task.chunk, p.task.tokens) for p in sweep.specs)
    assert jobs == sorted((p, b, c, 500) for p in ("h2o", "local") for b in (64, 128) for c in (1, 32))
    h2o = next(p for p in sweep.specs if p.policy.name == "h2o" and p.policy.budget == 64 and p.task.chunk == 32)
    assert (h2o.policy.heavy, h2o.policy.recent) == (21, 43)  # the authors' heavy share 1/3
    assert h2o.path.parts[-7:-1] == ("streaming", "smollm2-135m", "bench_streaming", "shots0", "h2o", "64tok")
    assert "chunk=32" in h2o.path.name and "tokens=500" in h2o.path.name
    single = runner_args(make_stream("STREAM_COMPARE_CHUNK=0").stdout)
    assert "task.chunk=1" in single and "policy.budget=96,192,384" in single


def test_make_stream_bad_value_is_one_line_exit_2_before_loading(tmp_path):
    out = make_stream("STREAM_POLICIES=h2o", "STREAM_BUDGETS=0.2", "STREAM_COMPARE_CHUNK=0", dry=False,
                      env={"H2O_RUNS": str(tmp_path / "runs")})
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if not line.startswith("make")]
    assert len(errors) == 1 and errors[0].startswith("error: policy.budget=0.2: streaming needs a cache size in "
                                                     "tokens"), out.stderr
    assert not (tmp_path / "runs").exists()  # nor did the study run: its complaint would be a second line


def test_bad_values_fail_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model_spec._LOADED.clear()
    for bad, words in [("policy.budget=0.25", "policy.budget=0.25: streaming needs a cache size in tokens"),
                       ("task.chunk=0", "task.chunk=0: expected a positive int"),
                       ("task.positions=text", "task.positions='text': allowed: cache, true")]:
        assert main(["-m", "experiment=streaming", "model=tiny-llama", "policy=h2o", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err
    assert not model_spec._LOADED and not (tmp_path / "runs").exists()


def test_the_record_is_the_streaming_function_and_a_finished_run_is_skipped(text, tmp_path, monkeypatch):
    """Two runs of the sweep (chunks 1 and 4): each record's metrics and samples equal a direct call of
    ``stream``; the same command again skips both, their records untouched."""
    monkeypatch.chdir(tmp_path)
    args = ["-m", "experiment=streaming", "model=tiny-llama", "policy=h2o", f"policy.budget={BUDGET}",
            "task.chunk=1,4", f"task.text={text}", f"task.tokens={TOKENS}", f"task.window={WINDOW}", "threads=1"]
    assert main(args) == 0
    recs = {json.loads(f.read_text())["protocol"]["chunk"]: f for f in (tmp_path / "runs").rglob("metrics.json")}
    assert sorted(recs) == [1, 4]
    model, tok = load_model(resolve_tiny("tiny:llama"), "fp32")
    ids = text_ids(tok, load_text(str(text)), TOKENS)
    policy = make_policy("h2o", budget=BUDGET, heavy_share=1 / 3)
    for chunk, f in recs.items():
        rec = json.loads(f.read_text())
        want, samples = stream(model, ids, policy, chunk=chunk, window=WINDOW)
        got = rec["metrics"]
        assert (got["tokens"], got["cache_tokens_max"], got["max_position_id"]) == \
            (TOKENS, BUDGET, want["max_position_id"]) == (TOKENS, BUDGET, BUDGET + chunk - 1)
        assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-5) and got["nll"] == pytest.approx(want["nll"], rel=1e-5)
        rows = read_jsonl(f.parent / "samples.jsonl")
        assert [r["tokens"] for r in rows] == [100, 200, 300]
        assert [r["ppl"] for r in rows] == pytest.approx([s["ppl"] for s in samples], rel=1e-5)
        assert (rec["task_kind"], rec["heavy"], rec["recent"]) == ("streaming", 11, 21)
        assert not (f.parent / "partial").exists()
    ppl = {c: json.loads(f.read_text())["metrics"]["ppl"] for c, f in recs.items()}
    assert ss.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0  # make stream's last step
    md = (tmp_path / "out" / "study.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("- h2o at 32 tokens, chunks of 4 vs token by token: "))
    a, b = line.split("perplexity ")[1].split(" (")[0].split(" vs ")
    assert (float(a), float(b)) == pytest.approx((ppl[4], ppl[1]), abs=6e-4)
    stamps = {f: f.stat().st_mtime_ns for f in recs.values()}
    assert main(args) == 0
    jobs = [j for f in (tmp_path / "multirun").rglob("jobs.jsonl") for j in read_jsonl(f)]
    assert sorted(j["status"] for j in jobs) == ["done", "done", "skipped", "skipped"]
    assert {f: f.stat().st_mtime_ns for f in recs.values()} == stamps


def test_the_task_shows_progress_and_writes_each_window_live(text, tmp_path, capsys):
    model, tok = load_model(resolve_tiny("tiny:llama"), "fp32")
    task = StreamingTask("bench_streaming", text=str(text), tokens=TOKENS, window=WINDOW)
    with recording(tmp_path / "partial"):
        res = task.run(model, tok, make_policy("local", budget=BUDGET), "real", 0)
    assert read_jsonl(tmp_path / "partial" / "windows.jsonl") == json.loads(json.dumps(res.samples))
    assert "[stream] local 32 chunk 1: " in capsys.readouterr().err  # the speed and the wall time it predicts
