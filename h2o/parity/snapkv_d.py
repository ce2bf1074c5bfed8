"""Parity of ``snapkv_d`` with the minghui-liu/kvpress fork's SnapKV-D (its ``SnapKVPress`` under
``BasePress.forward_hook``, ``ScorerPress.compress_prefilling`` / ``compress_decoding``), run side by side.

``python -m h2o.parity.snapkv_d --reference DIR`` (DIR: a checkout of minghui-liu/kvpress; its press files are
imported from there, never copied into this repository; they need torch and transformers only):

1. **The fork's side**: the committed tiny model of the golden numbers (tests/data/parity_golden/model, a random
   Llama of 3 layers, 4 query heads on 2 KV heads) with transformers' eager attention (the fork's decoding score
   reads the layer's attention weights: under sdpa or flash its window recomputation fails on one decoding row),
   the fork's ``forward_hook`` on every attention layer (its ``cache_budget`` the budget), a prompt of
   :data:`PROMPT` random ids, then :data:`NEW` tokens one at a time at their positions (its ``generate``'s).
   transformers 5 names two hook inputs differently (``cache``; no ``cache_position``): a shim hands the hook the
   fork's names (:class:`ForkCache`). Each layer's positions ride along its cache: every ``topk`` the hook calls
   is caught (:class:`CatchTopk`) and the positions gathered as its keys are.
2. **Ours**: ``snapkv_d`` through the evicting cache (``compress=interval``, ``interval=1``), the same ids.
3. Each case (:data:`CASES`) three ways: the fork as it runs (its cache in ``topk``'s order: scores descending),
   the fork with its kept slots left in position order (each ``topk``'s indices sorted: the one difference,
   docs/methods.md "SnapKV-D"), ours. Compared, all teacher-forced on our greedy tokens: the kept positions per
   layer and KV head at the prompt's cut and at every decoding cut, the NLL of each token; then each generating
   greedily on its own: the tokens equal to ours.

``--golden`` writes tests/data/parity_golden/snapkv_d.json (the fork in position order: its prompt cut, the
position each later cut drops per layer and head, its NLL per token; its greedy tokens as it runs), which
tests/test_snapkv_d.py compares ours with in CI, without the reference.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
import types
from pathlib import Path

import torch

from h2o.parity.pairs import SNAPKV_D_RECORD as RECORD

PROMPT, NEW, VOCAB, SEED = 160, 320, 256, 13  # the prompt's random ids in [3, VOCAB), then NEW generated tokens
# name -> (options, budget): the fork's defaults (window 64, kernel 5) and a small window, where most held tokens
# are scored (the fork needs budget >= window: it asserts more than ``window`` held tokens at every cut)
CASES = {"defaults": ({"window": 64, "kernel": 5}, 96), "w16_k3": ({"window": 16, "kernel": 3}, 48)}
FILES = ("base_press.py", "scorer_press.py", "snapkv_press.py", "h2o_press.py")  # h2o_press: h2o.parity.baselines


# ----------------------------------------------------------------------------------------------- reference
def load_reference(root: Path):
    """The fork's ``SnapKVPress`` and ``H2OPress`` from ``root``/kvpress/presses, their files loaded under the
    fork's package names without the package's ``__init__`` (which imports every press and the pipeline);
    ``sys.modules`` is left as it was."""
    folder = root / "kvpress" / "presses"
    missing = [str(folder / f) for f in FILES if not (folder / f).is_file()]
    if missing:
        raise SystemExit(f"--reference={root}: no {', '.join(missing)}; allowed: a checkout of minghui-liu/kvpress")
    names = ("kvpress", "kvpress.presses", *(f"kvpress.presses.{f[:-3]}" for f in FILES))
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n, path in (("kvpress", folder.parent), ("kvpress.presses", folder)):
            sys.modules[n] = types.ModuleType(n)
            sys.modules[n].__path__ = [str(path)]
        for f in FILES:
            spec = importlib.util.spec_from_file_location(f"kvpress.presses.{f[:-3]}", folder / f)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        presses = "kvpress.presses"
        return sys.modules[f"{presses}.snapkv_press"].SnapKVPress, sys.modules[f"{presses}.h2o_press"].H2OPress
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


class CatchTopk(torch.overrides.TorchFunctionMode):
    """Records the indices of each ``topk`` (the fork's selection); ``ordered``: returns them sorted, so the kept
    slots stay in position order (the values gathered alike)."""

    def __init__(self, ordered: bool):
        super().__init__()
        self.ordered, self.indices = ordered, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.topk, torch.topk):
            values, indices = out
            if self.ordered:
                indices = indices.sort(-1).values
                values = args[0].gather(-1, indices)
                out = torch.return_types.topk((values, indices))
            self.indices.append(indices)
        return out


class ForkCache:
    """What the fork's hook reads of a cache (transformers 4.5x's ``key_cache`` / ``value_cache`` lists) over a
    transformers 5 ``DynamicCache``."""

    def __init__(self, cache):
        self.key_cache, self.value_cache = Slots(cache, "keys"), Slots(cache, "values")


class Slots:
    def __init__(self, cache, field: str):
        self.cache, self.field = cache, field

    def __getitem__(self, i: int) -> torch.Tensor:
        return getattr(self.cache.layers[i], self.field)

    def __setitem__(self, i: int, value: torch.Tensor) -> None:
        setattr(self.cache.layers[i], self.field, value)


class ForkSide:
    """The fork's press on ``model``: its hook on every attention layer over a ``DynamicCache``; per layer the
    positions held per KV head (1, Hkv, S), in the fork's slot order."""

    def __init__(self, model, press, ordered: bool, per_layer: bool = False):
        from transformers import DynamicCache

        self.model, self.press, self.ordered = model, press, ordered
        # per_layer: a copy of the press on each layer (the fork hooks one object on every layer)
        self.presses = {i: copy.deepcopy(press) for i in range(len(model.model.layers))} if per_layer else {}
        self.cache = DynamicCache(config=model.config)
        self.start = 0  # the position of the forward's first token
        self.pos: dict[int, torch.Tensor] = {}

    def hook(self, module, args, kwargs, output):
        i, q = module.layer_idx, kwargs["hidden_states"].shape[1]
        new = torch.arange(self.start, self.start + q)
        hkv = self.cache.layers[i].keys.shape[1]
        held = self.pos.get(i, torch.empty(1, hkv, 0, dtype=torch.long))
        self.pos[i] = torch.cat([held, new.expand(1, hkv, q)], -1)
        shown = {**kwargs, "past_key_value": ForkCache(self.cache), "cache_position": new}
        with CatchTopk(self.ordered) as catch:
            output = self.presses.get(i, self.press).forward_hook(module, args, shown, output)
        if catch.indices:
            self.pos[i] = self.pos[i].gather(-1, catch.indices[-1])
        return output

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (1, q) at their positions -> the last logits (V,)."""
        q = ids.shape[1]
        positions = torch.arange(self.start, self.start + q)[None]
        out = self.model(ids, cache=self.cache, position_ids=positions, use_cache=True).logits[0, -1]
        self.start += q
        return out

    def held(self) -> list[list[list[int]]]:
        """Per layer and KV head the held positions, ascending."""
        return [[sorted(h.tolist()) for h in self.pos[i][0]] for i in sorted(self.pos)]


def fork_press(SnapKVPress, case: str):
    """The fork's SnapKV-D press of ``case`` (:data:`CASES`)."""
    options, budget = CASES[case]
    press = SnapKVPress(window_size=options["window"], kernel_size=options["kernel"])
    press.cache_budget = budget
    return press


