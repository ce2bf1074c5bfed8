"""Parity of ``g_kv`` with G-KV's reference scoring (microsoft/G-KV, ``gkv/model/compression/score_based.py``'s
``ScoreBasedKV.update_kv`` with ``gkv/utils/compression_score.py``), run side by side on recorded states; and the
reference repository's own H2O and R-KV recipes (the same ``ScoreBasedKV``) beside this harness's ``h2o`` and
``r_kv``.

``python -m h2o.parity.g_kv --reference DIR`` (DIR: a checkout of microsoft/G-KV, its ``gkv/`` folder inside; the
three files the scoring needs are imported from there, never copied into this repository):

1. **States**: those of R-KV's parity (:func:`h2o.parity.r_kv.record_states`: the committed tiny model of the golden
   numbers, 3 layers, 4 query heads on 2 KV heads, reading 96 token ids from a small vocabulary, so keys repeat
   and the redundancy's threshold is crossed).
2. **The first cut** (the whole sequence as a prompt, per layer and budget): the reference's
   ``ScoreBasedKV(**G-KV's recipe).update_kv(keys, last w queries, positions as values)``, its score the input of its
   ``topk`` (caught, not recomputed); ours: the rule's hooks on the same queries and keys (:func:`ours_cut`).
3. **Later cuts** (the decoding schedule, ``divide_length`` :data:`EVERY`): cut at the prompt's end
   (:data:`PROMPT` tokens) and then every :data:`EVERY` tokens, each side carrying its own cache and its history
   (the reference's ``score_cache``, ours the rule's state), compared per layer, head and cut: kept positions,
   scores, and the history the kept tokens carry.
4. **The field's other implementations** (:func:`field_cuts`): G-KV's repository runs H2O, R-KV and SnapKV as
   recipes of the same ``ScoreBasedKV`` (its scripts/inference.sh); at the first cut the kept sets of its H2O beside
   ``h2o`` (and ``tova``: the newest query's attention) and of its R-KV beside ``r_kv`` (which equals R-KV's own
   code there: r_kv.json), overlap per layer; ``r_kv`` with the repository's importance (:func:`probs_importance`).

The reference's similarity is a Triton kernel (``cal_similarity_triton``, its default). Without a GPU it runs in
Triton's interpreter (``TRITON_INTERPRET=1``, set by :mod:`h2o.parity.g_kv_reference`), which needs a Triton that still has block pointers (3.6;
``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``); a Triton without them is a one-line refusal.

``--golden`` writes tests/data/parity_golden/g_kv.json (what CI compares ours with: tests/test_g_kv.py); the summary
is printed. Outside CI: CI has no reference checkout.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from h2o.parity.g_kv_reference import FILES, load_reference
from h2o.parity.pairs import GKV_RECORD as RECORD
from h2o.parity.r_kv import CatchTopk, golden_first, golden_ids, record_states

BUDGETS = (24, 40, 64)
PROMPT, EVERY, LATER_BUDGET = 40, 16, 32  # the later cuts: the prompt's, then every EVERY tokens, at LATER_BUDGET
STEPS = 256  # the greedy generation after the first PROMPT ids: 16 cuts
OPTIONS = {"window": 16, "alpha": 0.8, "mix_lambda": 0.5, "threshold": 0.5}  # G-KV's recipe (scripts/inference.sh)
# the recipes of G-KV's scripts/inference.sh for ScoreBasedKV (window_size 16 for all, its --window_size there)
RECIPES = {
    "g_kv": {"window_size": 16, "suppressing_redundancy": True, "mix_lambda": 0.5, "enable_score_cache": True,
             "alpha": 0.8, "smooth_method": "max"},
    "h2o": {"window_size": 1, "enable_score_cache": True, "smooth_method": "sum", "alpha": 0.8},
    "r_kv": {"window_size": 16, "enable_pooling": True, "suppressing_redundancy": True, "mix_lambda": 0.1,
             "kernel_size": 5},
}


# ----------------------------------------------------------------------------------------------- reference
def reference_cut(ScoreBasedKV, recipe: dict, keys, queries, pos, budget: int, history=None):
    """keys (1, Hkv, S, D) in the reference's cache order (positions), pos (1, Hkv, S) their positions, queries
    (1, Hq, w, D) the query cache, history its ``score_cache`` (1, Hkv, c) or None -> (each KV head's kept positions,
    its score (Hkv, S - w) or None where nothing was cut, its new score_cache)."""
    cluster = ScoreBasedKV(budget=budget, **recipe)
    values = pos[..., None].to(keys.dtype).expand_as(keys).contiguous()  # the positions ride along as values
    mask = torch.ones(1, keys.shape[2], dtype=torch.long)  # no pads (its Triton kernel reads the mask)
    with CatchTopk() as catch:
        _, kept, _, history = cluster.update_kv(keys, queries, values, attention_mask=mask, score_cache=history)
    return kept[0, :, :, 0].round().long().tolist(), catch.inputs[0][0] if catch.inputs else None, history


# ----------------------------------------------------------------------------------------------- ours
def window_rows(state: dict, held_pos: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the attention of the query rows at positions ``rows`` (r,) over the held positions
    ``held_pos`` (Hkv, n), each row's softmax over the held keys up to itself (what each row saw when every one
    came after the last cut) -> (logits, probs), each (1, Hkv, G, r, n)."""
    keys_all, queries = state["keys"][0], state["queries"][0]  # (Hkv, T, D), (Hq, T, D)
    Hkv, n = held_pos.shape
    keys = keys_all.gather(1, held_pos[..., None].expand(Hkv, n, keys_all.shape[-1]))  # (Hkv, n, D)
    q = queries[:, rows].view(Hkv, -1, len(rows), queries.shape[-1])  # (Hkv, G, r, D)
    logits = q @ keys[:, None].transpose(-1, -2) * state["scaling"]  # (Hkv, G, r, n)
    seen = held_pos[:, None, None, :] <= rows[None, None, :, None]  # (Hkv, 1, r, n)
    return logits[None], logits.masked_fill(~seen, -torch.inf).softmax(-1)[None]


