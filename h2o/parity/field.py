"""Sections of results/parity.md from golden records of the field's other reference code (no torch): SnapKV-D as the
minghui-liu/kvpress fork runs it (:mod:`h2o.parity.snapkv_d`) and the field's implementations of one method
(:mod:`h2o.parity.baselines`)."""
from __future__ import annotations

import json
from pathlib import Path


def read_golden(record: Path | None) -> dict | None:
    """A parity script's golden record (tests/data/parity_golden/*.json), None where it is not given or not written."""
    return json.loads(record.read_text()) if record is not None and record.is_file() else None


def tokens_row(label: str, gen: dict, differ: str = "") -> str:
    """A greedy-generation row: ``gen``'s tokens compared, those that differ (``differ`` after them) and the
    largest log-probability gap."""
    return (f"| {label} | {gen['steps']} tokens | {gen['steps'] - gen['tokens_equal']}{differ} | "
            f"log-prob {gen['largest_logprob_gap']:.1e} |")


def snapkv_d_section(record: Path | None) -> list[str]:
    """The fork's SnapKV-D beside ``snapkv_d`` (tests/data/parity_golden/snapkv_d.json)."""
    g = read_golden(record)
    if g is None:
        return []
    ref = g["reference"]
    rows = []
    for case, s in g["summary"].items():
        for way, label in (("in_position_order", "its kept slots in position order"),
                           ("as_it_runs", "as it runs (slots in `topk`'s order)")):
            rows.append(f"| {case} (budget {s['budget']}, window {s['window']}, kernel {s['kernel']}) | {label} | "
                        f"{s['prompt_cut_kept_differently'][way]} | {s['decoding_cuts_kept_differently'][way]} of "
                        f"{s['entries'] - s['entries'] // g['new']} | {s['largest_nll_gap'][way]:.1e} | "
                        f"{s['nll_per_token'][way]:.4f} ({s['nll_per_token']['ours']:.4f}) | "
                        f"{s['greedy_tokens_equal_before_a_difference'][way]} of {s['greedy_tokens']} |")
    return ["## SnapKV-D", "",
            f"`python -m h2o.parity.snapkv_d --reference DIR --golden` ran the minghui-liu/kvpress fork's SnapKV-D "
            f"({ref['repo']} at `{(ref['commit'] or '?')[:12]}`: {', '.join(ref['files'])}, imported from a checkout "
            "given on its command line, never copied): its `SnapKVPress` with `cache_budget`, its `forward_hook` on "
            "every attention layer of the committed tiny model above under transformers' eager attention (a shim "
            "gives the hook transformers 4's names), a prompt of "
            f"{len(g['prompt'])} random ids, then {g['new']} tokens one at a time; beside it `snapkv_d` "
            "(`compress=interval interval=1`) through the evicting cache. Each layer's positions ride along the "
            "fork's cache (each `topk` it calls is caught). Kept sets and NLL teacher-forced on our greedy tokens; "
            "greedy tokens each on its own.", "",
            "| case | the fork | (layer, head) kept differently at the prompt's cut | ... at the decoding cuts | "
            "largest NLL gap | NLL/token (ours) | greedy tokens equal before a difference |",
            "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
            "With its kept slots left in position order (each `topk`'s indices sorted) the fork keeps our tokens at "
            "every cut, layer and head and generates our tokens. As it runs, its cache is in `topk`'s order, so "
            "from its second cut on its \"last `window` slots\" are the new token and the lowest-scored survivors "
            "of the previous cut, and its pooling averages slot neighbours (docs/methods.md, \"SnapKV-D\"). "
            "tests/test_snapkv_d.py checks ours against these numbers.", ""]


