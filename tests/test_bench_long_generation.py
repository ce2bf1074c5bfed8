"""make bench's long-generation section (h2o/bench/long_generation.py): every schedule each decode-time method runs
(every step where it has a decoding form, every N tokens, its own: triattention's buffer, snapkv_d's interval 1)
beside full in one interleaved run, their KV bytes as the schedules hold them, some methods only
(task.long_gen_methods), the table from a record, and the docs tables from the committed records. A tiny random
model."""
from __future__ import annotations

import json

import pytest

from h2o.assets.models import tiny_model
from h2o.bench import long_generation


@pytest.fixture(scope="module")
def measured():
    return long_generation.measure(tiny_model("llama_gqa"), 10, 2, 17, 8, 4, repeats=1, warmup=0)


def test_every_schedule_of_every_method_beside_full(measured):
    rows = long_generation.rows(measured)
    decoding = [m for m in long_generation.METHODS if m != "g_kv"]  # g_kv refuses compress=decode
    assert [(r["method"], r["compress"], r["interval"]) for r in rows] == [("full", None, None)] + [
        (m, "decode", None) for m in decoding] + [(m, "interval", 4) for m in long_generation.METHODS] + [
        ("triattention", "buffer", 4), ("snapkv_d", "interval", 1)]
    by = {(r["method"], r["compress"], r["interval"]): r for r in rows}
    full = rows[0]
    every = [by[m, "decode", None] for m in decoding]
    interval = [by[m, "interval", 4] for m in long_generation.METHODS]
    # full holds the prompt and every decoded token; every step holds the budget (8 of 10 + 16); every 4 tokens
    # holds the budget plus what arrived since the last cut: seen between steps, up to 3 more (the 4th token is
    # cut back inside the step it arrives in); triattention's buffer (cut back once 8 + 4 are held) the same 3
    # more; snapkv_d's interval 1 (a cut after every token attended) the budget, as every step
    per_token = full["kv_bytes_max"] / (10 + 16)
    assert {r["kv_bytes_max"] for r in every} == {8 * per_token}
    assert {r["kv_bytes_max"] for r in interval} == {(8 + 3) * per_token}
    assert by["triattention", "buffer", 4]["kv_bytes_max"] == (8 + 3) * per_token
    assert by["snapkv_d", "interval", 1]["kv_bytes_max"] == 8 * per_token
    assert {r["kv_bytes"] for r in rows[1:]} == {8 * per_token}  # every schedule ends at the budget here
    assert all(r["kv_max_vs_full"] == pytest.approx(8 / 26) for r in every)
    assert all(r["kv_max_vs_full"] == pytest.approx(11 / 26) for r in interval)
    assert all(r["decode_tok_s"] > 0 and r["decode_cpu_vs_full"] > 0 for r in rows)


def test_some_methods_and_a_budget_the_buffer_never_reaches():
    """``methods``: full and those methods' schedules alone. A budget of 24 for a 10-token prompt and 16 decoded
    tokens: every step holds 24; every 4 tokens 25 (the cut after the 16th token leaves 24); triattention's buffer
    (a cut once 24 + 4 are held) cuts nothing, so it holds full's bytes."""
    recs = long_generation.measure(tiny_model("llama_gqa"), 10, 2, 17, 24, 4, repeats=1, warmup=0,
                                   methods=["triattention", "g_kv"])
    rows = long_generation.rows(recs)
    assert [(r["method"], r["compress"], r["interval"]) for r in rows] == [
        ("full", None, None), ("triattention", "decode", None), ("triattention", "interval", 4),
        ("g_kv", "interval", 4), ("triattention", "buffer", 4)]
    per_token = rows[0]["kv_bytes_max"] / (10 + 16)
    assert [r["kv_bytes_max"] / per_token for r in rows] == [26, 24, 25, 25, 26]
    assert [r["kv_bytes"] / per_token for r in rows] == [26, 24, 24, 24, 26]
    assert rows[-1]["kv_max_vs_full"] == rows[-1]["kv_end_vs_full"] == 1
    assert recs[1]["metrics"]["kv_bytes_max"] == rows[1]["kv_bytes_max"]


