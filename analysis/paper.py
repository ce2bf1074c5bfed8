"""The paper's printed numbers (``analysis/paper_results.csv``, arXiv v3, one row per number) and
how its names map onto the harness's.

The CSV is data copied into the project: ``table,model,task,metric,policy,budget,shots,value,notes``;
values as printed (strings, "OOM" kept); ``notes`` says what the paper leaves unstated. Policies
already use the harness's names. Tasks map to lm-eval's names; an offline BIG-bench task is a
*stand-in* for a paper task (same kind of question, different data): shown, never comparable.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

PAPER_CSV = Path(__file__).with_name("paper_results.csv")
MODELS = {"OPT-6.7B": "opt-6.7b", "OPT-13B": "opt-13b", "OPT-30B": "opt-30b", "OPT-66B": "opt-66b",
          "LLaMA-7B": "llama-7b", "LLaMA-13B": "llama-13b", "GPT-NeoX-20B": "gpt-neox-20b"}
TASKS = {"PiQA": "piqa", "COPA": "copa", "OpenBookQA": "openbookqa", "Winogrande": "winogrande",
         "MathQA": "mathqa", "RTE": "rte", "XSUM": "xsum", "XSUM (100 random prompts)": "xsum",
         "CNN/DM": "cnn_dm"}
STAND_INS = {"copa": ["bb_copa"], "piqa": ["bb_piqa"], "mathqa": ["bb_mathqa"],
             "winogrande": ["bb_winowhy"], "rte": ["bb_entailment", "bb_analytic_entailment"],
             "xsum": ["bb_xsum"]}
OUT_OF_SCOPE = {
    "Table 3": "FlexGen offloading throughput on a T4 (system tiers: GPU/CPU/disk); the harness "
               "measures its own cache (make bench), not FlexGen",
    "Table 4": "FlexGen throughput on XSUM on a T4 (offloading system, not the eviction policy)",
    "Table 5": "FlexGen latency and batch sizes on an A100 (offloading system)",
    "Table 7": "FlexGen/Accelerate/DeepSpeed throughput without offloading (systems comparison)",
    "Table 11": "SpAtten (a different accelerator method; not implemented here)",
    "Table 12": "heavy-hitter MLP neurons of GPT-2 (pruning, not the KV cache)",
}


def load_paper(path: str | Path = PAPER_CSV) -> pd.DataFrame:
    """The CSV with ``number`` (float, NaN for "OOM"), ``budget``/``shots`` as floats and the
    harness's ``our_model`` / ``our_task`` (None where the paper's name has no counterpart)."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    df["number"] = pd.to_numeric(df["value"], errors="coerce")
    for col in ("budget", "shots"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df["our_model"] = df["model"].map(MODELS)
    df["our_task"] = df["task"].map(TASKS)
    return df


def tasks_for(paper_task: str) -> list[str]:
    """Our task names for a paper task: the task itself first, then its offline stand-ins."""
    ours = TASKS.get(paper_task, paper_task)
    return [ours] + STAND_INS.get(ours, [])
