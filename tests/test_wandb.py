"""The wandb mirror, read back offline: one run per record (ids, names, groups, job types, tags from the folder),
numbers as numbers, samples as typed tables, streaming as history against tokens, idempotent syncs, the
experiment's summary run (Fig. 4 as native line plots, analysis tables and figures, the report), and wandb never
failing a run nor being needed at import."""
from __future__ import annotations

import json
import os
import subprocess
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
