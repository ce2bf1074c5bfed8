"""Shared checks of the two paths (the simulated mask in one pass, the evicting cache token by token) on tiny models:
test_prefill_methods, test_key_decode, test_interval and test_toys run their rules through these."""
import torch

from h2o import attach

L, P, PADS = 36, 24, (0, 5)  # columns, prompt columns, left pads per row


def left_padded(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, L) ids -> (ids, mask) with row b's first PADS[b] columns padding."""
    rows, mask = rows.clone(), torch.ones(2, L, dtype=torch.long)
    for b, n in enumerate(PADS):
        rows[b, :n], mask[b, :n] = 0, 0
    return rows, mask


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(2, L) left-padded random ids and mask: row b has PADS[b] pads, then its tokens."""
    return left_padded(torch.randint(1, 128, (2, L), generator=torch.Generator().manual_seed(7)))


def padded_paths(model, policy, x: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """A padded batch (2, L) (default :func:`batch`) with a prompt of P columns through both paths; asserts they
    agree on the real rows (a pad row's output is not defined alike). Returns (simulated logits, full-cache logits,
    the cache)."""
    if x is None:
        x, mask = batch()
    with torch.no_grad():
        with attach(model, policy, prompt_len=P):
            sim = model(x, attention_mask=mask).logits
        full = model(x, attention_mask=mask).logits
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            real = [model(x[:, :P], attention_mask=mask[:, :P], cache=cache).logits]
            real += [model(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits for t in range(P, L)]
    real = torch.cat(real, 1)
    for b, n in enumerate(PADS):
        torch.testing.assert_close(real[b, n:], sim[b, n:], atol=1e-4, rtol=0)
    return sim, full, cache


def without_a_prompt(model, policy, x: torch.Tensor):
    """x (1, T) with no prompt: the simulated mask in one pass and the evicting cache token by token -> (simulated
    logits, real logits, both (1, T, V); the cache)."""
    T = x.shape[1]
    with torch.no_grad():
        with attach(model, policy):
            sim = model(x).logits
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache(ref_len=T)
            real = torch.cat([model(x[:, t:t + 1], cache=cache).logits for t in range(T)], 1)
    return sim, real, cache


def quantized_paths_agree(model, policy, x: torch.Tensor, quant, prompt: int = 24):
    """x (1, T) through both paths under ``quant``, its first ``prompt`` tokens the prompt (0: none; the cache's
    budget then taken of T): both attend to (and rank) the keys the quantized cache holds, so their logits agree to
    quantization noise, far below what quantization itself changes -> (what it changes: |simulated logits -
    unquantized ones|; the real path's cache)."""
    T = x.shape[1]
    with torch.no_grad():
        with attach(model, policy, quant=quant, prompt_len=prompt):
            sim = model(x).logits
        with attach(model, policy, prompt_len=prompt):
            unquantized = model(x).logits
        with attach(model, policy, mode="real", quant=quant) as h:
            cache = h.new_cache(ref_len=None if prompt else T)
            real = [model(x[:, :prompt], cache=cache).logits] if prompt else []
            real = torch.cat(real + [model(x[:, t:t + 1], cache=cache).logits for t in range(prompt, T)], 1)
    gap, effect = (real - sim).abs(), (sim - unquantized).abs()
    assert gap.mean() < 0.01 * effect.mean() and gap.max() < 0.1 * effect.max(), (gap.max(), effect.max())
    return effect, cache