def ours_cut(name, options: dict, state: dict, held_pos: torch.Tensor, now: int, budget: int,
             history: torch.Tensor | None = None, rows: int | None = None):
    """Rule ``name``'s (or a policy class's) cut over the held positions ``held_pos`` (Hkv, n) ascending of the
    recorded ``state``, the newest ``rows`` rows (all: None) those up to ``now``; ``history`` (Hkv, n) g_kv's
    carried state (None: 0) -> (each KV head's kept positions, ascending; the priority (Hkv, n); g_kv's history of
    the kept (Hkv, m))."""
    from h2o.core import engine, step
    from h2o.core.policies import make_policy

    policy = make_policy(name, budget=budget, compress="prefill", **options) if isinstance(name, str) \
        else name(budget=budget, **options).timed("prefill")
    keys_all = state["keys"][0]
    Hkv, n = held_pos.shape
    keys = keys_all.gather(1, held_pos[..., None].expand(Hkv, n, keys_all.shape[-1]))[None]  # (1, Hkv, n, D)
    first = now + 1 - (rows or now + 1)
    logits, probs = window_rows(state, held_pos, torch.arange(first, now + 1))  # (1, Hkv, G, r, n)
    acc = policy.new_state(1, Hkv, n, keys.device)
    if history is not None:
        acc[0, ..., -1] = history
    rows_in = engine.rows_read(policy, logits, probs)  # r_kv, g_kv pool the heads' logits
    policy.accumulate_prompt(acc, rows_in, None, (now - torch.arange(first, now + 1))[None])
    pos = held_pos[None]  # (1, Hkv, n)
    counts = policy.counts(torch.tensor([now + 1]))
    state_ = step.score(policy, acc, keys, pos >= 0)  # the held keys' score where the rule reads them
    prio = policy.priority(pos, state_, torch.tensor([now]), counts)
    policy.cut_order(acc, prio, pos, pos >= 0, counts)
    keep = policy.keep(prio, pos, pos >= 0, counts)[0]  # (Hkv, n)
    kept = [held_pos[h][keep[h]].tolist() for h in range(Hkv)]  # ascending: held_pos is
    carried = torch.stack([acc[0, h, keep[h], -1] for h in range(Hkv)]) if acc.dim() == 4 else None
    return kept, prio[0], carried


def first_cuts(states: list[dict], ScoreBasedKV=None) -> dict:
    """Per layer and budget, the whole sequence cut once: ours (and the reference's, with ``ScoreBasedKV``)."""
    out = {}
    T, w = states[0]["keys"].shape[2], OPTIONS["window"]
    for layer, state in enumerate(states):
        Hkv = state["keys"].shape[1]
        held = torch.arange(T).expand(Hkv, T)
        for budget in BUDGETS:
            kept, prio, _ = ours_cut("g_kv", OPTIONS, state, held, T - 1, budget, rows=w)
            row = {"ours_kept": kept, "ours_score": prio[:, :T - w].tolist()}
            if ScoreBasedKV is not None:
                ref, score, _ = reference_cut(ScoreBasedKV, RECIPES["g_kv"], state["keys"],
                                              state["queries"][:, :, -w:], held[None], budget)
                row |= {"reference_kept": ref, "reference_score": score.tolist()}
            out[f"{layer}/{budget}"] = row
    return out