def baselines_section(record: Path | None) -> list[str]:
    """The field's implementations of one method (tests/data/parity_golden/baselines.json)."""
    g = read_golden(record)
    if g is None:
        return []
    ref = g["reference"]
    rows = [f"| TriAttention's {r['reference']} | `{r['ours']}` | {r['budget']} | "
            f"{', '.join(f'{x:.2f}' for x in r['overlap'])} | {r['heads_equal']} of {r['heads']} | "
            f"{r['reference_nll']:.4f} | {r['ours_nll']:.4f} |" for r in g["rows"]]
    out = ["## The field's implementations of one method", "",
           f"`python -m h2o.parity.baselines --reference DIR --fork DIR2 --golden` ran TriAttention's own baselines "
           f"({ref['repo']} at `{(ref['commit'] or '?')[:12]}`: {', '.join(ref['files'])}; {ref['h2o']}, the file "
           "it removed) on the committed tiny model above: a prompt of "
           f"{g['prompt']} random ids cut once by each (its `update_kv` with the last {g['window']} queries, what its "
           f"attention forward stores after the prompt), then {g['cont']} ids teacher-forced; ours through the "
           "evicting cache at `compress=prefill` (each shown equal to its own reference above: `r_kv` to R-KV's "
           "code, `snapkv` to kvpress 0.5.5). Overlap: the share of the budget both keep, per layer, averaged over "
           f"the KV heads. Full cache: NLL/token {g['full_nll']:.4f}.", "",
           "| reference | ours | budget | overlap per layer | heads kept alike | NLL/token reference | ours |",
           "| --- | --- | --- | --- | --- | --- | --- |", *rows, ""]
    if g.get("h2o_error"):
        out += [f"TriAttention's H2O does not run: `{g['h2o_error']}` (every input). It squeezes the query-row axis "
                "of its scores and then averages over `dim=-2`, which is then the KV heads, so no head axis is left "
                "for its gather. Its rule as written is not H2O's: the newest query alone (no accumulation), the "
                "query group's largest logit, a softmax over every key but the newest, the newest kept (its window "
                "forced to 1), i.e. TOVA's score per KV head rather than `h2o`'s accumulated attention with a "
                "recent half.", ""]
    if g.get("fork_h2o"):
        rows = [f"| {r['budget']} | {r['fork']} | `{r['ours']}` | {r['kept_differently']} of {r['entries']} | "
                f"{r['largest_nll_gap']:.1e} | {r['fork_nll']:.4f} | {r['ours_nll']:.4f} | "
                f"{r['greedy_equal_before_a_difference']} of {r['greedy']} |" for r in g["fork_h2o"]]
        out += [f"The minghui-liu/kvpress fork's `H2OPress` (at `{(g.get('fork_commit') or '?')[:12]}`) over the "
                "long generation of the SnapKV-D section (its hook after every forward, a cut after every decoding "
                "token), teacher-forced on the greedy tokens of `h2_only score=mean`, ours at "
                "`compress=interval interval=1`:", "",
                "| budget | the fork | ours | (cut, layer, head) kept differently | largest NLL gap | NLL/token "
                "fork | ours | greedy tokens equal before a difference |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
                "Why, read in the code: the fork's H2O is kvpress's ObservedAttention carried to decoding (each "
                "token's attention averaged over the rows that saw it, no recent window), i.e. `h2_only score=mean`, "
                "not the paper's `h2o` (summed attention, half the budget a recent window). As shipped it keeps its "
                "accumulated scores in one attribute of the one press object hooked on every layer, so each layer's "
                "decoding step adds its row to the scores the previous layer left and gathers them by its own kept "
                "indices; with a copy of the press on each layer it keeps exactly our tokens.", ""]
    out += ["Where the field's implementations of one method disagree, and why (read in the code): "
            "**R-KV**: TriAttention's `R1KV` is R-KV's `R1KV` with `mix_lambda` 0.1 instead of 0.07 (its "
            "`retain_ratio` is read only by the \"percent\" directions; `protect_prefill`, off by default, keeps "
            "the prompt); at 0.1 ours keeps its tokens exactly (G-KV's repository's R-KV differs from R-KV's in its "
            "importance: section "
            "\"G-KV\"). **SnapKV**: TriAttention's `SnapKV` takes the query "
            "group's largest logit before the softmax (kvpress: the mean of the heads' probabilities after it), "
            "normalises its softmax over the keys before the window only (kvpress: over every key the query sees), "
            "and max-pools (kvpress: average; the SnapKV paper: max), with R-KV's defaults window 8, kernel 7; the "
            "budget includes the window in both. **H2O**: five "
            "rules under one name: the paper's (`h2o`, its own code: summed attention and a recent window), "
            "kvpress's ObservedAttention (mean attention, no window, at the prompt's end: `h2_only score=mean`), "
            "the fork's H2OPress (the same at every step, its layers' scores mixed as shipped), G-KV's repository's "
            "(the newest query's attention added to 0.8 of the carried score, section \"G-KV\"), TriAttention's `H2O` "
            "(first committed there as a copy under R-KV/rkv/compression/; the newest query only; does not run). "
            "tests/test_baselines.py checks ours against these "
            "numbers.", ""]
    return out
