"""A record's fields: the run's own fields are never overwritten by a policy option, a task names its headline
metric, and every task turns cache footprints into record fields through one function (h2o.tasks.kv_held)."""
from __future__ import annotations

import pytest

from h2o.assets.paths import CONF
from h2o.pipeline.spec import prepare
from h2o.pipeline.sweep import _compose

TINY = ["model=tiny-llama", "task=bb_copa", "task.limit=2", "task.shots=0"]


def test_a_policy_option_never_overwrites_a_run_field(hydra_ctx):
    head = prepare(_compose([*TINY, "policy=random", "policy.seed=3", "seed=0"])).head()
    assert head["seed"] == 0 and head["policy_options"]["seed"] == 3  # the run's seed, the policy's in its options
    assert (head["policy"], head["budget"]) == ("random", 0.2)
    same = prepare(_compose([*TINY, "policy=random", "policy.seed=5", "seed=5"])).head()
    assert same["seed"] == 5 and same["policy_options"]["seed"] == 5


def test_a_policys_other_options_stay_top_level_fields_in_their_place(hydra_ctx):
    head = prepare(_compose([*TINY, "policy=snapkv", "policy.compress=prefill"])).head()
    keys = list(head)
    assert keys[:14] == ["experiment", "model", "task", "task_kind", "policy", "budget", "heavy", "recent", "shots",
                         "semantics", "seed", "evicts", "limit", "policy_options"]
    assert keys[14:] == ["compress", "window", "kernel"] and head["compress"] == "prefill"


@pytest.fixture(scope="module")
def tiny_lm():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def test_a_longbench_record_names_score_its_headline_and_analysis_draws_it(tiny_lm, monkeypatch):
    """LongContextTask.run on a LongBench task, lm-eval's evaluation replaced by two scored samples (the data set is
    on the hub): its record names ``score`` as its headline, which analysis.figures.headline_metric picks."""
    import lm_eval
    import lm_eval.tasks
    import pandas as pd
    from omegaconf import OmegaConf

    from analysis.figures import headline_metric
    from h2o.core.policies import make_policy
    from h2o.pipeline.spec import build

    task = build("task", OmegaConf.load(CONF / "task" / "longbench.yaml"))
    scored = [{"doc_id": i, "doc": {"answers": ["x"]}, "filtered_resps": ["y"], "score": s}
              for i, s in enumerate((0.25, 0.75))]
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: None)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: {"samples": {task.lm_eval_task: scored}})
    result = task.run(*tiny_lm, make_policy("h2o", budget=0.2), "real", 0)
    assert result.metrics["score"] == 0.5 and result.info["headline"] == "score"
    runs = pd.DataFrame([{"task_kind": "retrieval", "headline": result.info["headline"], "acc": 0.3,
                          "score": result.metrics["score"]}])  # a column of another task's metric beside it
    assert headline_metric(runs) == "score"
    assert headline_metric(runs.assign(headline=None)) == "acc"  # unnamed: the kind's first metric


def old_kv_end(footprints):
    """long_context's fields as it computed them itself before kv_held's function (the committed records' code)."""
    rows = sum(n for _, n in footprints)
    if not rows:
        return {}
    per = lambda key: sum(f[key] for f, _ in footprints) / rows  # noqa: E731
    return {"kv_tokens_end": round(per("tokens_held"), 1), "kv_bytes_end": round(per("bytes_held")),
            "kv_bytes_stored": round(per("bytes_stored"))}


def old_summarization(footprints):
    """summarization's fields as it computed them itself: means of each batch's per-sequence values."""
    stored = [f["bytes_stored"] / n for f, n in footprints]
    held = [(f["bytes_held"] / n, f["tokens_held"] / n) for f, n in footprints]
    return {"kv_bytes_per_seq": round(sum(stored) / len(stored)),
            "kv_held_bytes_per_seq": round(sum(b for b, _ in held) / len(held)),
            "kv_tokens_per_seq": round(sum(t for _, t in held) / len(held))}


@pytest.fixture(scope="module")
def footprints(tiny_lm):
    """Real footprints of the evicting cache (adakv: heads held unevenly, stored padded), batches of 2 and 1."""
    import torch

    from h2o.core.attach import attach
    from h2o.core.policies import make_policy

    model, _ = tiny_lm
    ids = torch.randint(5, 200, (3, 37), generator=torch.Generator().manual_seed(0))  # (3, 37) a prompt each
    out = []
    with torch.no_grad(), attach(model, make_policy("adakv", budget=0.3, inner="knorm"), mode="real") as state:
        for batch in (ids[:2], ids[2:]):
            cache = state.new_cache(None)
            model(batch, cache=cache)
            out.append((cache.footprint(), len(batch)))
    return out