def later_cuts(states: list[dict], ScoreBasedKV=None, options: dict | None = None) -> list[dict]:
    """The prompt's cut, then one every :data:`EVERY` tokens, per layer, each side carrying its cache and history;
    each cut's kept positions per head, the largest |score gap| and |history gap| of the kept (with the reference)."""
    options = OPTIONS if options is None else options
    T, w, budget = states[0]["keys"].shape[2], OPTIONS["window"], LATER_BUDGET
    cuts = list(range(PROMPT - 1, T, EVERY))
    out = []
    for layer, state in enumerate(states):
        Hkv = state["keys"].shape[1]
        ours = reference = torch.arange(PROMPT).expand(Hkv, PROMPT)  # (Hkv, n) held positions
        history = ref_history = None
        for c, now in enumerate(cuts):
            if c:
                new = torch.arange(cuts[c - 1] + 1, now + 1).expand(Hkv, -1)
                ours, reference = torch.cat([ours, new], 1), torch.cat([reference, new], 1)
                history = torch.cat([history, torch.zeros(Hkv, new.shape[1])], 1)
            kept, prio, carried = ours_cut("g_kv", options, state, ours, now, budget, history, rows=w)
            ours, history = torch.tensor(kept), carried
            row = {"layer": layer, "now": now, "ours": kept}
            if ScoreBasedKV is not None:
                keys = state["keys"].gather(2, reference[None, ..., None].expand(1, Hkv, -1, state["keys"].shape[-1]))
                ref, score, ref_history = reference_cut(ScoreBasedKV, RECIPES["g_kv"], keys,
                                                        state["queries"][:, :, now + 1 - w:now + 1], reference[None],
                                                        budget, ref_history)
                reference = torch.tensor(ref)
                n_old = reference.shape[1] - w
                row |= {"reference": ref, "score_gap": float((prio[:, :score.shape[1]] - score).abs().max()),
                        "history_gap": float((history[:, :n_old] - ref_history[0]).abs().max())}
            out.append(row)
    return out


