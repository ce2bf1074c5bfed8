"""The long-context cluster side without a cluster or a hub: the dry runs list the grids that will really run
(lengths clipped by each model's ``positions`` from conf/model/*.yaml), RULER's qa tasks read their prefetched
JSON offline, ``make prefetch --check`` names what is missing, and LongBench's middle truncation."""
from __future__ import annotations

import json
import re
import socket

import pytest

from h2o.assets.paths import CONF


def run_specs(experiment: str, *overrides: str):
    from h2o.pipeline.sweep import expand

    return expand([f"experiment={experiment}", *overrides], multirun=True).specs


def test_model_positions_are_declared_and_match_the_configs_here():
    """Every real model declares its positions; where its config.json is on this machine they agree."""
    import yaml

    from h2o.assets.model_spec import ModelSpec, checkpoint_config

    for f in sorted((CONF / "model").glob("*.yaml")):
        node = yaml.safe_load(f.read_text())
        if str(node["pretrained"]).startswith("tiny:"):
            continue
        assert isinstance(node.get("positions"), int), f"{f.name}: positions missing"
        spec = ModelSpec(**{k: v for k, v in node.items() if k != "_target_"})
        assert spec.max_positions() == node["positions"]
        cfg = checkpoint_config(node["pretrained"])
        if cfg.get("max_position_embeddings"):
            assert cfg["max_position_embeddings"] == node["positions"], f.name


def test_niah_and_ruler_cluster_grids_are_clipped_offline(capsys):
    from h2o.pipeline import launch

    niah = {p.model.name: p for p in run_specs("niah_cluster", "policy=full", "policy.budget=0.2")}  # a run per model
    assert niah["llama-3-8b"].task.lengths == [1000, 2000, 4000, 8000] and len(niah) == 7
    assert all(p.task.lengths == [1000, 2000] for m, p in niah.items() if m != "llama-3-8b")
    # 11 depths x 10 samples x (prompt + 12 generated) at 1,000 and 2,000, at OPT-6.7B's 135 s per million tokens
    assert launch.run_minutes(niah["opt-6.7b"], launch.cluster_config([])) == pytest.approx(
        135 * 110 * 3024 / 1e6 / 60)
    ruler = {(p.model.name, p.task.name): p.task.lengths
             for p in run_specs("ruler_cluster", "model=opt-13b,llama-3-8b", "policy=full", "policy.budget=0.2")}
    assert len(ruler) == 10 and ruler["opt-13b", "ruler_qa_squad"] == [1024, 2048]
    assert ruler["llama-3-8b", "ruler_niah_multikey_1"] == [1024, 2048, 4096, 8192]
    assert launch.main(["experiment=niah_cluster", "model=opt-6.7b,llama-3-8b", "--dry"]) == 0
    total = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"total: \d+ arrays, \d+ tasks, 20 runs, ~\d+\.\d GPU-h", total), total


def test_longbench_cluster_lists_the_english_subset_per_task():
    from h2o.tasks.longbench import ENGLISH, gen_tokens
    from h2o.tasks.multiple_choice import yaml_task_names

    found = run_specs("longbench_cluster", "policy=full,h2o", "policy.budget=0.2")
    names = {p.task.name for p in found}
    assert names == set(ENGLISH) and len(ENGLISH) == 16
    assert set(ENGLISH) <= set(yaml_task_names(found[0].task.lm_eval_folder()))
    assert {p.model.name for p in found} == {"llama-3-8b", "mistral-7b"}
    assert all(p.task.lengths == [8192] and p.task.family == "longbench" for p in found)
    assert len({p.path for p in found}) == 2 * 16 * 2
    assert gen_tokens("longbench_gov_report") == 512 and gen_tokens("longbench_qasper") == 128
    qasper = next(p.task for p in found if p.task.name == "longbench_qasper")
    assert qasper.tokens() == 200 * min(int(3619 * 1.3) + 128, 8192)