def test_generation_tasks_fields_come_from_kv_helds_function_as_before(footprints):
    from h2o.tasks.kv_held import END, batch_fields, per_sequence
    from h2o.tasks.summarization import KV_FIELDS, logged_footprint

    assert footprints[0][0]["bytes_stored"] > footprints[0][0]["bytes_held"]  # padding: the figures differ
    long_context = batch_fields(footprints, END, token_digits=1)
    assert long_context == old_kv_end(footprints) and list(long_context) == list(old_kv_end(footprints))
    assert batch_fields([], END) == {} == old_kv_end([])
    even = footprints[:1] * 3  # batches of one size: the mean per sequence is the mean of the batches' means
    assert batch_fields(even, KV_FIELDS) == old_summarization(even)
    assert list(batch_fields(even, KV_FIELDS)) == ["kv_bytes_per_seq", "kv_held_bytes_per_seq", "kv_tokens_per_seq"]
    # uneven batches: the mean per sequence (the old code averaged the batches' means)
    mean = per_sequence(footprints)
    assert mean["bytes_stored"] == (footprints[0][0]["bytes_stored"] + footprints[1][0]["bytes_stored"]) / 3
    assert batch_fields(footprints, KV_FIELDS)["kv_bytes_per_seq"] == round(mean["bytes_stored"])
    # a resumed batch's log entry (per-sequence values) gives back its footprint; an old entry has no tokens
    foot, rows = footprints[0]
    entry = {"kv": foot["bytes_stored"] / rows, "held": [foot["bytes_held"] / rows, foot["tokens_held"] / rows],
             "samples": [{}] * rows}
    assert batch_fields([logged_footprint(entry)], KV_FIELDS) == batch_fields([(foot, rows)], KV_FIELDS)
    old = batch_fields([logged_footprint({"kv": 10.0, "samples": [{}]}), footprints[1]], KV_FIELDS)
    assert old["kv_tokens_per_seq"] == round(footprints[1][0]["tokens_held"])  # the batches that have tokens


def test_one_pass_figures_keep_their_fields_and_order(footprints):
    from h2o.tasks.kv_held import figures, per_sequence

    end = per_sequence(footprints)
    out = figures(None, end, [4, 5])
    assert list(out) == ["kv_tokens_cut", "kv_tokens_end", "kv_bytes_cut", "kv_bytes_end", "kv_bytes_stored_cut",
                         "kv_bytes_stored", "kv_tokens_end_per_layer"]
    assert out == {"kv_tokens_cut": None, "kv_tokens_end": round(end["tokens_held"]), "kv_bytes_cut": None,
                   "kv_bytes_end": round(end["bytes_held"]), "kv_bytes_stored_cut": None,
                   "kv_bytes_stored": round(end["bytes_stored"]), "kv_tokens_end_per_layer": [4, 5]}


def test_the_methods_table_shows_the_bytes_stored_where_they_exceed_those_held(tmp_path):
    """analysis/methods.py: a cell shows the KV MiB held and, where the record's bytes stored differ at the shown
    precision (adakv's padded heads), the MiB stored, with the note under the table's caption."""
    import json

    from analysis.methods import STORED, methods_runs, table
    from analysis.records import load_runs

    mib = 2 ** 20

    def runs(*records):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for policy, held, stored in records:
            rec = {"experiment": "methods", "model": "m", "task": "niah", "task_kind": "retrieval", "policy": policy,
                   "budget": 0.2, "seed": 0, "n_samples": 10, "metrics": {"acc": 0.5}, "compress": "prefill",
                   "kv_bytes_end": round(held * mib), **({"kv_bytes_stored": round(stored * mib)} if stored else {})}
            (root / policy).mkdir(parents=True)
            (root / policy / "metrics.json").write_text(json.dumps(rec))
        return methods_runs(load_runs(root))

    t = table("methods", "m", "niah", "acc", runs(("snapkv", 9.4, 9.4), ("adakv", 9.4, 12.78), ("tova", 9.4, None)))
    cells = {r[0]: r[t.header.index("20% prefill")] for r in t.rows}
    assert cells["SnapKV"].endswith("· 9.4") and cells["TOVA"].endswith("· 9.4")  # equal, or not recorded
    assert cells["Ada-KV"].endswith("· 9.4 (stored 12.8)") and t.caption[-1] == STORED
    t = table("methods", "m", "niah", "acc", runs(("snapkv", 9.4, 9.42)))
    assert STORED not in t.caption and "stored" not in t.rows[0][t.header.index("20% prefill")]  # shown as 9.4


def test_a_task_field_named_like_a_policy_option_keeps_the_policys_value_beside_it(hydra_ctx):
    spec = prepare(_compose([*TINY, "policy=snapkv", "policy.compress=prefill", "policy.window=32"]))
    record = spec.record({}, {"window": 1152, "context": 1024})
    assert (record["window"], record["policy_window"], record["context"]) == (1152, 32, 1024)
    assert "policy_kernel" not in record  # no clash, nothing moved
    same = spec.record({}, {"window": 32})
    assert same["window"] == 32 and "policy_window" not in same  # equal values: one field
