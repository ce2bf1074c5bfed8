"""Parity of ``triattention`` with TriAttention's reference code (WeianMao/triattention v0.2.0,
``triattention/methods/triattention.py`` and ``pruning_utils.py``), run side by side on recorded states.

``python -m h2o.parity.triattention --reference DIR`` (DIR: a checkout of WeianMao/triattention, its
``triattention/`` package inside; imported from there, never copied into this repository):

1. **States**: the committed tiny model of the golden numbers (tests/data/parity_golden/model: a random Llama of 3
   layers, 4 query heads on 2 KV heads, head size 16) reads :data:`LENGTH` token ids; each layer's keys after RoPE
   are recorded (:func:`h2o.parity.r_kv.record_states`). The statistics both sides read are ours, calibrated on
   :data:`TEXT` (a passage of Austen) over the same model (``h2o.assets.triattention.calibrate``), handed to the
   reference in its file format (:func:`reference_stats`).
2. **The first cut**, per budget: the whole sequence held, its first :data:`PROMPT` tokens the prompt. The
   reference's ``TriAttention.compute_keep_indices`` (``per_layer_perhead_pruning``, ``normalize_scores``, no
   tie-breaking noise) keeps per layer and KV head; its per-query-head scores are caught from
   ``_compute_layer_head_scores``; ours: :meth:`TriAttention.head_scores` and the rule's cut.
3. **Later cuts**: the reference's slack trigger (the cache cut back to the budget once it holds the budget plus
   :data:`EVERY`), each side keeping its own cache per layer and KV head; the kept positions at every cut.
4. **Generation**: greedy decoding of :data:`STEPS` tokens after the first :data:`GEN_PROMPT` ids, the reference's
   own model patch (``apply_triattention_patch``: its forward wrapper, its cache, its slack trigger) beside ours
   (the evicting cache at ``compress=buffer``, the same trigger): the tokens, each step's log-probability of its
   token, and the full cache's tokens (the eviction changes them: the comparison is not vacuous). With
   ``--smollm2``, the same on SmolLM2-135M (:data:`SMOL`: 256 tokens after 70 of Austen; its cached checkpoint and
   calibration), into the summary.
5. **Calibration**: the reference's ``scripts/calibrate.py`` (``calibrate``: one forward in bfloat16, which it
   hard-codes, the queries recomputed from ``q_proj`` through RoPE and back) over :data:`TEXT` on the committed model,
   beside ours on the same token ids with the model in bfloat16: the largest difference of each statistic.

The repository's own baselines (H2O, R1KV, SnapKV) beside ``h2o``, ``r_kv``, ``snapkv``: :mod:`h2o.parity.baselines`.

``--per-head-pruning``: the same checks in the reference's default mode, ``per_head_pruning`` (one set of positions
per KV head, the same in every layer: the mean over layers of each layer's group maxima, ranked once;
``_select_per_head_independent``) beside ours (``per_head_pruning=True``: :meth:`TriAttention.layers_priority`, the
evicting cache cut after each forward); its record is tests/data/parity_golden/triattention_per_head.json.

``--golden`` writes tests/data/parity_golden/triattention.json (what CI compares ours with:
tests/test_triattention.py); the summary is printed.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import tempfile
from pathlib import Path

import torch

from h2o.parity.pairs import TRI_HEAD_RECORD as HEAD_RECORD, TRI_RECORD as RECORD
from h2o.parity.r_kv import record_states
from h2o.parity.triattention_calibration import TEXT, calibration_gaps, ours_in_bf16, reference_calibration

LENGTH, VOCAB, SEED = 128, 200, 3  # the recorded sequence: ids in [3, VOCAB)
PROMPT, EVERY = 16, 16  # the prompt's tokens (never scored), the slack before a later cut
BUDGETS = (32, 64, 96)
GEN_PROMPT, GEN_BUDGET, STEPS = 32, 64, 160  # the generation: 16 tokens below the budget, then its slack
SMOL = {"prompt": 70, "budget": 80, "steps": 256, "offset": 200000}  # --smollm2: budget - prompt not a
# multiple of EVERY (where compress=interval would cut on other steps than the reference), Austen from offset
OPTIONS = {"normalize_scores": True, "offset_max_length": 65536, "head_aggregation": "max"}  # its defaults

# ----------------------------------------------------------------------------------------------- reference
def load_reference(root: Path):
    """The reference's ``triattention.methods.triattention`` module from ``root`` (a checkout)."""
    need = root / "triattention" / "methods" / "triattention.py"
    if not need.is_file():
        raise SystemExit(f"--reference={root}: no {need}; allowed: a checkout of WeianMao/triattention")
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("triattention.methods.triattention")
    finally:
        sys.path.remove(str(root))
    utils = sys.modules["triattention.methods.pruning_utils"]
    rotary = utils.LlamaRotaryEmbedding
    if "device" not in inspect.signature(rotary.__init__).parameters:  # transformers 5 dropped it: the same table
        utils.LlamaRotaryEmbedding = lambda config, device=None: rotary(config).to(device)
    return module