def test_qa_tasks_read_their_prefetched_json_with_the_network_refused(tmp_path, monkeypatch):
    """make prefetch writes the JSON lm-eval downloads; the run's hook reads it there, every socket refused."""
    from transformers import AutoTokenizer

    from h2o.assets.tiny import tiny_checkpoint
    from h2o.tasks import ruler_offline

    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    url = ruler_offline.qa_urls()["ruler_qa_squad"]
    paragraphs = [{"context": f"Paragraph {i}: the harbor of town {i} is called Port {i}.",
                   "qas": [{"question": f"What is the harbor of town {i} called?", "is_impossible": False,
                            "answers": [{"text": f"Port {i}"}]}]} for i in range(40)]
    squad = json.dumps({"data": [{"paragraphs": paragraphs}]})

    class Response:
        text = squad

        def raise_for_status(self):
            pass

    monkeypatch.setattr("requests.get", lambda u, timeout: Response() if u == url else pytest.fail(u))
    said = ruler_offline.fetch_qa("ruler_qa_squad")
    assert ruler_offline.qa_file(url).read_text() == squad and "dev-v2.0.json" in said

    def refuse(*args, **kwargs):
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    ruler_offline.use_cached_qa()  # what use_haystack installs for every RULER run
    from lm_eval.tasks.ruler import qa_utils

    qas, docs = qa_utils.read_squad()  # lm-eval's reader, its default URL
    assert len(qas) == 40 and len(docs) == 40 and qas[3]["outputs"] == ["Port 3"]
    assert docs[qas[3]["context"][0]] == paragraphs[3]["context"]
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint("llama")))
    assert ruler_offline.shortest_length(tok, "ruler_qa_squad") == len(tok(qa_utils.TEMPLATE.format(
        context="", query="")).input_ids) + 32


def test_prefetch_check_names_each_long_context_asset(tmp_path, monkeypatch, capsys):
    from h2o.pipeline import prefetch

    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert prefetch.main(["experiment=ruler_cluster", "model=llama-3-8b", "policy=full", "policy.budget=0.2",
                          "--check"]) == 1
    lines = {ln.split(":")[0]: ln for ln in capsys.readouterr().out.strip().splitlines()}
    assert "not on this machine: ruler_qa_squad's JSON" in lines["task ruler_qa_squad"]
    assert "hotpot_dev_distractor_v1.json" in lines["task ruler_qa_hotpot"]
    assert "book austen" in lines["task ruler_niah_single_2"] and "essays" not in lines["task ruler_niah_single_2"]
    assert lines["task ruler_niah_single_1"].endswith("cached (or fetched by the task itself)")
    from h2o.tasks.long_context_data import assets

    task = run_specs("ruler_cluster", "model=llama-3-8b", "task=ruler_niah_multikey_1", "policy=full",
                 "policy.budget=0.2")[0].task
    kinds = [(a.what.split(" (")[0], a.needed) for a in assets(task)]
    assert kinds == [("book austen", True), ("RULER's essays", False), ("nltk's punkt_tab sentence model", False)]


def test_longbench_prompts_keep_both_ends():
    """truncate=middle keeps a long prompt's first and last halves (LongBench's rule); left is lm-eval's."""
    import torch

    from h2o.tasks.lm_eval_model import H2OLM

    lm = H2OLM(pretrained="tiny:llama", batch_size=1)
    long, short = "abcdefghijklmnopqrstuvwxyz" * 2, "hello"
    full = lm.tok_encode(long)
    ids, mask = lm.tok_batch_encode([long, short], left_truncate_len=20)
    assert torch.equal(ids, H2OLM.tok_batch_encode(lm, [long, short], left_truncate_len=20)[0])
    assert ids[0].tolist() == full[-20:]  # lm-eval's: the end
    lm.truncate = "middle"
    ids, mask = lm.tok_batch_encode([long, short], left_truncate_len=20)
    assert ids.shape == (2, 20) and ids[0].tolist() == full[:10] + full[-10:]
    assert mask[1].tolist() == [0] * 15 + [1] * 5 and ids[1, 15:].tolist() == lm.tok_encode(short)