def fork_run(model, press, prompt: torch.Tensor, forced: torch.Tensor | None = None, ordered: bool = True,
             per_layer: bool = False) -> dict:
    """The fork's ``press`` (its ``cache_budget`` set) on ``prompt`` (1, P), then :data:`NEW` tokens: ``forced``
    (NEW,) teacher-forced, or its own greedy ones -> {"tokens", "nll" per token, "held" per step (the prompt's cut
    first)}. ``per_layer``: a copy of the press on each layer."""
    press.debug, press.latency = False, False
    side = ForkSide(model, press, ordered, per_layer)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    hooks = [layer.self_attn.register_forward_hook(side.hook, with_kwargs=True) for layer in model.model.layers]
    try:
        return generate(side.forward, side.held, prompt, forced)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(before)


# ----------------------------------------------------------------------------------------------- ours
def ours_run(model, case: str, prompt: torch.Tensor, forced: torch.Tensor | None = None, policy=None) -> dict:
    """``snapkv_d`` (or ``policy``) through the evicting cache, as :func:`fork_run`."""
    from h2o import attach, make_policy

    options, budget = CASES[case]
    policy = policy or make_policy("snapkv_d", budget=budget, **options)
    with attach(model, policy, mode="real") as h:
        cache = h.new_cache()

        def forward(ids):
            return model(ids, cache=cache, use_cache=True).logits[0, -1]

        def held():
            return [[sorted(p for p in head.tolist() if p >= 0) for head in pos[0]] for pos in cache.positions()]

        return generate(forward, held, prompt, forced)


