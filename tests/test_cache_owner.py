"""The evicting cache owns its state (issue 47, item 3): only its modules (h2o/core/cache.py and the mixins it is
made of, cache_batch.py, cache_cut.py) write a layer's fields, by assignment or in place (``.copy_``, ``[...] =``),
or read them (others ask the cache: ``figures``, ``footprint``, ``positions``, ``host_tensors``, ``read``); nothing
outside the core reads its host counts (a task asks ``EvictingCache.figures``); nothing deep-copies a cache
(``EvictingCache.copy``), and a copy shares no state that changes with the cache it came from."""
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
# Fields whose reads are not the cache's internals: the layer's rule (the attention function asks it what it reads,
# as any policy), and what every transformers cache layer has (code over a DynamicCache reads them; the evicting
# layer's own are read through ``read()``). Writes of them are guarded all the same.
SHARED = {"policy", "keys", "values", "is_initialized"}
# Files outside the cache's modules that are its own protocol and read its fields by design, each with why:
PROTOCOL: dict[Path, str] = {}  # none: the attention function and the prefill call the layer's methods


def layer_fields() -> set[str]:
    return set(vars(EvictingLayer(make_policy("h2o", budget=0.5)))) - {"policy"}


def on_cache(a: ast.AST, fields: set[str]) -> bool:
    """Whether ``a`` is a layer field on an object spelled with ``layer`` or ``cache`` (``layer.pos``,
    ``cache.layers[i].pos``), or a subscript of one (``layer.pos[..., 0]``)."""
    while isinstance(a, ast.Subscript):
        a = a.value
    return isinstance(a, ast.Attribute) and a.attr in fields and any(
        w in ast.unparse(a.value) for w in ("layer", "cache"))


def writes(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines writing a layer field on an object spelled with ``layer`` or ``cache``: an assignment to it or into it
    (``layer.pos = ...``, ``layer.pos[...] = ...``, ``+=``), or an in-place method on it (``layer.keys.copy_(...)``,
    ``layer.acc[..., :c].scatter_(...)``: torch's trailing underscore)."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            out += [node.lineno for a in ast.walk(t) if isinstance(a, ast.Attribute) and on_cache(a, fields)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method.endswith("_") and not method.startswith("_") and on_cache(node.func.value, fields):
                out.append(node.lineno)
    return sorted(out)


def reads(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines reading a layer field (:data:`SHARED` aside) on an object spelled with ``layer`` or ``cache``."""
    return sorted(a.lineno for a in ast.walk(tree) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Load)
                  and a.attr not in SHARED and on_cache(a, fields))


def scan(find) -> list[str]:
    fields = layer_fields()
    return [f"{f.relative_to(ROOT)}:{n}" for f in sorted(ROOT.rglob("*.py")) if f not in OWNERS and f not in PROTOCOL
            for n in find(ast.parse(f.read_text(encoding="utf-8")), fields)]


def test_the_guards_see_each_kind_of_access():
    fields = layer_fields()
    code = ast.parse("layer.keys.copy_(x)\ncache.layers[0].pos[..., 1] = 2\nlayer.acc[:, :c].add_(p)\n"
                     "layer.n_tok += 1\nlayer.read()\nmodel.pos.copy_(x)\n")
    assert writes(code, fields) == [1, 2, 3, 4]
    code = ast.parse("a = layer.pos\nb = cache.layers[0].host_tok[0]\nc = layer.keys\nd = layer.policy.reads\n"
                     "e = layer.read()\nf = self.window\n")
    assert reads(code, fields) == [1, 2]


def test_only_the_cache_modules_write_a_layers_fields():
    assert scan(writes) == []


def test_only_the_cache_modules_read_a_layers_fields():
    assert scan(reads) == []


def test_nothing_outside_the_core_reads_the_host_counts_or_deep_copies_a_cache():
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        if (ROOT / "core") in f.parents:
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