def test_the_table_comes_from_the_record(measured, tmp_path, capsys):
    rows = long_generation.rows(measured)
    (tmp_path / "metrics.json").write_text(json.dumps({"long_generation": rows}))
    assert long_generation.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0] == "long generation: prompt 10 x batch 2, 17 tokens generated (each prefills; medians)"
    assert len(table) == 4 + len(rows) and table[4].startswith("| full | - | - |")
    text = "\n".join(table)
    assert "| h2o | every step | 8 |" in text and "| keydiff | every 4 | 8 |" in text and "| g_kv | every 4 | 8 |" in text
    assert "| triattention | at budget+4 | 8 |" in text and "| snapkv_d | every 1 | 8 |" in text
    (tmp_path / "metrics.json").write_text(json.dumps({"metrics": {}}))
    assert long_generation.main([str(tmp_path)]) == 2 and "no long_generation section" in capsys.readouterr().err
    (tmp_path / "metrics.json").write_text(json.dumps({"long_generation": [{"method": "full"}]}))
    assert long_generation.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "long_generation row 0 lacks 'compress'" in err


def test_bad_section_sizes_are_one_line():
    from h2o.bench.task import TargetsTask
    from h2o.core.validate import ConfigError

    with pytest.raises(ConfigError, match=r"task.long_gen=\[1, 2\]: expected at least 2 generated tokens"):
        TargetsTask(name="bench_targets", long_gen=[1, 2])
    with pytest.raises(ConfigError, match=r"task.long_gen_interval=0: expected an int >= 1"):
        TargetsTask(name="bench_targets", long_gen_interval=0)
    assert TargetsTask(name="bench_targets", long_gen=None).long_gen is None
    allowed = "allowed: a list of h2o, tova, streaming_llm, local, knorm, keydiff, triattention, snapkv_d, g_kv"
    for methods, what in ((["h2o", "bogus"], "'bogus' is not a method of the long-generation section"),
                          (["full"], "'full' is not a method of the long-generation section"),
                          (["g_kv", "g_kv"], "'g_kv' is named twice"), ([], "expected a non-empty list")):
        with pytest.raises(ConfigError, match=r"task.long_gen_methods=.*: " + what + ".*; " + allowed) as e:
            TargetsTask(name="bench_targets", long_gen_methods=methods)
        assert "\n" not in str(e.value)
    assert TargetsTask(name="bench_targets", long_gen_methods=["g_kv"]).long_gen_methods == ["g_kv"]


def test_the_docs_table_is_the_committed_record():
    """docs/benchmarks.md shows the first committed record's rows (studies/bench/bench_long_generation): full and
    both schedules of the six first decoding methods."""
    from h2o.assets.paths import CONF

    root = CONF.parent
    record = json.loads((root / "studies" / "bench" / "bench_long_generation" / "metrics.json").read_text())
    assert len(record["long_generation"]) == 1 + 2 * len(long_generation.FIRST)
    assert long_generation.table(record["long_generation"]) in (root / "docs" / "benchmarks.md").read_text()


def test_the_docs_second_table_is_the_2026_record():
    """docs/benchmarks.md's second table is the record of triattention, snapkv_d and g_kv beside full and h2o
    (studies/bench/bench_long_generation_2026): every schedule each runs, the KV bytes as they hold them."""
    from h2o.assets.paths import CONF

    root = CONF.parent
    folder = root / "studies" / "bench" / "bench_long_generation_2026"
    record = json.loads((folder / "metrics.json").read_text())
    methods = ["h2o", "triattention", "snapkv_d", "g_kv"]
    rows = record["long_generation"]
    assert [(r["method"], r["compress"], r["interval"]) for r in rows] == [("full", None, None)] + [
        (m, s, i) for m, kw in long_generation.schedules(16, methods) for s, i in [(kw["compress"], kw.get("interval"))]]
    assert {(r["prompt_len"], r["batch_size"], r["gen_len"], r["budget"]) for r in rows[1:]} == {(32, 2, 128, 32)}
    full, per_token = rows[0], rows[0]["kv_bytes_max"] / (32 + 127)  # full ends at 32 + 127 tokens
    for r in rows[1:]:  # every step, and snapkv_d's cut after every token, hold 32; every 16 (or at 32+16) 47
        held = 32 if r["compress"] == "decode" or r["interval"] == 1 else 32 + 16 - 1
        assert r["kv_bytes_max"] == held * per_token and r["kv_max_vs_full"] == pytest.approx(held / 159)
    assert full["kv_bytes"] == full["kv_bytes_max"]
    assert long_generation.table(rows) in (root / "docs" / "benchmarks.md").read_text()