def reference_stats(cal: dict, path: Path) -> Path:
    """Our calibration in the reference's file format (``save_head_frequency_stats``: per ``layerLL_headHH`` the
    mean query's real and imaginary parts and the mean modulus; every head sampled)."""
    L, Hq, _ = cal["q_abs_mean"].shape
    heads = [[layer, h] for layer in range(L) for h in range(Hq)]
    stats = {f"layer{layer:02d}_head{h:02d}": {"q_mean_real": cal["q_mean_real"][layer, h],
                                               "q_mean_imag": cal["q_mean_imag"][layer, h],
                                               "q_abs_mean": cal["q_abs_mean"][layer, h]} for layer, h in heads}
    torch.save({"metadata": {"sampled_heads": heads, "head_dim": 2 * cal["q_abs_mean"].shape[-1],
                             "rope_style": "half"}, "stats": stats}, path)
    return path


def reference_rule(module, stats: Path, budget: int, per_head: bool = False):
    from h2o.parity.golden import MODEL_DIR

    config = module.TriAttentionConfig(
        stats_path=stats, model_path=MODEL_DIR, device=torch.device("cpu"), dtype=torch.float32, budget=budget,
        offset_max_length=OPTIONS["offset_max_length"], score_aggregation="mean", seed=None,
        normalize_scores=OPTIONS["normalize_scores"], count_prompt_tokens=True, divide_length=EVERY,
        use_slack_trigger=True, per_layer_perhead_pruning=not per_head, per_head_pruning=per_head,
        layer_perhead_aggregation=OPTIONS["head_aggregation"])
    return module.TriAttention(config)


def reference_cut(rule, keys: list[torch.Tensor], held: list[torch.Tensor], now: int, per_head: bool = False
                  ) -> tuple[list[list[list[int]]], list[torch.Tensor]]:
    """keys: per layer (1, Hkv, T, D) of every position, held: per layer (Hkv, n) the positions each KV head holds
    (the prompt's first, in order) -> (per layer and KV head the kept positions, ascending; per layer the
    reference's per-query-head scores (Hq, n - PROMPT) of the scored tokens). ``per_head``: the rule in
    ``per_head_pruning`` (``held`` the same in every layer; its positions per KV head, ``cache_positions_per_head``)."""
    pkv = []
    for k, h in zip(keys, held):
        gathered = k[0].gather(1, h[..., None].expand(*h.shape, k.shape[-1]))[None]  # (1, Hkv, n, D)
        pkv.append((gathered, gathered))
    rule.cache_positions = held[0][0].tolist()
    if per_head:
        rule.cache_positions_per_head = [h.tolist() for h in held[0]]
    else:
        rule.cache_positions_per_layer_perhead = {(i, kv): h[kv].tolist() for i, h in enumerate(held)
                                                  for kv in range(h.shape[0])}
    rule.absolute_position = now + 1
    caught = []
    inner = rule._compute_layer_head_scores

    def catching(*args, **kwargs):
        out = inner(*args, **kwargs)
        caught.append(out.detach().clone())
        return out

    rule._compute_layer_head_scores = catching
    try:
        idx = rule.compute_keep_indices(tuple(pkv), prefix_length=PROMPT)  # (L, Hkv, kept); per_head (Hkv, kept)
    finally:
        del rule._compute_layer_head_scores
    Hkv = held[0].shape[0]
    if per_head:  # one set per KV head for every layer (1D where nothing is scored: the same for every head)
        idx = (idx if idx.dim() == 2 else idx.expand(Hkv, -1)).expand(len(keys), -1, -1)
        return [[sorted(h[kv][idx[i, kv]].tolist()) for kv in range(Hkv)] for i, h in enumerate(held)], \
            caught[:len(keys)]  # its global matrix: the per-layer calls it aggregates
    kept = [[sorted(h[kv][idx[i, kv]].tolist()) for kv in range(h.shape[0])] for i, h in enumerate(held)]
    return kept, caught[-len(keys):]  # the per-layer calls (the first len(keys): its unused global matrix)


