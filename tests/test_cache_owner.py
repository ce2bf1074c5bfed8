"""The evicting cache owns its state (issue 47, item 3): only its modules (h2o/core/cache.py and the mixins it is
made of, cache_batch.py, cache_cut.py) write a layer's fields; nothing outside the core reads its host counts (a
task asks ``EvictingCache.figures``); nothing deep-copies a cache (``EvictingCache.copy``), and a copy shares no
state that changes with the cache it came from."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from h2o import make_policy
from h2o.assets.models import tiny_model
from h2o.core.attach import attach
from h2o.core.cache import EvictingLayer

ROOT = Path(__file__).resolve().parents[1] / "h2o"
OWNERS = {ROOT / "core" / name for name in ("cache.py", "cache_batch.py", "cache_cut.py")}
HOST = {"host_held", "host_total", "host_tok", "host_counts"}  # the layer's host mirrors
INSPECTOR = ROOT / "bench" / "launches.py"  # counts host reads: it must know which tensors live on the host


def layer_fields() -> set[str]:
    return set(vars(EvictingLayer(make_policy("h2o", budget=0.5)))) - {"policy"}


def writes(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines assigning a layer field on an object spelled with ``layer`` or ``cache`` (``layer.pos = ...``)."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and a.attr in fields and any(
                        w in ast.unparse(a.value) for w in ("layer", "cache")):
                    out.append(node.lineno)
    return out


def test_only_the_cache_modules_write_a_layers_fields():
    fields = layer_fields()
    found = [f"{f.relative_to(ROOT)}:{n}" for f in sorted(ROOT.rglob("*.py")) if f not in OWNERS
             for n in writes(ast.parse(f.read_text(encoding="utf-8")), fields)]
    assert found == []


def test_nothing_outside_the_core_reads_the_host_counts_or_deep_copies_a_cache():
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        if (ROOT / "core") in f.parents or f == INSPECTOR:
            continue
        text = f.read_text(encoding="utf-8")
        found += [f"{f.relative_to(ROOT)}: .{a.attr}" for a in ast.walk(ast.parse(text))
                  if isinstance(a, ast.Attribute) and a.attr in HOST]
        found += [f"{f.relative_to(ROOT)}: deepcopy"] if "deepcopy(cache" in text or "copy_of" in text and \
            "deepcopy" in text else []
    assert found == []


def test_a_copy_shares_nothing_that_changes():
    """A prompt cut under h2o, copied; the copy decodes three tokens: the original holds what it held (keys,
    positions, scores, host counts), and decoding the original the same way gives the copy's logits."""
    model, ids = tiny_model("llama"), torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attach(model, make_policy("h2o", budget=0.3), mode="real") as h:
        base = h.new_cache()
        model(ids, cache=base)
        before = [(layer.keys.clone(), layer.pos.clone(), layer.acc.clone(), list(layer.host_held))
                  for layer in base.layers]
        runs = []
        for cache in (base.copy(), base):
            h.cache = cache
            runs.append(torch.cat([model(ids[:, i:i + 1], cache=cache).logits for i in range(3)], 1))
            if cache is not base:
                after = [(layer.keys, layer.pos, layer.acc, layer.host_held) for layer in base.layers]
                assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x[:3], y[:3]))
                assert [x[3] for x in before] == [y[3] for y in after]
        assert base.figures()["held"] == [sum(layer.host_held[0] for layer in base.layers)]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
