"""Parity of ``r_kv`` with R-KV's reference scoring (Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py``'s
``R1KV.update_kv`` and ``rkv/utils.py``), run side by side on recorded states.

``python -m h2o.parity.r_kv --reference DIR`` (DIR: a checkout of Zefan-Cai/R-KV, its ``rkv/`` folder inside; the
reference is imported from there, never copied into this repository; it needs torch only):

1. **States**: the committed tiny model of the golden numbers (tests/data/parity_golden/model, a random Llama of 3
   layers, 4 query heads on 2 KV heads) reads :data:`LENGTH` token ids drawn from a small vocabulary (repeated
   tokens make similar keys, so the redundancy term's threshold is crossed); each layer's queries and keys after
   RoPE are recorded (:func:`record_states`).
2. **The first cut** (the cache in position order, as at a prompt's end), per layer and budget: the reference's
   ``R1KV(budget=n).update_kv(keys, last w queries, values)`` with the positions as values (what it keeps), its
   score the input of its ``topk`` (caught by a torch function mode, not recomputed); ours: the rule's hooks on the
   same queries and keys (:func:`ours_first_cut`). Then the largest |score difference| and the kept sets.
3. **Later cuts** (the decoding buffer): the same states cut at the prompt's end (``PROMPT`` tokens) and then every
   ``EVERY`` tokens, each side keeping its own cache. The reference keeps its cache in the order its ``topk``
   returned (score order), which its max-pool and its "newest similar key" then read as neighbours; ours keeps
   positions. Counted both as it runs and with its cache re-sorted by position before each cut (then equal).

``--golden`` writes tests/data/parity_golden/r_kv.json (what CI compares ours with: tests/test_r_kv_parity.py);
the summary is printed. Outside CI: CI has no reference checkout.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

from h2o.parity.pairs import RKV_RECORD as RECORD
LENGTH, VOCAB, SEED = 96, 40, 5  # the recorded sequence: ids in [3, VOCAB)
BUDGETS = (24, 48, 72)
PROMPT, EVERY = 40, 16  # the later cuts: the prompt's, then every EVERY tokens
OPTIONS = {"window": 8, "kernel": 7, "mix_lambda": 0.07, "threshold": 0.5}  # R1KV's defaults (threshold: its
# cal_similarity's)


# ----------------------------------------------------------------------------------------------- reference
def load_reference(root: Path):
    """R1KV from ``root``/rkv (a checkout of Zefan-Cai/R-KV), its two files loaded as a package of their own (its
    package ``__init__`` imports its transformers patches, which the scoring does not need)."""
    files = {"utils": root / "rkv" / "utils.py", "r1_kv": root / "rkv" / "compression" / "r1_kv.py"}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"--reference={root}: no {', '.join(missing)}; allowed: a checkout of Zefan-Cai/R-KV")
    utils = load("rkv_reference.utils", files["utils"])
    package = types.ModuleType("rkv_reference.compression")
    package.__path__ = [str(files["r1_kv"].parent)]
    package.cal_similarity, package.compute_attention_scores = utils.cal_similarity, utils.compute_attention_scores
    sys.modules["rkv_reference"] = types.ModuleType("rkv_reference")
    sys.modules[package.__name__] = package
    return load("rkv_reference.compression.r1_kv", files["r1_kv"]).R1KV


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class CatchTopk(torch.overrides.TorchFunctionMode):
    """Records the tensor each ``topk`` is called on (R1KV's final score)."""

    def __init__(self):
        super().__init__()
        self.inputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.topk, torch.topk):
            self.inputs.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


def reference_cut(R1KV, keys, queries, pos, budget: int) -> tuple[list[list[int]], torch.Tensor | None]:
    """keys (1, Hkv, S, D) in the reference's cache order, pos (1, Hkv, S) their positions, queries (1, Hq, w, D)
    -> (each KV head's kept positions, in its cache order; its score (Hkv, S - w), None: nothing cut)."""
    cluster = R1KV(budget=budget, window_size=OPTIONS["window"], kernel_size=OPTIONS["kernel"],
                   mix_lambda=OPTIONS["mix_lambda"])
    values = pos[..., None].to(keys.dtype).expand_as(keys).contiguous()  # the positions ride along as values
    with CatchTopk() as catch:
        _, kept = cluster.update_kv(keys, queries, values)
    return kept[0, :, :, 0].round().long().tolist(), catch.inputs[0][0] if catch.inputs else None