# ----------------------------------------------------------------------------------------------- ours
def calibration(model) -> dict:
    from h2o.assets.tiny import byte_tokenizer
    from h2o.assets.triattention import calibrate
    from h2o.parity.golden import weights_sha256

    ids = torch.tensor(byte_tokenizer()(TEXT, add_special_tokens=False).input_ids)[None]
    return calibrate(model, ids, weights_sha256(), {"model": "parity_golden", "text": "TEXT"})


def ours_cut(cal: dict, keys: list[torch.Tensor], held: list[torch.Tensor], now: int, budget: int,
             per_head: bool = False) -> tuple[list[list[list[int]]], list[torch.Tensor]]:
    """Our rule's cut over the same held positions: (per layer and KV head the kept positions; per layer our
    per-query-head scores (Hq, n - PROMPT) of the scored tokens). ``per_head``: ``per_head_pruning=True``, one
    ranking over every layer (:meth:`TriAttention.layers_priority`; ``held`` the same in every layer)."""
    from h2o.core.policies import make_policy
    from h2o.core.policies.base import keep_top

    policy = make_policy("triattention", budget=budget, stats=cal, per_head_pruning=per_head, **OPTIONS)
    kept, scores = [], []
    if per_head:
        h = held[0]
        Hkv, n = h.shape
        k_held = [k[0].gather(1, h[..., None].expand(Hkv, n, k.shape[-1]))[None] for k in keys]  # (1, Hkv, n, D)
        pos, now_t = h[None], torch.tensor([now])
        counts = policy.counts(torch.tensor([PROMPT]))
        rules = [policy.for_layer(i, len(keys)) for i in range(len(keys))]
        keep = keep_top(policy.layers_priority(rules, k_held, pos, now_t, counts), pos >= 0, counts.total)[0]
        one = [sorted(h[kv][keep[kv]].tolist()) for kv in range(Hkv)]
        scores = [rule.head_scores(k, pos, now_t)[0, :, :, PROMPT:].reshape(-1, n - PROMPT)
                  for rule, k in zip(rules, k_held)]
        return [one] * len(keys), scores
    for i, (k, h) in enumerate(zip(keys, held)):
        rule = policy.for_layer(i, len(keys))
        Hkv, n = h.shape
        k_held = k[0].gather(1, h[..., None].expand(Hkv, n, k.shape[-1]))[None]  # (1, Hkv, n, D)
        pos, now_t = h[None], torch.tensor([now])
        counts = rule.counts(torch.tensor([PROMPT]))
        prio = rule.priority(pos, rule.cut_score(None, k_held, pos >= 0), now_t, counts)
        keep = rule.keep(prio, pos, pos >= 0, counts)[0]  # (Hkv, n)
        kept.append([sorted(h[kv][keep[kv]].tolist()) for kv in range(Hkv)])
        scores.append(rule.head_scores(k_held, pos, now_t)[0, :, :, PROMPT:].reshape(-1, n - PROMPT))
    return kept, scores


# ----------------------------------------------------------------------------------------------- runs
def first_cuts(cal: dict, states: list[dict], module=None, stats: Path | None = None, per_head: bool = False
               ) -> dict:
    """Per budget, the whole sequence held and cut once: ours (and the reference's, with ``module``)."""
    keys = [s["keys"] for s in states]
    T, Hkv = keys[0].shape[2], keys[0].shape[1]
    held = [torch.arange(T).expand(Hkv, T)] * len(keys)
    out = {}
    for budget in BUDGETS:
        kept, scores = ours_cut(cal, keys, held, T - 1, budget, per_head)
        row = {"ours_kept": kept, "ours_score": [s.tolist() for s in scores]}
        if module is not None:
            ref, caught = reference_cut(reference_rule(module, stats, budget, per_head), keys, held, T - 1, per_head)
            row |= {"reference_kept": ref, "reference_score": [s.tolist() for s in caught]}
        out[str(budget)] = row
    return out


