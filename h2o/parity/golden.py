"""Golden numbers for CI: kvpress 0.5.5's figures on a tiny committed model, so parity cannot drift silently.

``python -m h2o.parity --golden`` (``make parity PARITY_ARGS=--golden``) records them once, outside CI:

1. the model: a random ``llama_gqa`` (:func:`h2o.assets.models.tiny_config`: 3 layers, 4 query heads on 2 KV heads,
   head size 16, RoPE) from a fixed seed, saved to ``tests/data/parity_golden/model/`` (safetensors, fp32) the
   first time and committed, so both virtualenvs load the identical weights (two transformers versions need not
   initialise alike); its sha256 goes into the record;
2. the prompts: :data:`CONTEXTS` contexts of :data:`CONTEXT_LEN` random token ids, each continued by
   :data:`CONT_LEN` more;
3. kvpress's side (tools/parity/kvpress_side.py in the parity virtualenv) for every case of :func:`cases`: each
   kvpress method at its defaults, and variants with smaller windows, where a tiny context makes the defaults
   degenerate (PyramidKV's pyramid needs ``L (1 - r) >= beta * window``);
4. ``tests/data/parity_golden/kvpress.json``: the prompts, the cases and kvpress's summed NLL of each continuation
   teacher-forced through its compressed cache, per (case, ratio, prompt).

tests/test_parity_golden.py runs our side (:func:`ours_nll`) on the same weights and prompts and asserts each
built method's NLL per token within :data:`TOLERANCE` of kvpress's.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from h2o.parity.pairs import GOLDEN, OURS, RECORD, TOLERANCE
from h2o.store.env import cpu_name

MODEL_DIR = GOLDEN / "model"
SEED = 11  # of the model's weights and of the prompts
LAYERS = 3
CONTEXTS, CONTEXT_LEN, CONT_LEN = 2, 256, 24
RATIOS = (0.5, 0.8)  # kvpress's compression_ratio: 128 and 51 of 256 tokens kept


@dataclass(frozen=True)
class Case:
    """One golden row: kvpress's ``press`` (a name of tools/parity/kvpress_side.py) with ``press_options``, in
    ``timing``; ours: ``ours`` (policy, options), or None: :data:`h2o.parity.pairs.OURS` of ``press``
    (None there: not built yet). ``statistical``: the two sides cannot hold the same tokens (kvpress's random
    draws come from torch's generator, ours from a hash), so the figure is kept but not compared."""

    press: str
    press_options: dict = field(default_factory=dict)
    ours: tuple | None = None
    timing: str = "prefill"
    statistical: bool = False
    differs: str = ""  # why kvpress's press does not hold our tokens by design (then the gap must be large)

    def policy(self) -> tuple[str, dict] | None:
        return self.ours if self.ours is not None else OURS.get(self.press)


def cases() -> dict[str, Case]:
    """Every kvpress method of the parity table at its defaults, variants that make the defaults' edge cases
    ordinary at 256 tokens, and the decoding timing where ours has one."""
    out = {m: Case(m, statistical=m == "random") for m in OURS if m not in ("full", "streaming_llm_ordered")}
    out["snapkv_w16_k3"] = Case("snapkv", {"window_size": 16, "kernel_size": 3}, ("snapkv", {"window": 16,
                                                                                            "kernel": 3}))
    # a real pyramid: lo = L (1 - r) / beta >= window at both ratios (51.2 / 4 >= 8)
    out["pyramidkv_w8_b4"] = Case("pyramidkv", {"window_size": 8, "beta": 4}, ("pyramidkv", {"window": 8, "beta": 4}))
    # kvpress's DecodingPress re-scoring every step, with the kept keys in position order (its published order
    # re-reads slots as positions: docs/methods.md, "A finding")
    out["streaming_llm_ordered"] = Case("streaming_llm_ordered", timing="decode")
    # DecodingPress at interval 1 after a prefilling press (tools/parity/kvpress_side.py, run_decode)
    # KVzip's replay in several chunks (each later chunk's prompt ends with the previous chunk's last tokens), and
    # its per-layer count
    out["kvzip_c64"] = Case("kvzip", {"chunk_size": 64}, ("kvzip", {"chunk_size": 64}))
    out["kvzip_layerwise_c100"] = Case("kvzip", {"chunk_size": 100, "layerwise": True},
                                       ("kvzip", {"chunk_size": 100, "layerwise": True}))
    out["knorm_decode"] = Case("knorm", timing="decode")
    out["keydiff_decode"] = Case("keydiff", timing="decode")
    # DecodingPress(compression_interval=INTERVAL, target_size=n) after a prefilling press to n (kvpress_side.py,
    # run_interval) beside ours at compress=interval; snapkv with a window below the interval (kvpress asserts it)
    for press, options, ours in INTERVAL_CASES:
        out[f"{press}_interval"] = Case(press, options, (ours[0], {**ours[1], "interval": INTERVAL}), "interval",
                                        statistical=press == "random", differs=INTERVAL_DIFFERS.get(press, ""))
    return out


INTERVAL = 8  # DecodingPress's compression_interval of the interval cases: cuts after the 8th and 16th tokens
SNAP = ({"window_size": 4, "kernel_size": 3}, ("snapkv", {"window": 4, "kernel": 3}))  # a window below INTERVAL
INTERVAL_CASES = [(p, {}, OURS[p]) for p in ("knorm", "keydiff", "streaming_llm", "streaming_llm_ordered", "tova",
                                            "random")] + [("snapkv", *SNAP), ("snapkv_ordered", *SNAP)]
INTERVAL_DIFFERS = {  # docs/methods.md, "A finding"; docs/r_kv.md, "snapkv at decoding"
    "streaming_llm": "kvpress re-scores a cache gathered in top-k order: its positions are slots",
    "snapkv": "kvpress rotates every window query by the current step's position and pools along top-k order",
}


def golden_prompts() -> dict:
    """Token ids in [3, 256) (0-2: pad, BOS, EOS), in the layout of :func:`h2o.parity.driver.make_prompts`."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, 256, (CONTEXTS, CONTEXT_LEN + CONT_LEN), generator=g).tolist()
    return {"ppl": [{"id": f"random-{i}", "context": x[:CONTEXT_LEN], "continuation": x[CONTEXT_LEN:]}
                    for i, x in enumerate(ids)], "needle": [], "context_len": CONTEXT_LEN, "cont_len": CONT_LEN}


def weights_sha256(folder: Path = MODEL_DIR) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def save_model(folder: Path = MODEL_DIR) -> None:
    """The tiny model's weights, once: a committed file is never rewritten (its sha256 is in the record)."""
    from h2o.assets.models import tiny_model

    if not (folder / "tokenizer.json").is_file():  # kvpress's KVzipPress loads the model folder's tokenizer
        from h2o.assets.tiny import byte_tokenizer

        byte_tokenizer().save_pretrained(folder)
    if (folder / "model.safetensors").is_file():
        return
    tiny_model("llama_gqa", seed=SEED, num_hidden_layers=LAYERS, max_position_embeddings=1024).save_pretrained(folder)


def load_model(folder: Path = MODEL_DIR):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()


def ours_nll(model, case: Case, ratio: float, prompt: dict, policy: tuple[str, dict] | None = None) -> float:
    """Our NLL per token of ``prompt``'s continuation for ``case`` at kvpress's ``ratio`` (``policy``: instead of
    the case's own, e.g. a deliberately broken one)."""
    import torch

    from h2o.parity.sides import continuation_nll, parity_policy

    name, options = policy or case.policy()
    ctx, cont = torch.tensor([prompt["context"]]), torch.tensor([prompt["continuation"]])
    pol = parity_policy(name, options, ctx.shape[1], ratio, case.timing)
    return continuation_nll(model, pol, ctx, cont, stepwise=case.timing != "prefill")[0] / cont.shape[1]


def kvpress_records(venv: Path, prompts: dict, threads: int) -> list[dict]:
    """kvpress's side on the committed model: the prefill cases in one run, the decoding ones in another."""
    from h2o.parity.sides import run_kvpress

    table = cases()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        variants = tmp / "variants.json"
        variants.write_text(json.dumps({n: [c.press, c.press_options] for n, c in table.items()}))
        out = tmp / "kvpress.jsonl"
        for timing in ("prefill", "decode", "interval"):
            names = [n for n, c in table.items() if c.timing == timing]
            run_kvpress(venv, tmp / "prompts.json", MODEL_DIR, out, ["full"] * (timing == "prefill") + names,
                        list(RATIOS), timing == "decode", threads, variants, INTERVAL * (timing == "interval"))
        recs = [json.loads(line) for line in out.read_text().splitlines()]
    # a decoding case's press also has a prefill timing, which its run records too: the case's own timing only
    return [r for r in recs if r["method"] not in table or r["timing"] == table[r["method"]].timing]


def dump(out: dict) -> str:
    """The record as JSON, one top-level key a line and one record a line (a diff shows which figure moved)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in out.items() if k != "records"]
    lines.append(' "records": [\n' + ",\n".join(f"  {json.dumps(r)}" for r in out["records"]) + "\n ]")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def beside(old: dict, new: dict) -> dict:
    """The record to write when ``old`` exists: ``new``, unless ``new`` was made on another CPU for the same cases,
    weights and prompts; then ``old`` with ``new``'s figures where they differ from it (by more than
    :data:`TOLERANCE`) under ``other_cpus[new's CPU]``.

    kvpress's own figures depend on the CPU where the last bit of a key decides a tie: in knorm's decoding form a
    repeated token's keys at layer 0 have equal norms (RoPE rotates, the norm stays), and ``k_proj`` of one token and
    of many tokens agree to the last bit on some CPUs' kernels and not on others' (an AMD EPYC: 9.5e-07 apart)."""
    same = ("kvpress", "transformers", "model", "ratios", "prompts")
    if (old.get("cpu", new["cpu"]) == new["cpu"] or any(old.get(k) != new[k] for k in same)
            or {n: Case(**c) for n, c in old["cases"].items()} != {n: Case(**c) for n, c in new["cases"].items()}):
        return new
    first = {key(r): nll(r) for r in old["records"]}
    differ = [r for r in new["records"] if abs(nll(r) - first[key(r)]) > TOLERANCE]
    others = {**old.get("other_cpus", {}), new["cpu"]: {"largest_gap": new["largest_gap"], "records": differ}}
    return {**old, "other_cpus": others}


def records_of(gold: dict, cpu: str) -> list[dict]:
    """kvpress's records as made on ``cpu`` (one of :func:`cpus`): the first CPU's, with that CPU's own figures."""
    own = {key(r): r for r in gold.get("other_cpus", {}).get(cpu, {}).get("records", [])}
    return [own.get(key(r), r) for r in gold["records"]]


def cpus(gold: dict) -> list[str]:
    """The CPUs whose kvpress figures the record holds, the first CPU first."""
    return [gold["cpu"], *gold.get("other_cpus", {})]


def key(r: dict) -> tuple:
    return r["method"], r["ratio"], r["prompt"]


def nll(r: dict) -> float:
    """A record's NLL per token."""
    return r["nll"] / r["n_tokens"]


def record(venv: Path, threads: int = 1) -> int:
    """Steps 1-4 of the module docstring, then our side beside them (printed: the largest gap per case)."""
    save_model()
    prompts = golden_prompts()
    recs = kvpress_records(venv, prompts, threads)
    keep = ("method", "ratio", "timing", "prompt", "nll", "n_tokens", "held_per_layer")
    first = recs[0]
    model = load_model()
    by_id = {p["id"]: p for p in prompts["ppl"]}
    table = cases()
    gaps = {}
    for r in recs:
        case = table.get(r["method"])
        if case is None or case.statistical or case.policy() is None:
            continue
        gap = abs(r["nll"] / r["n_tokens"] - ours_nll(model, case, r["ratio"], by_id[r["prompt"]]))
        gaps[r["method"]] = max(gaps.get(r["method"], 0.0), gap)
    out = {
        "made_by": "python -m h2o.parity --golden",
        "kvpress": first["kvpress"], "transformers": first["transformers"], "torch": first["torch"],
        "model": {"folder": str(MODEL_DIR.relative_to(GOLDEN.parents[2])), "sha256": weights_sha256(), "seed": SEED,
                  "arch": "llama_gqa", "layers": LAYERS},
        "ratios": list(RATIOS), "cases": {n: asdict(c) for n, c in table.items()},
        "largest_gap": {m: float(f"{g:.2e}") for m, g in sorted(gaps.items())},
        "prompts": prompts,
        "records": [{k: r[k] for k in keep if k in r} for r in recs],
        "cpu": cpu_name(),
    }
    if RECORD.is_file():
        out = beside(json.loads(RECORD.read_text()), out)
    RECORD.write_text(dump(out))
    for m, g in sorted(gaps.items()):
        print(f"golden {m}: largest |NLL/token kvpress - ours| {g:.1e}", file=sys.stderr)
    print(f"golden numbers: {RECORD}", file=sys.stderr)
    bad = [m for m, g in gaps.items() if (g > TOLERANCE) != bool(table[m].differs)]  # equal, or different by design
    if bad:
        print(f"golden: {', '.join(sorted(bad))}: not as expected (within {TOLERANCE:g} of kvpress, or beyond it where "
              f"the case names why)", file=sys.stderr)
    return 1 if bad else 0