# ----------------------------------------------------------------------------------------------- states
def golden_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(SEED))


def record_states(model, ids: torch.Tensor) -> list[dict]:
    """Each layer's queries (1, Hq, T, D) and keys (1, Hkv, T, D) after RoPE and its scaling, from one eager
    forward of ``ids`` (1, T)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    states = {}

    def recording(module, query, key, value, attention_mask, scaling, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        states[module.layer_idx] = {"queries": query.detach().clone(), "keys": key.detach().clone(),
                                    "scaling": float(scaling)}
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("parity_record", recording)
    AttentionMaskInterface.register("parity_record", eager_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation("parity_record")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(before)
    return [states[i] for i in sorted(states)]


# ----------------------------------------------------------------------------------------------- ours
def ours_cut(state: dict, held_pos: torch.Tensor, now: int, budget: int) -> tuple[list[list[int]], torch.Tensor]:
    """Our rule's cut over the held positions ``held_pos`` (Hkv, n) (each head's, any order) of the recorded
    ``state``, the newest rows those up to ``now`` -> (each KV head's kept positions, ascending; the priority
    (Hkv, n) in ``held_pos``'s order)."""
    from h2o.core.policies import make_policy

    policy = make_policy("r_kv", budget=budget, **OPTIONS)
    w = policy.window
    keys_all, queries = state["keys"][0], state["queries"][0]  # (Hkv, T, D), (Hq, T, D)
    Hkv, n = held_pos.shape
    keys = keys_all.gather(1, held_pos[..., None].expand(Hkv, n, keys_all.shape[-1]))  # (Hkv, n, D)
    rows = queries[:, now + 1 - w:now + 1].view(Hkv, -1, w, queries.shape[-1])  # (Hkv, G, w, D)
    logits = rows @ keys[:, None].transpose(-1, -2) * state["scaling"]  # (Hkv, G, w, n)
    acc = policy.new_state(1, Hkv, n, keys.device)
    policy.accumulate_prompt(acc, logits[None], None, None)
    pos = held_pos[None]  # (1, Hkv, n)
    counts = policy.counts(torch.tensor([now + 1]))
    prio = policy.priority(pos, policy.cut_score(acc, keys[None], pos >= 0), torch.tensor([now]), counts)
    keep = policy.keep(prio, pos, pos >= 0, counts)[0]  # (Hkv, n)
    return [sorted(held_pos[h][keep[h]].tolist()) for h in range(Hkv)], prio[0]


def first_cuts(states: list[dict], R1KV=None) -> dict:
    """Per layer and budget, the whole sequence cut once: ours (and the reference's, with ``R1KV``)."""
    out = {}
    T = states[0]["keys"].shape[2]
    w = OPTIONS["window"]
    for layer, state in enumerate(states):
        Hkv = state["keys"].shape[1]
        held = torch.arange(T).expand(Hkv, T)
        for budget in BUDGETS:
            kept, prio = ours_cut(state, held, T - 1, budget)
            row = {"ours_kept": kept, "ours_score": prio[:, :T - w].tolist()}
            if R1KV is not None:
                ref, score = reference_cut(R1KV, state["keys"], state["queries"][:, :, -w:], held[None], budget)
                row |= {"reference_kept": [sorted(h) for h in ref], "reference_score": score.tolist()}
            out[f"{layer}/{budget}"] = row
    return out


def later_cuts(states: list[dict], budget: int, R1KV=None, resort: bool = False) -> list[dict]:
    """The prompt's cut, then one every :data:`EVERY` tokens, per layer; each cut's kept positions per head (the
    reference's in its own cache order, or re-sorted by position before each cut with ``resort``)."""
    T, w = states[0]["keys"].shape[2], OPTIONS["window"]
    cuts = list(range(PROMPT - 1, T, EVERY))
    out = []
    for layer, state in enumerate(states):
        Hkv = state["keys"].shape[1]
        ours = reference = torch.arange(PROMPT).expand(Hkv, PROMPT)  # (Hkv, n) held positions
        for c, now in enumerate(cuts):
            if c:
                new = torch.arange(cuts[c - 1] + 1, now + 1).expand(Hkv, -1)
                ours, reference = torch.cat([ours, new], 1), torch.cat([reference, new], 1)
            kept, _ = ours_cut(state, ours, now, budget)
            ours = torch.tensor(kept)
            row = {"layer": layer, "now": now, "ours": kept}
            if R1KV is not None:
                if resort:
                    reference = reference.sort(-1).values
                keys = state["keys"].gather(2, reference[None, ..., None].expand(1, Hkv, -1, state["keys"].shape[-1]))
                ref, _ = reference_cut(R1KV, keys, state["queries"][:, :, now + 1 - w:now + 1], reference[None],
                                       budget)
                reference = torch.tensor(ref)
                row["reference"] = [sorted(h) for h in ref]
            out.append(row)
    return out


# ----------------------------------------------------------------------------------------------- summary, CLI
def compare(first: dict, later: list[dict], resorted: list[dict]) -> dict:
    """The largest |score difference| and the kept sets that differ, at the first cut and at the later ones."""
    gap, differ = 0.0, 0
    for row in first.values():
        ours, ref = torch.tensor(row["ours_score"]), torch.tensor(row["reference_score"])
        gap = max(gap, float((ours - ref).abs().max()))
        differ += sum(a != b for a, b in zip(row["ours_kept"], row["reference_kept"]))
    heads = sum(len(r["ours"]) for r in later)
    return {"first_cut": {"largest_score_gap": float(f"{gap:.2e}"), "heads_kept_differently": differ,
                          "heads": sum(len(r["ours_kept"]) for r in first.values())},
            "later_cuts": {"heads": heads, "kept_differently_in_its_order": sum(
                a != b for r in later for a, b in zip(r["ours"], r["reference"])),
                "kept_differently_resorted": sum(a != b for r in resorted for a, b in zip(r["ours"], r["reference"]))}}


def similar_rows(states: list[dict], threshold: float) -> float:
    """The share of (layer, head, token) rows with another key more similar than ``threshold`` (so the redundancy's
    "newest similar key" is exercised, not only its fallback)."""
    hits = total = 0
    for s in states:
        unit = s["keys"][0] / (s["keys"][0].norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.transpose(-1, -2)
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        hits += int((sim > threshold).any(-1).sum())
        total += sim.shape[0] * sim.shape[1]
    return hits / total


def golden_first(first: dict) -> dict:
    """The reference's first cuts per layer: its score (the same at every budget, 8 digits) and each budget's
    kept positions per head."""
    out = {}
    for key, row in first.items():
        layer, budget = key.split("/")
        at = out.setdefault(layer, {"score": [[float(f"{x:.8g}") for x in h] for h in row["reference_score"]],
                                    "kept": {}})
        at["kept"][budget] = row["reference_kept"]
    return out


def main(argv=None) -> int:
    from h2o.parity.golden import load_model
    from h2o.parity.script import arguments, commit, report

    a = arguments("h2o.parity.r_kv", __doc__, "a checkout of Zefan-Cai/R-KV (its rkv/ folder inside)", RECORD, argv)
    root = Path(a.reference)
    R1KV = load_reference(root)
    reference = {"repo": "Zefan-Cai/R-KV", "commit": commit(root),
                 "files": ["rkv/compression/r1_kv.py", "rkv/utils.py"]}
    states = record_states(load_model(), golden_ids())
    first = first_cuts(states, R1KV)
    later = later_cuts(states, BUDGETS[0], R1KV)
    resorted = later_cuts(states, BUDGETS[0], R1KV, resort=True)
    summary = {**compare(first, later, resorted), "similar_rows": round(similar_rows(states, OPTIONS["threshold"]), 3)}
    return report(a, "h2o.parity.r_kv", RECORD, summary, reference, {
        "ids": golden_ids()[0].tolist(), "options": OPTIONS, "budgets": list(BUDGETS), "prompt": PROMPT, "every": EVERY,
        "summary": summary, "first_cut": golden_first(first),
        "later_cuts_resorted": [{"layer": r["layer"], "now": r["now"], "kept": r["reference"]} for r in resorted]})


if __name__ == "__main__":
    sys.exit(main())
