"""The attention function registered with transformers as ``"h2o"``: one code path for every architecture.

LlamaForCausalLM, OPTForCausalLM, GPTNeoXForCausalLM (and any model that dispatches through
``AttentionInterface``) call :func:`h2o_attention` with ``query (B, Hq, q, D)``, ``key/value (B, Hkv, k, D)`` (not
repeated for grouped-query attention) and the mask built by :func:`h2o_mask`. It reads its policy from the module
(set by :func:`h2o.core.attach`) and runs the simulated path (a mask over the full sequence) or the real path (the
evicting cache's layer). Scores are computed and accumulated in fp32.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .policies import PolicyError
from .simulate import grouped, grouped_scores, grouped_values, masked_softmax, simulated_attention

NAME = "h2o"


def h2o_mask(*args, **kwargs):
    """transformers' boolean causal+padding mask (B, 1, q, kv), never skipped (we need the padding)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def h2o_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state = getattr(module, "h2o", None)
    if state is None:
        raise RuntimeError("attn_implementation='h2o' needs the model attached: use h2o.core.attach(model, policy)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    B, _, q, _ = query.shape
    if attention_mask is None:
        new_valid = torch.ones(B, q, dtype=torch.bool, device=query.device)
    else:
        new_valid = attention_mask[:, 0, -1, -q:].bool()  # (B, q): the last row sees every non-pad new column
    if state.mode == "simulated":
        if key.shape[-2] != q:
            raise RuntimeError("simulated mode scores whole sequences in one pass; for generation use mode='real'")
        if state.prompt_len > q:
            raise PolicyError(f"prompt_len={state.prompt_len}: beyond the sequence of {q} tokens; allowed: 0-{q}")
        if state.quant is not None:  # attend to the values a quantized cache would hold
            key, value = state.quant.fake_kv(key, value, module.layer_idx)
        out, probs = simulated_attention(state.policy, query, key, value, new_valid, scaling,
                                         prompt_len=state.prompt_len, semantics=state.semantics)
        state.flag(module.layer_idx, out)
        state.observe(module, probs)
        return out.to(query.dtype), probs
    return real_attention(state, module, query, key, value, new_valid, scaling)


ROWS = 256  # query rows per block in a prefill: bounds the (B, Hkv, G, rows, S) fp32 scores


def real_attention(state, module, query, key, value, new_valid, scaling):
    """query (B, Hq, q, D) against the evicting layer's slots (B, Hkv, S, D)."""
    if state.cache is None:
        raise PolicyError("mode='real' needs a cache: pass cache=h.new_cache() to the model")
    layer = state.cache.layers[module.layer_idx]
    if not layer.serves(key):
        raise RuntimeError("mode='real' needs the cache from h2o.core.attach(...).new_cache() passed to the model")
    policy = state.policy
    B, Hq, q, D = query.shape
    if layer.n_new:
        layer.register_new(new_valid[:, -layer.n_new:])
    held = (layer.pos >= 0)[:, :, None, None, :]  # (B, Hkv, 1, 1, S)
    qg = grouped(query, key.shape[1])  # (B, Hkv, G, q, D)
    outs = []
    for r in range(0, q, ROWS):
        logits = grouped_scores(qg[..., r:r + ROWS, :], key).float() * scaling  # (B, Hkv, G, r, S)
        if q > 1:  # prefill (chunk): each new row sees the cache and the new columns up to itself
            stop = r + ROWS - q
            row_pos = layer.pos[:, :, None, -q + r:(stop if stop < 0 else None), None]  # (B, Hkv, 1, r, 1)
            allowed = held & (layer.pos[:, :, None, None, :] <= row_pos)
        elif not policy.evicts and not policy.is_full:
            allowed = policy.restrict(logits, layer.acc[:, :, None, None, :], held, layer.counts)
        else:
            allowed = held
        probs = masked_softmax(logits, allowed)  # (B, Hkv, G, r, S)
        if policy.needs_scores or q > 1:
            rows = new_valid[:, None, None, r:r + ROWS, None]  # pad query rows add nothing
            layer.acc += (probs * rows).sum((2, 3))
        outs.append(grouped_values(probs.to(value.dtype), value))  # (B, Hkv, G, r, D)
    if q > 1 and policy.evicts and not policy.is_full:
        layer.cut()
    out = torch.cat(outs, -2).reshape(B, Hq, q, D).transpose(1, 2)
    state.flag(module.layer_idx, out)  # NaN/inf guard: no host sync here; Attached.check_logits reads it per step
    return out.to(query.dtype), (probs.reshape(B, Hq, q, -1) if q <= ROWS else None)


AttentionInterface.register(NAME, h2o_attention)
AttentionMaskInterface.register(NAME, h2o_mask)
