"""``make bench``'s methods section (h2o/bench/every_policy.py): a row per registered method, each in its own timing, the
bytes and tokens held after the compression measured from the cache, the table rendered from the record."""
import json

import pytest
import torch

from h2o.assets.paths import CONF
from h2o.bench import every_policy
from h2o.core.policies import REAL_POLICIES, Policy


def test_the_rows_come_from_the_registry():
    names = every_policy.method_names()
    assert names == [p for p in REAL_POLICIES if p != "full"] and "scissorhands" in names
    files = {f.stem for f in (CONF / "policy").glob("*.yaml")} - {"full", "h2o_reference"}
    assert set(names) == files  # every conf/policy file with an evicting cache, and nothing else
    timing = {v.policy: v.build().compress for v in every_policy.method_variants(0.2)[1:]}
    assert timing == {n: Policy.registry[n].schedule.name for n in names}
    assert timing["snapkv"] == "prefill" and timing["h2o"] == timing["scissorhands"] == "decode"


@pytest.fixture(scope="module")
def measured():
    from h2o.assets.model_spec import ModelSpec

    torch.manual_seed(0)
    model = ModelSpec("tiny-llama", "tiny:llama").load()[0]  # with its tokenizer: kvzip replays the context
    return every_policy.measure(model, 24, 2, 3, 0.25, repeats=1, warmup=0)


def test_each_method_holds_its_budget_after_the_compression(measured):
    rows = {r["method"]: r for r in every_policy.rows(measured)}
    assert list(rows) == ["full", *every_policy.method_names()]
    assert rows["full"]["tokens_held"] == 24 and rows["full"]["kv_prefill_vs_full"] == 1
    for name in ("h2o", "scissorhands", "snapkv", "tova"):  # 25% of 24 tokens, every layer and head
        assert rows[name]["tokens_held"] == 6 and rows[name]["kv_prefill_vs_full"] == pytest.approx(6 / 24), name
    # decode keeps the budget; prefill keeps the two decoded tokens beside the cut
    assert rows["h2o"]["kv_bytes"] == rows["h2o"]["kv_bytes_prefill"]
    assert rows["snapkv"]["kv_bytes"] == pytest.approx(rows["snapkv"]["kv_bytes_prefill"] * 8 / 6)
    assert rows["topk"]["tokens_held"] == 24  # restricting: the whole cache is kept
    # scissorhands' state: 400 history bytes per slot beside h2o's fp32 score
    assert rows["scissorhands"]["kv_meta_bytes"] > 10 * rows["h2o"]["kv_meta_bytes"]
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in rows.values())


def test_the_table_comes_from_the_record(measured, tmp_path, capsys):
    rows = every_policy.rows(measured)
    (tmp_path / "metrics.json").write_text(json.dumps({"methods": rows}))
    assert every_policy.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| full | - |")
    assert any(line.startswith("| scissorhands | decode |") for line in table)
    assert any(line.startswith("| snapkv | prefill |") for line in table)
    (tmp_path / "metrics.json").write_text(json.dumps({"metrics": {}}))
    assert every_policy.main([str(tmp_path)]) == 2 and "no methods section" in capsys.readouterr().err


def test_the_docs_table_is_the_committed_records():
    """docs/benchmarks.md shows the committed record's rows (studies/bench/bench_methods), one per method it ran."""
    from h2o.assets.paths import CONF

    root = CONF.parent
    record = json.loads((root / "studies" / "bench" / "bench_methods" / "metrics.json").read_text())
    assert [r["method"] for r in record["methods"]][0] == "full" and len(record["methods"]) >= 20
    assert every_policy.table(record["methods"]) in (root / "docs" / "benchmarks.md").read_text()
