"""The field's implementations of one method: TriAttention's own baselines (WeianMao/triattention,
``triattention/methods/baselines/``: ``H2O``, ``R1KV``, ``SnapKV``) beside this harness's ``h2o``, ``r_kv`` and
``snapkv`` (each shown equal to its own reference: the paper's H2O, Zefan-Cai/R-KV, kvpress 0.5.5), on the same
recorded states.

``python -m h2o.parity.baselines --reference DIR`` (DIR: a checkout of WeianMao/triattention; its baselines are
imported from there, never copied; they need torch only). TriAttention removed ``h2o.py`` in 7b0e693a ("remove H2O
and StreamingLLM baseline"); restore it from the commit before for this comparison:
``git -C DIR show 7b0e693a^:triattention/methods/baselines/h2o.py > DIR/triattention/methods/baselines/h2o.py``
(without it the H2O rows are left out, with a note).

1. **States**: the committed tiny model of the golden numbers (tests/data/parity_golden/model, 3 layers, 4 query
   heads on 2 KV heads) reads :data:`PROMPT` random ids; each layer's queries and keys after RoPE are recorded.
2. **The prompt's cut**, per method, budget (:data:`BUDGETS`) and layer: the reference's ``update_kv(keys, the
   last window queries, positions as values)`` (its integration's query cache holds the last ``window_size``
   queries at a prompt's end) against ours through the evicting cache at ``compress=prefill``: the kept positions
   per KV head, their overlap (the share of the budget both keep).
3. **NLL**: the prompt prefilled with transformers' eager attention, each layer's cache replaced by the reference's
   ``update_kv`` of it (what its attention forward stores after the prompt's rows attended in full), then
   :data:`CONT` random ids teacher-forced one at a time at their positions (the reference's own schedule cuts again
   only once the cache reaches ``budget + divide_length`` (128), past these tokens); ours: the same through the
   evicting cache at ``compress=prefill``. NLL per token of the continuation, full cache beside.

4. With ``--fork DIR`` (a checkout of minghui-liu/kvpress) its ``H2OPress`` too, over the long generation of
   :mod:`h2o.parity.snapkv_d` (its hook after every forward, the decoding cut at interval 1): as shipped and with a
   copy of the press on each layer (:func:`fork_h2o`).

``--golden`` writes tests/data/parity_golden/baselines.json (the references' kept positions and NLL per token; the
fork's H2O's dropped positions per cut and NLL), which tests/test_baselines.py compares ours with in CI; the summary
is printed.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

from h2o.parity.pairs import BASELINES_RECORD as RECORD

PROMPT, CONT, VOCAB, SEED = 160, 32, 256, 17  # random prompt ids in [3, VOCAB), then CONT teacher-forced ones
BUDGETS = (32, 64)
WINDOW = 8  # the references' window_size (their query cache's length)
H2O_REMOVED = "7b0e693a"  # the triattention commit that removed baselines/h2o.py (restore it from its parent)
# reference -> (its class, its options beyond the budget, ours: [(label, policy, options)])
PAIRS = {
    "H2O": ("H2O", {"window_size": WINDOW}, [("h2o", "h2o", {}), ("tova", "tova", {})]),
    "R1KV": ("R1KV", {}, [("r_kv", "r_kv", {}), ("r_kv mix_lambda=0.1", "r_kv", {"mix_lambda": 0.1})]),
    "SnapKV": ("SnapKV", {}, [("snapkv window=8 kernel=7", "snapkv", {"window": 8, "kernel": 7})]),
}


# ----------------------------------------------------------------------------------------------- reference
def load_reference(root: Path) -> dict:
    """The baselines' classes from ``root``/triattention/methods/baselines (utils, r1_kv, snapkv, and h2o where
    restored), loaded as a package of their own (its ``__init__`` is not run) -> {class name: class}."""
    folder = root / "triattention" / "methods" / "baselines"
    need = [folder / f for f in ("utils.py", "r1_kv.py", "snapkv.py")]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise SystemExit(f"--reference={root}: no {', '.join(missing)}; allowed: a checkout of WeianMao/triattention")
    package = types.ModuleType("triattention_reference")
    package.__path__ = [str(folder)]
    sys.modules[package.__name__] = package
    out = {}
    for stem, name in (("utils", None), ("r1_kv", "R1KV"), ("snapkv", "SnapKV"), ("h2o", "H2O")):
        if not (folder / f"{stem}.py").is_file():
            continue
        spec = importlib.util.spec_from_file_location(f"{package.__name__}.{stem}", folder / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        if name:
            out[name] = getattr(module, name)
    return out


def shipped_error(classes: dict, state: dict, budget: int) -> str | None:
    """The one-line error TriAttention's H2O raises on a recorded prompt (None: it runs). It squeezes the query-row
    axis of ``compute_attention_scores`` and then averages over ``dim=-2``, which is then the KV heads: its indices
    have no head axis and its ``expand`` to the head size fails, for every input (the file was first committed in
    TriAttention as a copy under R-KV/rkv/compression/)."""
    try:
        reference_kept(classes["H2O"], PAIRS["H2O"][1], budget, state)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def reference_cut(cls, options: dict, budget: int, keys, queries, values):
    """keys, values (1, Hkv, S, D|...), queries (1, Hq, T, D) of the prompt -> the reference's (keys, values) after
    its ``update_kv`` with the last :data:`WINDOW` queries."""
    with torch.no_grad():
        return cls(budget=budget, **options).update_kv(keys, queries[:, :, -WINDOW:], values)


def reference_kept(cls, options: dict, budget: int, state: dict) -> list[list[int]]:
    """Per KV head, the positions the reference keeps of the recorded prompt ``state``."""
    keys = state["keys"]
    pos = torch.arange(keys.shape[2]).view(1, 1, -1, 1).expand_as(keys).to(keys.dtype)  # the positions as values
    _, kept = reference_cut(cls, options, budget, keys, state["queries"], pos.contiguous())
    return [sorted(int(p) for p in h) for h in kept[0, :, :, 0].round()]


def reference_nll(model, cls, options: dict, budget: int, prompt, cont, states: list[dict]) -> float:
    """NLL per token of ``cont`` (1, m) after ``prompt`` (1, P), each layer's cache cut by the reference."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = [model(prompt, cache=cache, use_cache=True).logits[0, -1]]
            for i, stored in enumerate(cache.layers):  # transformers' DynamicLayer: the reference's cut replaces it
                stored.keys, stored.values = reference_cut(cls, options, budget, stored.keys, states[i]["queries"],
                                                           stored.values)
            P = prompt.shape[1]
            for t in range(cont.shape[1] - 1):
                logits.append(model(cont[:, t:t + 1], cache=cache, position_ids=torch.tensor([[P + t]]),
                                    use_cache=True).logits[0, -1])
    finally:
        model.set_attn_implementation(before)
    return per_token(torch.stack(logits), cont[0])


