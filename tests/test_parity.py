"""`make parity`'s harness side against independent references of kvpress's protocol, on a tiny GQA model.

The references use transformers alone (a DynamicCache whose layers are cut by hand, the eager attention weights
the model returns), written from the definitions in docs/methods.md, not from kvpress's code: the context is
prefilled with full attention, each layer keeps n tokens per KV head chosen by the method's score, and what follows
is one forward through that cache at the original positions. The harness side (h2o.parity.driver.forwards, the
evicting cache) must give the same logits. The kvpress side itself needs its own virtualenv and runs only in
`make parity`; here its command line is checked for bad input.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from h2o.assets.models import tiny_model
from h2o.parity import driver as parity
from h2o.parity.pairs import kept as tokens_kept
from h2o.parity.table import write_table
from h2o.core.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]
L, M = 40, 9  # context and continuation tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_gqa", seed=3)  # GQA: several query heads per KV head


def ids(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def reference(model, context, after, keep_fn):
    """kvpress's protocol by hand: prefill ``context`` (1, L), keep per layer the slots ``keep_fn(layer, attn)``
    returns ((Hkv, n) indices; attn (1, Hq, L, L) that layer's eager attention weights), then one forward of
    ``after`` at positions L, L + 1, ... Returns (last context logits (1, V), logits of ``after`` (m, V))."""
    cache = DynamicCache()
    with torch.no_grad():
        out = model(context, cache=cache, output_attentions=True, use_cache=True)
        for i, layer in enumerate(cache.layers):
            keep = keep_fn(i, out.attentions[i])  # (Hkv, n)
            idx = keep[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        pos = torch.arange(L, L + after.shape[1])[None]
        rest = model(after, cache=cache, position_ids=pos).logits[0]
    return out.logits[0, -1:], rest


def sinks_and_recent(n: int, hkv: int):
    """StreamingLLM at the prompt's end: the 4 first and the n - 4 last positions, every KV head."""
    keep = torch.cat([torch.arange(4), torch.arange(L - (n - 4), L)])
    return lambda i, attn: keep[None].expand(hkv, -1)


def observed(n: int, hkv: int):
    """ObservedAttention: each key's mean attention over the L - j queries that saw it, averaged over the query
    heads of its KV head; top n per KV head."""
    def keep(i, attn):
        a = attn[0]  # (Hq, L, L)
        mean = a.sum(1) / torch.arange(L, 0, -1, dtype=a.dtype)  # (Hq, L)
        score = mean.view(hkv, -1, L).mean(1)  # (Hkv, L)
        return score.topk(n, -1).indices.sort(-1).values
    return keep


@pytest.mark.parametrize("ratio", [0.5, 0.8])
@pytest.mark.parametrize("method", ["streaming_llm", "observed_attention"])
def test_harness_side_equals_reference(model, method, ratio):
    n = tokens_kept(L, ratio)
    hkv = model.config.num_key_value_heads
    ctx, cont = ids(1, L), ids(2, M)
    name, options = parity.OURS[method]
    policy = make_policy(name, budget=n, **options)
    first, rest, held = parity.forwards(model, policy, ctx, [cont], L)
    ref_first, ref_rest = reference(model, ctx, cont, (sinks_and_recent if method == "streaming_llm"
                                                        else observed)(n, hkv))
    assert held == [n] * model.config.num_hidden_layers
    torch.testing.assert_close(first, ref_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest, ref_rest, atol=1e-5, rtol=1e-5)
    # the budget is doing something: the full cache gives other logits
    _, full_rest = reference(model, ctx, cont, lambda i, attn: torch.arange(L)[None].expand(hkv, -1))
    assert (rest - full_rest).abs().max() > 1e-3


def test_reference_catches_a_wrong_selection(model):
    """The comparison above fails when one kept token differs (the reference is not blind)."""
    n, hkv = tokens_kept(L, 0.5), model.config.num_key_value_heads
    ctx, cont = ids(1, L), ids(2, M)
    first, rest, _ = parity.forwards(model, make_policy("streaming_llm", budget=n, sinks=4), ctx, [cont], L)
    wrong = torch.cat([torch.arange(3), torch.arange(L - (n - 3), L)])  # 3 sinks instead of 4
    _, ref_rest = reference(model, ctx, cont, lambda i, attn: wrong[None].expand(hkv, -1))
    assert (rest - ref_rest).abs().max() > 1e-4


def test_stepwise_decode_holds_the_budget(model):
    """--decode: fed one token at a time, every step sees n tokens (itself included): the same logits as a
    reference that, before each token, cuts the cache to the 4 sinks and the n - 5 newest."""
    n, hkv = 12, model.config.num_key_value_heads
    ctx, cont = ids(4, L), ids(5, M)
    _, rest, _ = parity.forwards(model, make_policy("streaming_llm", budget=n, sinks=4), ctx, [cont], L,
                                 stepwise=True)
    cache, out = DynamicCache(), []
    with torch.no_grad():
        model(ctx, cache=cache)
        for t in range(M):
            for layer in cache.layers:
                S = layer.keys.shape[2]
                keep = torch.cat([torch.arange(4), torch.arange(S - (n - 5), S)])
                idx = keep[None, None, :, None].expand(1, hkv, -1, layer.keys.shape[-1])
                layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
            out.append(model(cont[:, t:t + 1], cache=cache, position_ids=torch.tensor([[L + t]])).logits[0])
    torch.testing.assert_close(rest, torch.cat(out), atol=1e-5, rtol=1e-5)


def test_kept_is_kvpress_rounding():
    assert tokens_kept(2048, 0.8) == 409 and tokens_kept(2048, 0.5) == 1024
    assert tokens_kept(10, 0.8) == 1  # int(10 * 0.19999999999999996); floor(0.2 * 10 + 1e-9) would be 2


class Bytes:
    """A stand-in tokenizer: one id per character."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) % 250 + 3 for c in text]})()


def test_prompts_shapes_and_needle():
    text = "".join(chr(97 + i % 26) for i in range(20000))
    p = parity.make_prompts(Bytes(), text, contexts=2, needles=1, context_len=300, cont_len=50)
    assert [len(x["context"]) for x in p["ppl"] + p["needle"]] == [300, 300, 300]
    assert all(len(x["continuation"]) == 50 for x in p["ppl"])
    needle = p["needle"][0]
    spliced = Bytes()(f" The magic number is {needle['number']}.").input_ids
    at = needle["depth"]
    assert needle["context"][at:at + len(spliced)] == spliced
    assert needle["answer"] == Bytes()(f" {needle['number']}.").input_ids
    starts = [x["start"] for x in p["ppl"] + p["needle"]]
    assert all(b - a >= 350 for a, b in zip(starts, starts[1:]))  # passages do not overlap


def test_table_from_records(tmp_path, monkeypatch):
    monkeypatch.setitem(parity.OURS, "expected_attention", None)  # a kvpress method the harness has not built

    def rec(side, method, ratio, kind, nll, timing="prefill", exact=None):
        r = {"side": side, "method": method, "ratio": ratio, "timing": timing, "prompt": f"{kind}-0",
             "kind": kind, "nll": nll, "n_tokens": 2, "seconds": 1.0, "kvpress": "0.5.5", "transformers": "5.2.0"}
        return {**r, "exact": exact} if exact is not None else r

    kv = [rec("kvpress", "full", 0.0, "ppl", 2.0), rec("kvpress", "streaming_llm", 0.8, "ppl", 4.0),
          rec("kvpress", "expected_attention", 0.8, "ppl", 3.0),
          rec("kvpress", "expected_attention", 0.8, "needle", 1.0, exact=True)]
    ours = [rec("h2o", "full", 0.0, "ppl", 2.0), rec("h2o", "streaming_llm", 0.8, "ppl", 4.0)]
    (tmp_path / "kvpress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kv))
    (tmp_path / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    table = tmp_path / "parity.md"
    write_table(tmp_path, table, {"ppl": [{}], "needle": [{}], "context_len": 100, "cont_len": 10})
    text = table.read_text()
    e2 = f"{torch.tensor(2.0).exp():.3f}"  # exp(4 / 2)
    assert f"perplexity kvpress {torch.tensor(1.0).exp():.3f}, ours {torch.tensor(1.0).exp():.3f}" in text
    assert f"| streaming_llm | `streaming_llm` sinks=4 | {e2} | {e2} |" in text
    assert f"| expected_attention | - | {torch.tensor(1.5).exp():.3f} | not built yet |" in text
    assert "| expected_attention | - | 1/1 (0.500) | not built yet |" in text
    assert "20% kept (19)" in text
    assert "vs ours: streaming_llm 20%: 0.0e+00." in text  # the per-prompt gap of the one method both ran  # int(100 * (1 - 0.8)): 1 - 0.8 is just below 0.2


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "1.5"], "--ratios='1.5': 1.5 is not in (0, 1)"),
    (["--methods", "snapkv,bogus"], "--methods: 'bogus' unknown"),
    (["--contexts", "0"], "--contexts='0': '0' is not an int >= 1"),
])
def test_driver_bad_input_one_line_exit_2(argv, message, capsys):
    assert parity.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_kvpress_side_bad_input_before_any_import(tmp_path):
    """The kvpress-side runner refuses bad arguments in one line with exit 2 (run here with the harness's python:
    it imports kvpress only after its checks)."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "parity" / "kvpress_side.py"), "--prompts",
                          str(tmp_path / "none.json"), "--model", str(tmp_path), "--out", str(tmp_path / "o"),
                          "--methods", "snapkv,h2o"], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("kvpress_side: --methods h2o: allowed:") and "\n" not in run.stderr.strip()


def test_kvpress_side_refuses_a_bad_variant(tmp_path):
    """--variants names presses with options; an unknown press is refused in one line, exit 2."""
    variants = tmp_path / "v.json"
    variants.write_text(json.dumps({"snapkv_w8": ["snapkvv", {"window_size": 8}]}))
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "parity" / "kvpress_side.py"), "--prompts",
                          str(tmp_path / "none.json"), "--model", str(tmp_path), "--out", str(tmp_path / "o"),
                          "--methods", "snapkv_w8", "--variants", str(variants)], capture_output=True, text=True)
    assert run.returncode == 2
    err = run.stderr.strip()
    assert err.startswith(f"kvpress_side: --variants {variants}: snapkv_w8: ['snapkvv', ") and "\n" not in err
