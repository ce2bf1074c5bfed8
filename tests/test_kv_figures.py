"""One writer of a record's KV figures (h2o.tasks.kv_held.figures): the one-pass formula reproduces every committed
perplexity record's figures (one per kind: no prompt, decode and prefill timings, per-layer budgets, full, a quantized
cache, adakv's tokens held); a pooled policy's bytes stored (its heads padded) are the evicting cache's footprint,
which a per-head policy's formula already equals. Tiny random models; SmolLM2's geometry from its config alone."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.tasks.kv_held import measured, simulated_held

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M's config.json (30 layers, 9 query / 3 KV heads of 64), fp32 as the records ran (their "dtype")
SMOLLM2 = SimpleNamespace(config=LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                             hidden_size=576, head_dim=64), dtype=torch.float32)
CTX = "studies/methods/records/smollm2-135m/austen_ctx/shots0"
PPL = "studies/quant/records/smollm2-135m/austen_ppl/shots0"
RECORDS = [f"{CTX}/h2o/0.2/compress=decode", f"{CTX}/snapkv/0.2", f"{CTX}/pyramidkv/0.2",
           f"{CTX}/full/1.0/compress=decode", f"{CTX}/scissorhands/0.2/compress=prefill", f"{CTX}/adakv/0.2/compress=prefill",
           f"{PPL}/h2o/0.2/n_windows=4", f"{PPL}/h2o/0.2/n_windows=4,quant=uniform4", f"{PPL}/full/1.0/n_windows=4"]
FIELDS = ("kv_tokens_cut", "kv_tokens_end", "kv_bytes_cut", "kv_bytes_end", "kv_tokens_end_per_layer")


def record_policy(rec: dict):
    options = {k: v for k, v in rec["policy_options"].items() if not (rec["policy"] == "full" and k == "compress")}
    return make_policy(rec["policy"], **options)


@pytest.mark.parametrize("folder", RECORDS, ids=[r.split("shots0/")[1] for r in RECORDS])
def test_the_formula_gives_every_committed_records_figures(folder):
    rec = json.loads((REPO / folder / "metrics.json").read_text())
    assert rec["dtype"] == "float32" and len(rec["kv_tokens_end_per_layer"]) == 30
    proto = rec["protocol"]
    held = simulated_held(SMOLLM2, record_policy(rec), proto["window"], proto.get("context"), rec.get("quant"))
    assert {k: held[k] for k in FIELDS} == {k: rec[k] for k in FIELDS}
    if rec.get("quant") is None and rec["policy"] != "adakv":  # per-head counts: stored = held
        assert held["kv_bytes_stored"] == held["kv_bytes_end"] and held["kv_bytes_stored_cut"] == held["kv_bytes_cut"]


W, C = 40, 28  # a window and its prompt


def real_path(model, policy, ids, context):
    """The evicting cache fed as tests/test_methods_experiment.py feeds it: the prompt, then one token at a time
    (a prefill timing keeps every later token either way); (footprint at the cut or None, at the end)."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache(None if context else ids.shape[1])
        cut = None
        if context:
            model(ids[:, :context], cache=cache)
            cut = cache.footprint()
        for t in range(context or 0, ids.shape[1] - 1):
            model(ids[:, t:t + 1], cache=cache)
        return cut, cache.footprint()


@pytest.mark.parametrize("options,context", [({"inner": "knorm", "compress": "prefill"}, C),
                                             ({"inner": "h2o", "compress": "decode"}, C),
                                             ({"inner": "scissorhands", "history": 8, "window": 2}, None)])
def test_a_pooled_policys_bytes_stored_are_the_evicting_caches(options, context):
    """Batches of 2 and 1 (a batch stores each layer padded to its largest head across its sequences)."""
    model = tiny_model("llama_gqa", seed=3)
    ids = torch.randint(3, 128, (3, W), generator=torch.Generator().manual_seed(5))
    policy = make_policy("adakv", budget=0.3, **options)
    held = simulated_held(model, policy, W, context, wins=ids, batch=2)
    cuts, ends = zip(real_path(model, policy, ids[:2], context), real_path(model, policy, ids[2:], context))
    mean = lambda fs, k: round(sum(f[k] for f in fs) / 3)  # noqa: E731
    assert held["kv_bytes_stored"] == mean(ends, "bytes_stored") > held["kv_bytes_end"] == mean(ends, "bytes_held")
    assert held["kv_tokens_end"] == mean(ends, "tokens_held")
    formula = simulated_held(model, policy, W, context)  # without the windows: the formula, no padding
    assert {k: formula[k] for k in FIELDS} == {k: held[k] for k in FIELDS}  # pooled: the same tokens per layer
    assert formula["kv_bytes_stored"] == formula["kv_bytes_end"] < held["kv_bytes_stored"]
    if context:
        assert held["kv_bytes_stored_cut"] == mean(cuts, "bytes_stored") > held["kv_bytes_cut"]
        assert held["kv_tokens_cut"] == mean(cuts, "tokens_held")
    else:
        assert held["kv_tokens_cut"] is held["kv_bytes_stored_cut"] is None


def test_a_per_head_policys_formula_is_the_footprint():
    model = tiny_model("llama_gqa", seed=3)
    ids = torch.randint(3, 128, (2, W), generator=torch.Generator().manual_seed(5))
    policy = make_policy("knorm", budget=0.3)
    cut, end = measured(model, policy, ids, C, batch=2)
    held = simulated_held(model, policy, W, C)
    assert (held["kv_tokens_cut"], held["kv_bytes_cut"], held["kv_bytes_stored_cut"]) == (
        cut["tokens_held"], cut["bytes_held"], cut["bytes_stored"])
    assert (held["kv_tokens_end"], held["kv_bytes_end"], held["kv_bytes_stored"]) == (
        end["tokens_held"], end["bytes_held"], end["bytes_stored"])


def test_the_context_tasks_record_carries_the_padding():
    """PerplexityTask.run on a tiny Llama with GQA: adakv's record stores more than it holds, in the task's batches;
    knorm's (one top-k per head) stores what it holds; both hold the same tokens."""
    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.perplexity import PerplexityTask

    model, tok = ModelSpec("tiny-llama-gqa", "tiny:llama_gqa").load()
    task = PerplexityTask("austen_ctx", window=48, context=32, n_windows=3, stride=5, batch_size=2)
    ada, per_head = (task.run(model, tok, make_policy(name, budget=0.3, **extra), "simulated", 0).info
                     for name, extra in (("adakv", {"inner": "knorm"}), ("knorm", {})))
    wins = task.windows(tok)
    cut, end = measured(model, make_policy("adakv", budget=0.3, inner="knorm"), wins, 32, batch=2)
    assert (ada["kv_bytes_stored_cut"], ada["kv_bytes_stored"]) == (round(cut["bytes_stored"]),
                                                                    round(end["bytes_stored"]))
    assert ada["kv_bytes_stored"] > ada["kv_bytes_end"] == per_head["kv_bytes_end"] == per_head["kv_bytes_stored"]
    assert ada["kv_tokens_end"] == per_head["kv_tokens_end"] and ada["kv_tokens_cut"] == per_head["kv_tokens_cut"]