# ----------------------------------------------------------------------------------------------- generation
def generate_reference(model, ScoreBasedKV, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, P) as G-KV's patched model and ``generate`` run it
    (gkv/model/modeling_llama.py, gen_patch.py), on the model's eager attention over a DynamicCache: each layer
    keeps its newest ``window_size`` queries (``query_cache``); at forward ``k`` (0: the prompt's) with
    ``k % divide_length == 0`` each layer's cache, the token just in, is cut by ``update_kv`` after its attention
    (the reference attends with the uncut keys and stores the cut), its ``score_cache`` carried
    -> (the tokens, each one's NLL under the logits that chose it)."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    recipe, w = RECIPES["g_kv"], RECIPES["g_kv"]["window_size"]
    queries: dict[int, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, scaling, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        before = queries.get(module.layer_idx)
        both = query if before is None else torch.cat([before, query], 2)
        queries[module.layer_idx] = both[:, :, -w:]  # (1, Hq, <= w, D) the query cache
        mask = None if query.shape[2] == 1 else attention_mask  # one token sees every held key (a cut cache's
        # length is not the one transformers sizes its mask by)
        return eager(module, query, key, value, mask, scaling=scaling, **kwargs)

    AttentionInterface.register("gkv_reference", recording)
    AttentionMaskInterface.register("gkv_reference", eager_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation("gkv_reference")
    cache, history, tokens, nll = DynamicCache(), {}, [], []
    P = prompt.shape[1]
    try:
        with torch.no_grad():
            ids = prompt
            for k in range(steps):
                at = (torch.arange(P) if k == 0 else torch.tensor([P + k - 1]))[None]  # this forward's positions
                logits = model(ids, cache=cache, use_cache=True, position_ids=at).logits[0, -1]
                if k % EVERY == 0:
                    for i, stored in enumerate(cache.layers):  # transformers' DynamicLayer, not ours
                        S = stored.keys.shape[2]
                        cut = ScoreBasedKV(budget=LATER_BUDGET, **recipe)
                        stored.keys, stored.values, _, history[i] = cut.update_kv(
                            stored.keys, queries[i], stored.values, attention_mask=torch.ones(1, S, dtype=torch.long),
                            score_cache=history.get(i))
                token = int(logits.argmax())
                tokens.append(token)
                nll.append(float(-logits.log_softmax(-1)[token]))
                ids = torch.tensor([[token]])
    finally:
        model.set_attn_implementation(before)
    return tokens, nll


def generate_ours(model, prompt: torch.Tensor, steps: int,
                  options: dict | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, P) through the evicting cache under ``g_kv`` at
    ``compress=interval`` :data:`EVERY` -> (the tokens, each one's NLL under the logits that chose it)."""
    from h2o import attach, make_policy

    policy = make_policy("g_kv", budget=LATER_BUDGET, interval=EVERY, **(OPTIONS if options is None else options))
    tokens, nll = [], []
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        ids = prompt
        for _ in range(steps):
            logits = model(ids, cache=cache).logits[0, -1]
            token = int(logits.argmax())
            tokens.append(token)
            nll.append(float(-logits.log_softmax(-1)[token]))
            ids = torch.tensor([[token]])
    return tokens, nll


# ----------------------------------------------------------------------------------------------- the field
def field_cuts(states: list[dict], ScoreBasedKV) -> dict:
    """At the first cut (the whole sequence), per layer and budget: G-KV's repository's H2O and R-KV recipes
    beside ``h2o`` and ``r_kv`` (at the recipe's window, kernel and mix) -> their kept positions per head."""
    T = states[0]["keys"].shape[2]
    out = {}
    for layer, state in enumerate(states):
        Hkv = state["keys"].shape[1]
        held = torch.arange(T).expand(Hkv, T)
        for budget in BUDGETS:
            row = {}
            for recipe in ("h2o", "r_kv"):
                r = RECIPES[recipe]
                row[f"gkv_repo_{recipe}"], _, _ = reference_cut(
                    ScoreBasedKV, r, state["keys"], state["queries"][:, :, -r["window_size"]:], held[None], budget)
            row["h2o"], _, _ = ours_cut("h2o", {}, state, held, T - 1, budget)
            row["h2o_recent1"], _, _ = ours_cut("h2o", {"heavy": budget - 1, "recent": 1}, state, held, T - 1, budget)
            row["tova"], _, _ = ours_cut("tova", {}, state, held, T - 1, budget, rows=1)  # the newest query's
            rk = RECIPES["r_kv"]
            same = {"window": rk["window_size"], "kernel": rk["kernel_size"], "mix_lambda": rk["mix_lambda"]}
            row["r_kv"], _, _ = ours_cut("r_kv", same, state, held, T - 1, budget, rows=rk["window_size"])
            row["r_kv_probs"], _, _ = ours_cut(probs_importance(), same, state, held, T - 1, budget,
                                               rows=rk["window_size"])
            out[f"{layer}/{budget}"] = row
    return out


def probs_importance():
    """A diagnostic, not a method: ``r_kv`` with its importance as G-KV's repository computes it (each row's
    probabilities over every held key it sees, the maximum over the query heads, their mean; R-KV's code: the
    heads' maximum logit, a softmax over the older tokens), to show that this is where the two implementations
    part. It is handed the rows' logits (``reads_logits``) of the newest rows, in position order (a first cut).
    Made here, not at import: the policies' package imports Triton, which must come after TRITON_INTERPRET."""
    import torch.nn.functional as F

    from h2o.core.policies.r_kv import RKV
    from h2o.core.policies.snapkv import push_rows

    class ProbsImportance(RKV):
        name = ""

        def accumulate(self, acc, probs, valid=None) -> None:
            """acc (B, H, S, w) <- each newest row's softmax (causal among the newest) maxed over the heads."""
            S, r = probs.shape[-1], probs.shape[-2]
            seen = torch.arange(S)[None, :] <= torch.arange(S - r, S)[:, None]  # (r, S) the rows are the newest
            push_rows(acc, probs.float().masked_fill(~seen, -torch.inf).softmax(-1).amax(2).transpose(-1, -2), valid)

        def importance(self, rows, pos, older):
            """The rows' mean over the older tokens (no second softmax), max-pooled as R-KV's."""
            B, H, S, _ = rows.shape
            order = torch.where(older, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
            line = rows.mean(-1).gather(-1, order).masked_fill(~older.gather(-1, order), -torch.inf)
            pooled = F.max_pool1d(line.view(B * H, 1, S), self.kernel, 1, self.kernel // 2).view(B, H, S)
            return torch.empty_like(pooled).scatter_(-1, order, pooled)

    return ProbsImportance


def overlap(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of kept positions two kept sets (per head) have in common."""
    return sum(len(set(x) & set(y)) for x, y in zip(a, b)) / max(1, sum(len(x) for x in a))


def field_summary(field: dict) -> dict:
    """Per pair and budget: the kept-set overlap per layer, and the heads kept identically."""
    pairs = {"h2o vs gkv_repo_h2o": ("h2o", "gkv_repo_h2o"),
             "h2o (recent 1) vs gkv_repo_h2o": ("h2o_recent1", "gkv_repo_h2o"),
             "tova vs gkv_repo_h2o": ("tova", "gkv_repo_h2o"),
             "r_kv vs gkv_repo_r_kv": ("r_kv", "gkv_repo_r_kv"),
             "r_kv with the repository's importance vs gkv_repo_r_kv": ("r_kv_probs", "gkv_repo_r_kv")}
    out = {}
    for label, (a, b) in pairs.items():
        for budget in BUDGETS:
            rows = [(k, v) for k, v in field.items() if k.endswith(f"/{budget}")]
            out.setdefault(label, {})[str(budget)] = {
                "overlap_per_layer": [round(overlap(v[a], v[b]), 3) for _, v in rows],
                "heads_equal": sum(x == y for _, v in rows for x, y in zip(v[a], v[b])),
                "heads": sum(len(v[a]) for _, v in rows)}
    return out


# ----------------------------------------------------------------------------------------------- summary, CLI
def compare(first: dict, later: list[dict]) -> dict:
    """The largest |score difference| and the kept sets that differ, at the first cut and at the later ones."""
    gap, differ = 0.0, 0
    for row in first.values():
        ours, ref = torch.tensor(row["ours_score"]), torch.tensor(row["reference_score"])
        gap = max(gap, float((ours - ref).abs().max()))
        differ += sum(a != b for a, b in zip(row["ours_kept"], row["reference_kept"]))
    return {"first_cut": {"largest_score_gap": float(f"{gap:.2e}"), "heads_kept_differently": differ,
                          "heads": sum(len(r["ours_kept"]) for r in first.values())},
            "later_cuts": {"heads": sum(len(r["ours"]) for r in later),
                           "kept_differently": sum(a != b for r in later for a, b in zip(r["ours"], r["reference"])),
                           "largest_score_gap": float(f"{max(r['score_gap'] for r in later):.2e}"),
                           "largest_history_gap": float(f"{max(r['history_gap'] for r in later):.2e}")}}


def main(argv=None) -> int:
    from h2o.parity.golden import load_model
    from h2o.parity.script import arguments, commit, report

    a = arguments("h2o.parity.g_kv", __doc__, "a checkout of microsoft/G-KV (its gkv/ folder inside)", RECORD, argv)
    root = Path(a.reference)
    ScoreBasedKV = load_reference(root)
    reference = {"repo": "microsoft/G-KV", "commit": commit(root), "files": list(FILES)}
    states = record_states(load_model(), golden_ids())
    first = first_cuts(states, ScoreBasedKV)
    later = later_cuts(states, ScoreBasedKV)
    field = field_cuts(states, ScoreBasedKV)
    prompt = golden_ids()[:, :PROMPT]
    ref_tokens, ref_nll = generate_reference(load_model(), ScoreBasedKV, prompt, STEPS)
    tokens, nll = generate_ours(load_model(), prompt, STEPS)
    generation = {"steps": STEPS, "tokens_equal": sum(a == b for a, b in zip(tokens, ref_tokens)),
                  "first_apart": next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None),
                  "largest_nll_gap": float(f"{max(abs(a - b) for a, b in zip(nll, ref_nll)):.2e}")}
    summary = {**compare(first, later), "generation": generation, "field": field_summary(field)}
    return report(a, "h2o.parity.g_kv", RECORD, summary, reference, {
        "ids": golden_ids()[0].tolist(), "options": OPTIONS, "recipes": RECIPES, "budgets": list(BUDGETS),
        "prompt": PROMPT, "every": EVERY, "later_budget": LATER_BUDGET, "summary": summary,
        "first_cut": golden_first(first),
        "later_cuts": [{"layer": r["layer"], "now": r["now"], "kept": r["reference"]} for r in later],
        "steps": STEPS, "generation": {"tokens": ref_tokens, "nll": [float(f"{x:.7g}") for x in ref_nll]},
        "field": field})


if __name__ == "__main__":
    sys.exit(main())
