"""What kvpress 0.5.5's only decoding form of Expected Attention computes: ``DecodingPress(ExpectedAttentionPress(),
compression_interval=N, target_size=16)`` on the parity tiny Llama (tests/data/parity_golden/model), a 24-token
prompt, 12 greedy tokens. For each N, at layer 0's first re-scores: the hidden states buffered, the keys held, whether
the query mean is all NaN, whether the covariance is all 0, whether every score is NaN, and the positions KV head 0
keeps. The evidence behind expected_attention's refusal of ``compress=decode`` (docs/methods.md, Expected Attention).

Runs in the parity virtualenv (tools/parity/setup_venv.sh); imports kvpress, nothing of ``h2o``. Under a transformers
that passes the cache as ``cache`` and no ``cache_position`` (>= 5.3, outside kvpress's pin) the hook's two inputs
are supplied from a per-layer token count.

Usage: python tools/parity/expected_attention_decoding.py [--model tests/data/parity_golden/model]
"""
from __future__ import annotations

import argparse

import torch
from kvpress import DecodingPress, ExpectedAttentionPress
from transformers import AutoModelForCausalLM

PROMPT, NEW, TARGET, INTERVALS = 24, 12, 16, (1, 4, 5, 8)


def renamed_kwargs() -> None:
    """Give DecodingPress's hook ``past_key_values`` and ``cache_position``, which transformers 5 does not pass."""
    hook, seen = DecodingPress.forward_hook, {}

    def forward_hook(self, module, args, kwargs, output):
        if "past_key_values" not in kwargs and "cache" in kwargs:
            q = kwargs["hidden_states"].shape[1]
            key = (id(self), module.layer_idx)
            seen[key] = total = seen.get(key, 0) + q
            kwargs = {**kwargs, "past_key_values": kwargs["cache"], "cache_position": torch.arange(total - q, total)}
        return hook(self, module, args, kwargs, output)

    DecodingPress.forward_hook = forward_hook


def probe(model, ids: torch.Tensor, interval: int) -> list[tuple]:
    """Layer 0's re-scores under DecodingPress(ExpectedAttentionPress, interval): one tuple per re-score."""
    base, seen = ExpectedAttentionPress(), []
    score = base.score

    def logged(module, hidden_states, keys, values, attentions, kwargs):
        s = score(module, hidden_states, keys, values, attentions, kwargs)  # (B, Hkv, S)
        if module.layer_idx == 0:
            mu, cov = base.get_query_statistics(module, hidden_states)
            kept = sorted(s.topk(TARGET, dim=-1).indices[0, 0].tolist())
            seen.append((hidden_states.shape[1], keys.shape[2], bool(torch.isnan(mu).all()),
                         bool(cov is not None and (cov == 0).all()), bool(torch.isnan(s).all()), kept))
        return s

    base.score = logged
    press = DecodingPress(base_press=base, compression_interval=interval, target_size=TARGET)
    with torch.no_grad(), press(model):
        model.generate(ids, max_new_tokens=NEW, do_sample=False)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tests/data/parity_golden/model")
    a = ap.parse_args()
    renamed_kwargs()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = torch.randint(5, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    print("interval | buffered states, keys held, mean all NaN, covariance all 0, scores all NaN, kept (head 0)")
    for n in INTERVALS:
        rows = probe(model, ids, n)
        print(f"{n} | {len(rows)} re-scores; first: {rows[0]}" + (f"; second: {rows[1]}" if len(rows) > 1 else ""))


if __name__ == "__main__":
    main()