def later_cuts(cal: dict, states: list[dict], budget: int, module=None, stats: Path | None = None,
               per_head: bool = False) -> list[dict]:
    """The prompt, then one token at a time; a cut whenever the cache holds ``budget + EVERY`` tokens (the
    reference's slack trigger), each side from its own cache: per cut the kept positions per layer and KV head."""
    keys = [s["keys"] for s in states]
    T, Hkv = keys[0].shape[2], keys[0].shape[1]
    ours = reference = [torch.arange(PROMPT).expand(Hkv, PROMPT)] * len(keys)
    out = []
    for now in range(PROMPT, T):
        new = torch.full((Hkv, 1), now)
        ours = [torch.cat([h, new], 1) for h in ours]
        reference = [torch.cat([h, new], 1) for h in reference]
        if ours[0].shape[1] < budget + EVERY:
            continue
        kept, _ = ours_cut(cal, keys, ours, now, budget, per_head)
        ours = [torch.tensor(k) for k in kept]
        row = {"now": now, "ours": kept}
        if module is not None:
            ref, _ = reference_cut(reference_rule(module, stats, budget, per_head), keys, reference, now, per_head)
            reference = [torch.tensor(k) for k in ref]
            row["reference"] = ref
        out.append(row)
    return out


def greedy(step, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[float]]:
    """``step(ids) -> logits (1, r, V)`` of the next forward; greedy for ``steps`` tokens after ``prompt``
    -> (tokens, each token's log-probability)."""
    logits = step(prompt)[:, -1]
    tokens, logp = [], []
    for _ in range(steps):
        tok = logits.argmax(-1, keepdim=True)  # (1, 1)
        tokens.append(int(tok))
        logp.append(float(logits.log_softmax(-1)[0, tokens[-1]]))
        logits = step(tok)[:, -1]
    return tokens, logp


def generation(cal: dict, module=None, stats: Path | None = None, load=None, prompt: torch.Tensor | None = None,
               budget: int = GEN_BUDGET, steps: int = STEPS, per_head: bool = False) -> dict:
    """Greedy tokens and log-probabilities: ours, the full cache's (and the reference's, with ``module``). ``load``
    -> (a fresh model, its folder) (default: the committed tiny model), ``prompt`` (1, P) (default: the first
    :data:`GEN_PROMPT` golden ids)."""
    from transformers import DynamicCache

    from h2o import attach, make_policy
    from h2o.parity.golden import MODEL_DIR, load_model

    load = load or (lambda: (load_model(), MODEL_DIR))
    prompt = golden_ids()[:, :GEN_PROMPT] if prompt is None else prompt
    model, folder = load()
    policy = make_policy("triattention", budget=budget, stats=cal, compress="buffer", interval=EVERY,
                         per_head_pruning=per_head, **OPTIONS)
    out = {}
    with torch.no_grad():
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            out["ours"] = greedy(lambda ids: model(ids, cache=cache).logits, prompt, steps)
        full = DynamicCache()
        out["full"] = greedy(lambda ids: model(ids, past_key_values=full, use_cache=True).logits, prompt, steps)
        if module is not None:
            ref_model, _ = load()
            module.apply_triattention_patch(
                ref_model, stats_path=stats, model_path=folder, kv_budget=budget, pruning_seed=None,
                offset_max_length=OPTIONS["offset_max_length"], normalize_scores=OPTIONS["normalize_scores"],
                count_prompt_tokens=True, divide_length=EVERY, use_slack_trigger=True,
                per_layer_perhead_pruning=not per_head, per_head_pruning=per_head,
                layer_perhead_aggregation=OPTIONS["head_aggregation"])
            held = {"cache": DynamicCache()}

            def step(ids):
                o = ref_model(input_ids=ids, past_key_values=held["cache"], use_cache=True)
                held["cache"] = o.past_key_values  # its wrapper hands back a new cache after a cut
                return o.logits

            out["reference"] = greedy(step, prompt, steps)
    return out


