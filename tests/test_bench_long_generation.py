"""make bench's long-generation section (h2o/bench/long_generation.py): both schedules of every decoding method
beside full in one interleaved run, their KV bytes as the schedules hold them, the table from a record, and the docs
table from the committed record. A tiny random model."""
from __future__ import annotations

import json

import pytest

from h2o.assets.models import tiny_model
from h2o.bench import long_generation


@pytest.fixture(scope="module")
def measured():
    return long_generation.measure(tiny_model("llama_gqa"), 10, 2, 17, 8, 4, repeats=1, warmup=0)


def test_both_schedules_of_every_decoding_method_beside_full(measured):
    rows = long_generation.rows(measured)
    assert [(r["method"], r["compress"], r["interval"]) for r in rows] == [("full", None, None)] + [
        (m, "decode", None) for m in long_generation.METHODS] + [(m, "interval", 4) for m in long_generation.METHODS]
    full, every, interval = rows[0], rows[1:7], rows[7:]
    # full holds the prompt and every decoded token; every step holds the budget (8 of 10 + 16); every 4 tokens
    # holds the budget plus what arrived since the last cut: seen between steps, up to 3 more (the 4th token is
    # cut back inside the step it arrives in)
    per_token = full["kv_bytes_max"] / (10 + 16)
    assert {r["kv_bytes_max"] for r in every} == {8 * per_token}
    assert {r["kv_bytes_max"] for r in interval} == {(8 + 3) * per_token}
    assert all(r["kv_max_vs_full"] == pytest.approx(8 / 26) for r in every)
    assert all(r["decode_tok_s"] > 0 and r["decode_cpu_vs_full"] > 0 for r in rows)


def test_the_table_comes_from_the_record(measured, tmp_path, capsys):
    rows = long_generation.rows(measured)
    (tmp_path / "metrics.json").write_text(json.dumps({"long_generation": rows}))
    assert long_generation.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0] == "long generation: prompt 10 x batch 2, 17 tokens generated (each prefills; medians)"
    assert len(table) == 4 + len(rows) and table[4].startswith("| full | - | - |")
    assert "| h2o | every step | 8 |" in "\n".join(table) and "| keydiff | every 4 | 8 |" in "\n".join(table)
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


def test_the_docs_table_is_the_committed_record():
    """docs/benchmarks.md shows the committed record's rows (studies/bench/bench_long_generation): full and both
    schedules of every decoding method."""
    from h2o.assets.paths import CONF

    root = CONF.parent
    record = json.loads((root / "studies" / "bench" / "bench_long_generation" / "metrics.json").read_text())
    assert len(record["long_generation"]) == 1 + 2 * len(long_generation.METHODS)
    assert long_generation.table(record["long_generation"]) in (root / "docs" / "benchmarks.md").read_text()
