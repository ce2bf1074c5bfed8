"""``make bench`` = ``h2o-run experiment=bench``: one record, the same whichever way in; bad values fail first."""
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from h2o.bench.targets import TARGETS, meets
from h2o.bench.variants import budget_tokens
from h2o.pipeline.run import main
from h2o.pipeline.sweep import expand

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-llama", "task.long=[40,3]", "task.short=[32,1]", "task.e2e=[24,2]", "task.sim=24",
        "task.memory=[24,3]", "task.gen_len=3", "task.short_gen=4", "task.repeats=1", "task.warmup=0",
        "task.prefill_chunk=16", "task.max_batch_cap=6", "task.methods=[24,2]", "task.methods_gen=3", "task.long_gen=[12,2]", "task.long_gen_prompt=8",
        "task.long_gen_budget=6", "task.long_gen_interval=4", "threads=1"]


def make_bench_argv(args: str) -> list[str]:
    """The command ``make bench`` runs (``make -n``), less ``python -m h2o.pipeline.run``."""
    text = subprocess.run(["make", "-n", "bench", "PY=python", f"ARGS={args}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.replace("\\\n", " ")
    argv = shlex.split(next(line for line in text.splitlines() if "h2o.pipeline.run" in line))
    assert argv[:4] == ["python", "-m", "h2o.pipeline.run", "experiment=bench"]
    return argv[3:]


def test_make_bench_writes_the_experiments_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = make_bench_argv(" ".join(TINY + [f"runs_dir={tmp_path}/runs"]))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== targets" in out and "simulated forward 24 h2o/eager (CPU time)" in out and "largest batch in" in out
    assert "== methods: prompt 24 x batch 2, gen 3, budget 0.2" in out
    [path] = list((tmp_path / "runs" / "bench").rglob("metrics.json"))
    rec = json.loads(path.read_text())
    assert rec["experiment"] == "bench" and rec["task"] == "bench_targets" and rec["task_kind"] == "benchmark_targets"
    assert (rec["policy"], rec["budget"]) == ("h2o", 0.2)
    m, targets = rec["metrics"], rec["targets"]
    assert m["kv_bytes_prefill 40x3 h2o/full"] == pytest.approx(budget_tokens(0.2, 40) / 40)
    assert targets["kv_bytes_max 40x3 h2o/full"]["met"]  # 8 kept of 40 + 2 decoded
    from h2o.bench.every_policy import method_names  # every method's row, the targets untouched by them
    assert [r["method"] for r in rec["methods"]] == ["full", *method_names()]
    from h2o.bench.long_generation import schedules  # every schedule of every decode-time method beside full
    assert "== long generation: prompt 8 x batch 2, 12 tokens generated" in out
    rows = rec["long_generation"]
    assert [(r["method"], r["compress"], r["interval"]) for r in rows] == [("full", None, None)] + [
        (m, kw["compress"], kw.get("interval")) for m, kw in schedules(4)]
    assert all(r["kv_max_vs_full"] < 1 for r in rows[1:])  # 6 (+ 4 between cuts) held of full's 8 + 11
    reads = rec["host_reads_per_layer_step"]  # every rule's, each schedule (tests/test_launches.py: the values)
    assert "== host reads per layer per decoding step" in out and reads["h2o/decode"] == 0 and "r_kv/interval" in reads
    assert set(targets) == set(m) and all(t["met"] == meets("decode_long", t["value"]) for k, t in targets.items()
                                          if k.startswith("decode 40x3 h2o/"))
    samples = [json.loads(x) for x in (path.parent / "samples.jsonl").read_text().splitlines()]
    assert {s["prefill_mode"] for s in samples if "prefill_mode" in s} == {"shared", "each"}
    gens = {(s["prompt_len"], s["batch_size"]): s["gen_len"] for s in samples if s.get("prefill_mode") == "shared"
            and "kv_limit_bytes" not in s}
    assert gens == {(40, 3): 3, (32, 1): 4}  # gen_len at long, short_gen at short
    assert any("kv_limit_bytes" in s for s in samples) and any(s["semantics"] == "simulated" for s in samples)
    capped = {s["policy"]: s for s in samples if "max_batch_method" in s}
    assert set(capped) == {"full", "h2o"} and all(s["max_batch_method"] == "estimate" for s in capped.values())
    assert capped["h2o"]["metrics"]["kv_bytes_per_seq"] < capped["full"]["metrics"]["kv_bytes_per_seq"]
    # the other ways in (h2o-run experiment=bench, the same as a one-job multirun) name this very record, with the
    # same identity (prepare raises otherwise), and skip it as finished: one record, whichever way
    for multirun in (False, True):
        [spec] = expand(["experiment=bench", *TINY, f"runs_dir={tmp_path}/runs"], multirun).specs
        assert spec.path.resolve() == path.parent.resolve()
    before = path.read_text()
    assert main(["experiment=bench", *TINY, f"runs_dir={tmp_path}/runs"]) == 0
    assert path.read_text() == before


def test_h2o_run_leaves_the_root_logger_as_it_found_it(monkeypatch, tmp_path, capsys):
    """Hydra's logging configs bind a handler to the sys.stdout of the run (here capsys's, closed after this test):
    main takes it off again, so no later log line of the process writes to a closed file."""
    import logging

    from h2o.pipeline import run

    monkeypatch.chdir(tmp_path)  # Hydra's scratch folder (outputs/)
    monkeypatch.setattr(run, "run_job", lambda cfg: "done")  # the job itself is not the point
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    assert main(["experiment=bench", *TINY, f"runs_dir={tmp_path}"]) == 0
    assert (root.handlers, root.level) == before


def test_targets_live_in_one_place():
    assert TARGETS == {"decode_long": (">=", 2.0), "decode_short": (">=", 1.15), "kv_bytes": ("<=", 0.21),
                       "simulated": ("<=", 2.0), "simulated_ops": ("<=", 1.5), "syncs_per_step": ("<=", 1)}
    assert meets("decode_long", 2.0) and not meets("decode_short", 1.1) and not meets("kv_bytes", 0.22)


BAD = [
    (["task.long=[0,8]"], ["task.long=[0, 8]", "two ints >= 1"]),
    (["task.memory=[1024]"], ["task.memory=[1024]", "prompt, generated tokens"]),
    (["task.memory_fraction=1.5"], ["task.memory_fraction=1.5", "(0, 1]"]),
    (["task.compare=[lru]"], ["task.compare=['lru']", "'lru'", "h2o"]),
    (["task.repeats=0"], ["task.repeats=0", ">= 1"]),
    (["task.short_gen=0"], ["task.short_gen=0", ">= 1"]),
    (["policy=full"], ["policy=full", "the reference", "allowed: ", "h2o"]),
    (["policy.budget=1.0"], ["policy=h2o policy.budget=1.0", "the reference", "below 1.0"]),
]


@pytest.mark.parametrize("args, words", BAD, ids=[a[0].split("=")[0] for a, _ in BAD])
def test_bench_experiment_bad_input(args, words, capsys, tmp_path, monkeypatch):
    """Through make's command line: one line, exit 2, no model loaded."""
    from tests.test_hardening import no_load, one_line_exit_2

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    code = main(make_bench_argv(" ".join(["model=tiny-llama", f"runs_dir={tmp_path}/runs", *args])))
    one_line_exit_2(code, capsys, words)


def test_bench_cli_writes_no_run_records(capsys):
    """``python -m h2o.bench`` explores; the targets suite and run folders are the experiment's only."""
    from h2o.bench.__main__ import main as cli
    for flag in (["--suite", "targets"], ["--runs", "runs"]):
        assert cli(flag) == 2 and "unrecognized arguments" in capsys.readouterr().err