def generate(forward, held, prompt: torch.Tensor, forced: torch.Tensor | None) -> dict:
    tokens, nll, kept = [], [], []
    with torch.no_grad():
        logits = forward(prompt)
        kept.append(held())
        for t in range(NEW):
            logp = torch.log_softmax(logits.double(), -1)
            tok = int(logp.argmax()) if forced is None else int(forced[t])
            tokens.append(tok)
            nll.append(-float(logp[tok]))
            if t + 1 < NEW:
                logits = forward(torch.tensor([[tok]]))
                kept.append(held())
    return {"tokens": tokens, "nll": nll, "held": kept}


# ----------------------------------------------------------------------------------------------- compare
def prompt_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(SEED))


def dropped(held: list) -> list:
    """Per decoding cut (after the prompt's), layer and KV head: the position it dropped (-1: none)."""
    out = []
    for before, after in zip(held, held[1:]):
        out.append([[next(iter(set(b) - set(a)), -1) for b, a in zip(lb, la)] for lb, la in zip(before, after)])
    return out


def differ(a: list, b: list) -> int:
    """(step, layer, head) entries whose kept positions differ."""
    return sum(x != y for sa, sb in zip(a, b) for la, lb in zip(sa, sb) for x, y in zip(la, lb))


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(model, SnapKVPress) -> dict:
    """Every case three ways (the fork as it runs, in position order, ours): the summary and the golden record."""
    prompt = prompt_ids()
    summary, golden = {}, {}
    for case in CASES:
        ours = ours_run(model, case, prompt)
        forced = torch.tensor(ours["tokens"])
        kept_in_order = fork_run(model, fork_press(SnapKVPress, case), prompt, forced, ordered=True)
        as_run = fork_run(model, fork_press(SnapKVPress, case), prompt, forced, ordered=False)
        free_order = fork_run(model, fork_press(SnapKVPress, case), prompt, ordered=True)
        free_run = fork_run(model, fork_press(SnapKVPress, case), prompt, ordered=False)
        entries = sum(len(h) for step in ours["held"] for h in step)
        summary[case] = {
            "budget": CASES[case][1], **CASES[case][0], "entries": entries,
            "prompt_cut_kept_differently": {"in_position_order": differ(ours["held"][:1], kept_in_order["held"][:1]),
                                            "as_it_runs": differ(ours["held"][:1], as_run["held"][:1])},
            "decoding_cuts_kept_differently": {"in_position_order": differ(ours["held"][1:],
                                                                           kept_in_order["held"][1:]),
                                               "as_it_runs": differ(ours["held"][1:], as_run["held"][1:])},
            "largest_nll_gap": {"in_position_order": max_gap(ours["nll"], kept_in_order["nll"]),
                                "as_it_runs": max_gap(ours["nll"], as_run["nll"])},
            "nll_per_token": {"ours": mean(ours["nll"]), "in_position_order": mean(kept_in_order["nll"]),
                              "as_it_runs": mean(as_run["nll"])},
            "greedy_tokens_equal_before_a_difference": {"in_position_order": agree(ours["tokens"],
                                                                                   free_order["tokens"]),
                                                        "as_it_runs": agree(ours["tokens"], free_run["tokens"])},
            "greedy_tokens": NEW,
        }
        golden[case] = {"tokens": ours["tokens"], "prompt_cut": kept_in_order["held"][0],
                        "dropped": dropped(kept_in_order["held"]),
                        "nll": [float(f"{x:.9g}") for x in kept_in_order["nll"]],
                        "greedy_in_position_order": free_order["tokens"], "greedy_as_it_runs": free_run["tokens"]}
    return {"summary": summary, "golden": golden}


def max_gap(a: list[float], b: list[float]) -> float:
    return float(f"{max(abs(x - y) for x, y in zip(a, b)):.2e}")


def mean(a: list[float]) -> float:
    return round(sum(a) / len(a), 6)


def main(argv=None) -> int:
    from h2o.parity.golden import load_model
    from h2o.parity.script import arguments, commit, report

    a = arguments("h2o.parity.snapkv_d", __doc__, "a checkout of minghui-liu/kvpress (kvpress/presses inside)", RECORD,
                  argv)
    root = Path(a.reference)
    SnapKVPress, _ = load_reference(root)
    reference = {"repo": "minghui-liu/kvpress", "commit": commit(root),
                 "files": [f"kvpress/presses/{f}" for f in FILES]}
    result = compare(load_model(), SnapKVPress)
    return report(a, "h2o.parity.snapkv_d", RECORD, result["summary"], reference, {
        "prompt": prompt_ids()[0].tolist(), "new": NEW, "cases": {k: {"options": o, "budget": b}
                                                                 for k, (o, b) in CASES.items()},
        "summary": result["summary"], "fork": result["golden"]})


if __name__ == "__main__":
    sys.exit(main())