def per_token(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return -float(torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None]).mean())


# ----------------------------------------------------------------------------------------------- ours
def ours(model, name: str, options: dict, budget: int, prompt, cont) -> tuple[list, float]:
    """(per layer, each KV head's kept positions at the prompt's cut; NLL per token of ``cont``) through the
    evicting cache at ``compress=prefill``."""
    from h2o import attach, make_policy
    from h2o.parity.sides import nll_sum

    policy = make_policy(name, budget=budget, compress="prefill", **options)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        logits = [model(prompt, cache=cache, use_cache=True).logits[0, -1]]
        kept = [[sorted(p for p in head.tolist() if p >= 0) for head in pos[0]] for pos in cache.positions()]
        logits += [model(cont[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
                   for t in range(cont.shape[1] - 1)]
    return kept, nll_sum(torch.stack(logits), cont[0])[0] / cont.shape[1]


def full_nll(model, prompt, cont) -> float:
    with torch.no_grad():
        logits = model(torch.cat([prompt, cont], 1)).logits[0, prompt.shape[1] - 1:-1]
    return per_token(logits, cont[0])


# ----------------------------------------------------------------------------------------------- compare
def ids() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(3, VOCAB, (1, PROMPT + CONT), generator=torch.Generator().manual_seed(SEED))
    return x[:, :PROMPT], x[:, PROMPT:]


def overlap(a: list[list[list[int]]], b: list[list[list[int]]]) -> list[float]:
    """Per layer: the share of the kept positions both keep, averaged over the KV heads."""
    return [round(sum(len(set(x) & set(y)) / max(len(x), 1) for x, y in zip(la, lb)) / len(la), 4)
            for la, lb in zip(a, b)]


def compare(model, classes: dict) -> dict:
    from h2o.parity.r_kv import record_states

    prompt, cont = ids()
    states = record_states(model, prompt)
    out = {"full_nll": round(full_nll(model, prompt, cont), 6), "references": {}, "rows": []}
    if "H2O" in classes:
        out["h2o_error"] = shipped_error(classes, states[0], BUDGETS[0])
    for ref, (cls_name, options, sides) in PAIRS.items():
        cls = classes.get(cls_name)
        if cls is None or (cls_name == "H2O" and out.get("h2o_error")):
            continue
        for budget in BUDGETS:
            kept = [reference_kept(cls, options, budget, s) for s in states]
            nll = reference_nll(model, cls, options, budget, prompt, cont, states)
            out["references"][f"{ref}/{budget}"] = {"kept": kept, "nll": round(nll, 7)}
            for label, name, opts in sides:
                ours_kept, ours_nll = ours(model, name, opts, budget, prompt, cont)
                out["rows"].append({"reference": ref, "budget": budget, "ours": label, "policy": name,
                                    "options": opts, "overlap": overlap(kept, ours_kept),
                                    "heads_equal": sum(x == y for la, lb in zip(kept, ours_kept)
                                                       for x, y in zip(la, lb)),
                                    "heads": sum(len(la) for la in kept),
                                    "reference_nll": round(nll, 6), "ours_nll": round(ours_nll, 6)})
    return out


# the minghui-liu/kvpress fork's H2OPress (--fork DIR) beside ours, over the long generation of h2o.parity.snapkv_d
FORK_BUDGETS = (48, 96)
FORK_OURS = [("h2_only score=mean", "h2_only", {"score": "mean"}), ("h2o", "h2o", {})]  # at interval 1, the fork's


def fork_h2o(model, H2OPress) -> tuple[list[dict], dict]:
    """The fork's ``H2OPress`` (its hook after every forward: the prompt's and each decoding row's attention added,
    each token's mean over the rows that saw it, ``topk(cache_budget)``) beside ours at ``compress=interval``
    ``interval=1``, teacher-forced on the greedy tokens of ``h2_only score=mean``: kept positions per cut, layer and
    KV head, NLL per token; then each one's own greedy tokens. The fork as shipped (one press object hooked on
    every layer, its accumulated scores one attribute: each layer reads the previous layer's) and with a copy of
    the press on each layer."""
    from h2o import make_policy
    from h2o.parity import snapkv_d as d

    prompt, out, record = d.prompt_ids(), [], {}
    for budget in FORK_BUDGETS:
        press = H2OPress()
        press.cache_budget = budget
        first = make_policy("h2_only", budget=budget, score="mean", compress="interval", interval=1)
        forced = torch.tensor(d.ours_run(model, "defaults", prompt, policy=first)["tokens"])
        for fork_label, per_layer in (("as shipped", False), ("one press per layer", True)):
            fork = d.fork_run(model, press, prompt, forced, ordered=False, per_layer=per_layer)
            free = d.fork_run(model, press, prompt, ordered=False, per_layer=per_layer)
            record[f"{budget}/{fork_label}"] = {"prompt_cut": fork["held"][0], "dropped": d.dropped(fork["held"]),
                                                "nll": [float(f"{x:.9g}") for x in fork["nll"]],
                                                "greedy": free["tokens"]}
            for label, name, options in FORK_OURS:
                policy = make_policy(name, budget=budget, compress="interval", interval=1, **options)
                ours_forced = d.ours_run(model, "defaults", prompt, forced, policy=policy)
                ours_free = d.ours_run(model, "defaults", prompt, policy=policy)
                out.append({"budget": budget, "fork": fork_label, "ours": label,
                            "entries": sum(len(h) for s in fork["held"] for h in s),
                            "kept_differently": d.differ(ours_forced["held"], fork["held"]),
                            "largest_nll_gap": d.max_gap(ours_forced["nll"], fork["nll"]),
                            "fork_nll": d.mean(fork["nll"]), "ours_nll": d.mean(ours_forced["nll"]),
                            "greedy_equal_before_a_difference": d.agree(ours_free["tokens"], free["tokens"]),
                            "greedy": d.NEW})
    return out, {"forced": "the greedy tokens of h2_only score=mean at interval 1", **record}


def main(argv=None) -> int:
    from h2o.parity.golden import load_model
    from h2o.parity.script import arguments, commit, report

    a = arguments("h2o.parity.baselines", __doc__, "a checkout of WeianMao/triattention", RECORD, argv, before=[
        ("--fork", {"help": "a checkout of minghui-liu/kvpress: its H2OPress beside ours as well"})])
    root = Path(a.reference)
    classes = load_reference(root)
    if a.fork:
        from h2o.parity.snapkv_d import load_reference as load_fork

        _, H2OPress = load_fork(Path(a.fork))
    if "H2O" not in classes:
        print(f"no baselines/h2o.py: restore it from {H2O_REMOVED}^ (see --help); its rows are left out",
              file=sys.stderr)
    reference = {"repo": "WeianMao/triattention", "commit": commit(root),
                 "files": ["triattention/methods/baselines/" + f for f in ("utils.py", "r1_kv.py", "snapkv.py")],
                 "h2o": f"triattention/methods/baselines/h2o.py at {H2O_REMOVED}^"}
    model = load_model()
    result = compare(model, classes)
    if a.fork:
        result["fork_h2o"], result["fork_h2o_record"] = fork_h2o(model, H2OPress)
        result["fork_commit"] = commit(a.fork)
    return report(a, "h2o.parity.baselines", RECORD, result["rows"] + result.get("fork_h2o", []), reference, {
        "prompt": PROMPT, "cont": CONT, "seed": SEED, "budgets": list(BUDGETS), "window": WINDOW, **result})


if __name__ == "__main__":
    sys.exit(main())
