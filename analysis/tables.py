"""The paper's tables, as pure functions ``DataFrame -> Table`` (see ``analysis.render``).

Input is the frame of :func:`analysis.records.load_runs`. A cell is the mean over seeds of the
matching runs with the most samples (a smoke run never dilutes a full one); ``±stderr`` is shown
when one run fills the cell and it recorded ``<metric>_stderr``. Rows are the table's definition
crossed with the models/tasks present; a cell without a finished run shows ``—``. Settings that
are constant over a table (budget, shots, semantics, sample count, models, seeds) go in its
caption; if shots or semantics vary they become row keys, and a varying sample count becomes an
``n`` column.

Budgets are total cache ratios; H2O rows keep only the paper's even split (heavy == recent).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.grid import Col, grid, key_str, kind, largest, num, numeric, same_key, select
from analysis.render import MISSING, Table

POLICIES = ["full", "local", "strided", "fixed", "streaming_llm", "topk", "h2o",
            "strided_h2", "fixed_h2", "topk_h2", "h2_only"]
LABELS = {"streaming_llm": "StreamingLLM", "strided_h2": "strided+H2", "fixed_h2": "fixed+H2",
          "topk": "top-k", "topk_h2": "top-k+H2", "h2_only": "H2 only", "h2o": "H2O"}
BUDGET = 0.2      # the paper's headline budget: 10% heavy + 10% recent


def label(policy: str) -> str:
    return LABELS.get(policy, policy)


def policy_cols(df: pd.DataFrame, wanted: list[str], budget: float, metric: str,
                extra: bool = False) -> list[Col]:
    """Full cache plus each wanted policy at ``budget`` (plus any other present, if ``extra``)."""
    at_budget = select(df, {"budget": budget})["policy"].dropna().unique()
    policies = list(wanted) + [p for p in POLICIES if extra and p in at_budget and p not in wanted]
    policies += sorted(p for p in at_budget if extra and p not in POLICIES)
    return [Col(label(p), {"policy": p} if p == "full" else {"policy": p, "budget": budget}, metric)
            for p in ["full"] + [p for p in policies if p != "full"]]


def accuracy_caption(budget: float, metric: str) -> list[str]:
    return [f"metric: {metric} (multiple choice, lm-eval log-likelihood)",
            f"budget: {budget:g} of the scored sequence (H2O = {budget / 2:g} heavy + "
            f"{budget / 2:g} recent; full cache = 1.0)"]


def policy_table(name: str, title: str, df: pd.DataFrame, wanted: list[str], budget: float,
                 metric: str, extra: bool = False) -> Table | None:
    """Accuracy per model x task (rows) for the full cache and ``wanted`` policies (columns)."""
    mc = kind(df, "multiple_choice")
    if mc.empty:
        return None
    cols = policy_cols(mc, wanted, budget, metric, extra)
    return grid(name, title, mc, cols, accuracy_caption(budget, metric))


def table1(df: pd.DataFrame, budget: float = BUDGET, metric: str = "acc") -> Table | None:
    """Table 1: full cache vs local vs H2O (and any other policy run) at 20% budget, 5-shot."""
    return policy_table("table1", f"Table 1: accuracy, full cache vs eviction policies at "
                        f"budget {budget:g}", df, ["local", "h2o"], budget, metric, extra=True)


def table2(df: pd.DataFrame, budget: float = BUDGET, metric: str = "acc") -> Table | None:
    """Table 2: Sparse Transformer strided / fixed patterns, with and without heavy hitters."""
    return policy_table("table2", f"Table 2: strided and fixed sparse attention with and without "
                        f"H2 at budget {budget:g}", df,
                        ["strided", "strided_h2", "fixed", "fixed_h2"], budget, metric)


def table8(df: pd.DataFrame, budget: float = BUDGET, metric: str = "acc") -> Table | None:
    """Table 8: per-query top-k attention (an upper bound, not an eviction) with and without H2."""
    return policy_table("table8", f"Table 8: top-k attention with and without H2 at budget "
                        f"{budget:g}", df, ["topk", "topk_h2"], budget, metric)


def table9(df: pd.DataFrame, budget: float = BUDGET, metric: str = "acc") -> Table | None:
    """Table 9: ablation, heavy hitters only vs recent tokens only vs both (H2O), same budget."""
    return policy_table("table9", f"Table 9: heavy hitters only vs local only vs H2O at budget "
                        f"{budget:g}", df, ["h2_only", "local", "h2o"], budget, metric)


def table10(df: pd.DataFrame, budget: float = BUDGET, metric: str = "acc") -> Table | None:
    """Table 10: accuracy by number of shots, full cache vs H2O at ``budget``."""
    mc = kind(df, "multiple_choice", shots=None)
    if mc.empty:
        return None
    shots = sorted(mc["shots"].dropna().unique())
    cols = [c for s in shots for c in (
        Col(f"full {s:g}-shot", {"policy": "full", "shots": s}, metric),
        Col(f"H2O {s:g}-shot", {"policy": "h2o", "budget": budget, "shots": s}, metric))]
    return grid("table10", f"Table 10: accuracy by shots, full cache vs H2O at budget {budget:g}",
                mc, cols, accuracy_caption(budget, metric), context=("semantics",))


def table_rouge(df: pd.DataFrame, budget: float = BUDGET) -> Table | None:
    """Summarization (XSUM, CNN/DailyMail; Figure 4's generation panels): ROUGE-1/2/L per policy."""
    summ = kind(df, "summarization")
    if summ.empty:
        return None
    items = policy_cols(summ, ["local", "h2o"], budget, "", extra=True)
    cols = [Col(f"ROUGE-{k}", {}, f"rouge{k}") for k in ("1", "2", "L")]
    caption = [f"budget: {budget:g} of the prompt, fixed at prefill; eviction during decoding",
               "ROUGE-2 is HELM's headline metric"]
    return grid("rouge", f"Summarization: ROUGE at budget {budget:g}", summ, cols, caption,
                items=items)


def table_self_bleu(df: pd.DataFrame, budget: float = BUDGET) -> Table | None:
    """Appendix C.1: Self-BLEU of the generations (needs a ``self_bleu`` column, see
    :func:`analysis.self_bleu.add_self_bleu`); lower = more diverse."""
    summ = kind(df, "summarization")
    if summ.empty or "self_bleu" not in summ.columns:
        return None
    summ = summ.assign(n_samples=summ.get("self_bleu_n", pd.NA))  # generations scored
    cols = policy_cols(summ, ["h2o", "local"], budget, "self_bleu")
    caption = [f"budget: {budget:g} of the prompt",
               "Self-BLEU-4, nltk sentence_bleu, SmoothingFunction().method1, leave-one-out",
               "paper (LLaMA-7B, XSUM, 100 prompts): full 0.0057, H2O 0.0051, local 0.0436"]
    return grid("self_bleu", "Self-BLEU of generations (lower = more diverse)", summ, cols,
                caption, fmt=lambda v: num(v, 4))


def table_perplexity(df: pd.DataFrame) -> Table | None:
    """Perplexity (perplexity and streaming runs; the long-context figure) per policy x budget."""
    ppl = kind(df, ["perplexity", "streaming"], shots=None)
    if ppl.empty:
        return None
    budgets = sorted(ppl["budget"].dropna().unique())
    present = ppl["policy"].dropna().unique()
    items = [Col(label(p), {"policy": p}) for p in ["full"] + [
        p for p in POLICIES + sorted(set(present) - set(POLICIES)) if p in present and p != "full"]]
    cols = [Col(f"budget {b:g}", {"budget": float(b)}, "ppl") for b in budgets]
    return grid("perplexity", "Perplexity by policy and cache budget", ppl, cols,
                ["metric: ppl (lower is better)"], items=items, fmt=lambda v: num(v, 2))


BENCH_SETTING = ["model", "semantics", "prompt_len", "gen_len", "batch_size"]
BENCH_METRICS = [("throughput (tok/s)", "throughput_tok_s", lambda v: num(v, 1)),
                 ("latency (s)", "latency_s", lambda v: num(v, 3)),
                 ("KV cache (MiB)", "kv_bytes", lambda v: num(v / 2**20, 1)),
                 ("peak mem (MiB)", "peak_mem_bytes", lambda v: num(v / 2**20, 1))]


def mean(runs: pd.DataFrame, metric: str) -> float:
    return numeric(runs[metric]).mean() if metric in runs.columns else float("nan")


def ratio(value: float, full: float) -> str:
    return MISSING if pd.isna(value) or pd.isna(full) or full == 0 else f"{value / full:.2f}×"


def table_benchmark(df: pd.DataFrame) -> Table | None:
    """Tables 3-5: throughput, latency, KV bytes and peak memory, each also as a ratio to the
    full cache at the same model, semantics, prompt length, generation length and batch size."""
    bench = kind(df, "benchmark", shots=None)
    if bench.empty:
        return None
    bench = bench.assign(**{k: bench.get(k, np.nan) for k in BENCH_SETTING})
    pairs = bench[bench["policy"] != "full"][["policy", "budget"]].drop_duplicates()
    items = [("full", None)] + sorted(map(tuple, pairs.values), key=lambda p: (
        POLICIES.index(p[0]) if p[0] in POLICIES else 99, p[1]))
    header = ["model", "semantics", "prompt", "gen", "batch", "policy", "budget"]
    for name, _, _ in BENCH_METRICS:
        header += [name, name.split(" (")[0] + " × full"]
    rows = []
    for _, setting in bench[BENCH_SETTING].drop_duplicates().sort_values(BENCH_SETTING).iterrows():
        sub = same_key(bench, setting)
        full = largest(select(sub, {"policy": "full"}))
        for policy, budget in items:
            runs = full if budget is None else largest(
                select(sub, {"policy": policy, "budget": budget}))
            row = [key_str(v) for v in setting] + [label(policy), key_str(budget or 1.0)]
            for _, metric, fmt in BENCH_METRICS:
                row += [fmt(mean(runs, metric)), ratio(mean(runs, metric), mean(full, metric))]
            rows.append(row)
    caption = ["throughput = generated tokens / (prefill + decode time)",
               "× full: the policy's value over the full cache's at the same setting",
               "models: " + ", ".join(sorted(bench["model"].dropna().astype(str).unique())),
               f"{MISSING} = no finished run"]
    return Table("benchmark", "Tables 3-5: generation throughput, latency and memory", header,
                 rows, caption)


def all_tables(df: pd.DataFrame) -> list[Table]:
    """Every table the records allow (a table whose task kind has no run is left out)."""
    from analysis.self_bleu import add_self_bleu
    df = add_self_bleu(df) if "self_bleu" not in df.columns else df
    makers = [table1, table2, table8, table9, table10, table_rouge, table_self_bleu,
              table_perplexity, table_benchmark]
    return [t for t in (make(df) for make in makers) if t is not None]