def smollm2_generation(module, tmp: Path, per_head: bool = False) -> dict:
    """:func:`generation` on SmolLM2-135M (its cached checkpoint, fp32, eager attention; its calibration from the
    cache: ``python -m h2o.assets.triattention model=smollm2-135m``): :data:`SMOL` after 64 tokens of Austen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from h2o.assets.fetch import austen_text
    from h2o.assets.model_spec import resolve_pretrained
    from h2o.assets.triattention import require

    folder = Path(resolve_pretrained("smollm2-135m"))
    stats = require("smollm2-135m")
    cal = torch.load(stats, map_location="cpu", weights_only=True)
    text = austen_text()[SMOL["offset"]:SMOL["offset"] + 4000]
    prompt = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt").input_ids[:, :SMOL["prompt"]]

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval(), \
            folder

    gen = generation(cal, module, reference_stats(cal, tmp / "smollm2.pt"), load, prompt, SMOL["budget"],
                     SMOL["steps"], per_head)
    return {**summarize(gen, SMOL["steps"]), **SMOL, "calibration": cal["digest"][:12]}


def summarize(gen: dict, steps: int) -> dict:
    ours, ref, full = gen["ours"], gen["reference"], gen["full"]
    return {"steps": steps, "tokens_equal": sum(a == b for a, b in zip(ours[0], ref[0])),
            "largest_logprob_gap": float(f"{max(abs(a - b) for a, b in zip(ours[1], ref[1])):.2e}"),
            "tokens_unlike_full": sum(a != b for a, b in zip(ref[0], full[0]))}


def compare(first: dict, later: list[dict], gen: dict | None = None) -> dict:
    gap, scale, differ, heads = 0.0, 0.0, 0, 0
    for row in first.values():
        for a, b in zip(row["ours_score"], row["reference_score"]):
            a, b = torch.tensor(a), torch.tensor(b)
            gap, scale = max(gap, float((a - b).abs().max())), max(scale, float(b.abs().max()))
        for a, b in zip(row["ours_kept"], row["reference_kept"]):
            differ += sum(x != y for x, y in zip(a, b))
            heads += len(a)
    later = later or []
    later_heads = sum(len(h) for r in later for h in r["ours"])
    later_differ = sum(x != y for r in later for a, b in zip(r["ours"], r["reference"]) for x, y in zip(a, b))
    out = {"first_cut": {"largest_score_gap": float(f"{gap:.2e}"), "largest_score": round(scale, 3),
                         "heads_kept_differently": differ, "heads": heads},
           "later_cuts": {"cuts": len(later), "heads": later_heads, "heads_kept_differently": later_differ}}
    if gen is not None:
        out["generation"] = summarize(gen, STEPS)
    return out


def golden_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(SEED))


def main(argv=None) -> int:
    from h2o.parity.golden import load_model
    from h2o.parity.script import arguments, commit, report

    a = arguments("h2o.parity.triattention", __doc__, "a checkout of WeianMao/triattention", RECORD, argv, after=[
        ("--smollm2", {"action": "store_true", "help": "also the generation on SmolLM2-135M (cached, calibrated)"}),
        ("--per-head-pruning", {"action": "store_true", "help": f"the reference's per_head_pruning ({HEAD_RECORD})"}),
        ("--commit", {"default": None, "help": "the reference's commit where DIR is an export, not a checkout"})])
    root, per_head = Path(a.reference), a.per_head_pruning
    module = load_reference(root)
    reference = {"repo": "WeianMao/triattention", "commit": commit(root, a.commit),
                 "files": ["triattention/methods/triattention.py", "triattention/methods/pruning_utils.py"]}
    model = load_model()
    cal, states = calibration(model), record_states(model, golden_ids())
    with tempfile.TemporaryDirectory() as tmp:
        stats = reference_stats(cal, Path(tmp) / "stats.pt")
        first = first_cuts(cal, states, module, stats, per_head)
        later = later_cuts(cal, states, BUDGETS[0], module, stats, per_head)
        gen = generation(cal, module, stats, per_head=per_head)
        summary = compare(first, later, gen)
        if not per_head:  # the calibration does not depend on the mode: checked once
            ref_cal = reference_calibration(root, Path(tmp))
            summary["calibration"] = calibration_gaps(ours_in_bf16(), ref_cal)
        if a.smollm2:
            summary["generation_smollm2"] = smollm2_generation(module, Path(tmp), per_head)
    kept = {"first_cut": {b: {"kept": r["reference_kept"]} | ({} if per_head else {"score": [
        [[float(f"{x:.8g}") for x in h] for h in s] for s in r["reference_score"]]}) for b, r in first.items()},
            "later_cuts": [{"now": r["now"], "kept": r["reference"]} for r in later],
            "generation": {"prompt": GEN_PROMPT, "budget": GEN_BUDGET, "tokens": gen["reference"][0],
                           "logprob": [float(f"{x:.8g}") for x in gen["reference"][1]]}}
    head = {"per_head_pruning": True} if per_head else {}
    own = {} if per_head else {"calibration": {k: [[[float(f"{x:.8g}") for x in h] for h in layer]
                                                   for layer in v.tolist()] for k, v in ref_cal.items()}}
    name = "h2o.parity.triattention" + (" --per-head-pruning" if per_head else "")
    return report(a, name, HEAD_RECORD if per_head else RECORD, summary, reference, {
        "ids": golden_ids()[0].tolist(), "options": OPTIONS, **head, "budgets": list(BUDGETS), "prompt": PROMPT,
        "every": EVERY, "summary": summary, **kept, **own})

if __name__ == "__main__":
    sys.exit(main())
