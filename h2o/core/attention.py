"""The attention function registered with transformers as ``"h2o"``: one code path for every architecture.

LlamaForCausalLM, OPTForCausalLM, GPTNeoXForCausalLM (and any model that dispatches through
``AttentionInterface``) call :func:`h2o_attention` with ``query (B, Hq, q, D)``, ``key/value (B, Hkv, k, D)`` (not
repeated for grouped-query attention) and the mask built by :func:`h2o_mask`. It reads its policy from the module
(set by :func:`h2o.core.attach`) and runs the simulated path (a mask over the full sequence) or the real path (the
evicting cache's layer). Scores are computed and accumulated in fp32, q scaled before the product.

No host sync per layer: the non-finite guard is a device flag per layer (``Attached.flag``), read once per forward
(on the logits, ``Attached.check_logits``); the evicting cache keeps its token counts on the host. A mask that does not depend on the scores (full,
position-only policies), or the row plan of a score-based one (where the row loop starts), is built once per
forward and shared by the layers.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .policies import PolicyError
from .prefill import own_kernel, real_prefill, simulated_fused, simulated_mask
from .simulate import grouped, grouped_values, masked_softmax, scores, simulated_attention, forward_plan
from .step import LayerCall

NAME = "h2o"


def h2o_mask(*args, **kwargs):
    """transformers' boolean causal+padding mask (B, 1, q, kv); None where it is plain causal over the forward's
    own columns and no attention mask was given (transformers' own skip for sdpa: every column a real token,
    :func:`new_valid`, and the prefill builds no q x q mask); none for a single new column (a decoding token is
    never a pad, the cached columns are described by the cache)."""
    if kwargs.get("q_length") == 1:
        return None
    # the skip only without a 2D mask: with one, transformers reads it on the host to decide (2 syncs a forward)
    kwargs["allow_is_causal_skip"] = kwargs.get("attention_mask") is None
    return sdpa_mask(*args, **kwargs)


def h2o_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature. The settings it passes per layer: ``scaling``; in ``kwargs``
    ``sliding_window`` (the layer's window, None on a global layer: a token leaves the layer once out of it,
    before the policy decides, docs/attention.md), ``softcap`` (Gemma-2: ``tanh(x / c) * c`` on the logits),
    ``s_aux`` (GPT-OSS: a learned sink logit per query head in the softmax's denominator). Dropout is refused
    (``attach`` refuses it in training mode before anything runs; this is the guard of last resort)."""
    sliding_window, softcap, s_aux = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    state = getattr(module, "h2o", None)
    if state is None:
        raise RuntimeError("attn_implementation='h2o' needs the model attached: use h2o.core.attach(model, policy)")
    if dropout:
        raise PolicyError(f"{type(module).__name__}: dropout={dropout} not supported by the h2o attention; allowed: "
                          f"eval mode (model.eval())")
    sinks = None if s_aux is None else s_aux.float().view(1, key.shape[1], -1, 1, 1)  # (1, Hkv, G, 1, 1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    window = sliding_window or None
    if state.mode == "simulated":
        if key.shape[-2] != query.shape[-2]:
            raise RuntimeError("simulated mode scores whole sequences in one pass; for generation use mode='real'")
        q = query.shape[-2]
        if state.prompt_len > q:
            raise PolicyError(f"prompt_len={state.prompt_len}: beyond the sequence of {q} tokens; allowed: 0-{q}")
        if window is not None and state.policy.whole_forward:
            raise PolicyError(f"policy={state.policy.name}: the paper code's rule has no sliding window; layer "
                              f"{module.layer_idx} of {type(module).__name__} slides ({window}); allowed: policy=h2o")
        window = window if window is not None and window < q else None  # a window past the sequence drops nothing
        valid, plan = state.per_forward(attention_mask, query, lambda v: forward_plan(
            state.policy, v, state.prompt_len, window=window), window)
        if state.quant is not None:  # attend to the values a quantized cache would hold
            key, value = state.quant.fake_kv(key, value, module.layer_idx, valid)
        mask = plan[0]
        # a mask that does not read the scores (full, position-only in closed form), in fp32: the fused kernel, the
        # mask built once per forward (half precision keeps the eager rows, which both paths compute alike)
        if (mask is not None and mask.shape[2] == 1 and not state.policy.whole_forward and softcap is None
                and sinks is None and state.observer is None and query.dtype == torch.float32):
            plain = attention_mask is None and window is None and state.policy.is_full  # plain causal
            _, fused_mask = state.per_forward(attention_mask, query, lambda _: simulated_mask(mask, plain),
                                              ("fused", window))
            out = simulated_fused(query, key, value, fused_mask, scaling)  # (B, Hq, T, D)
            state.flag(module.layer_idx, out)
            return out.transpose(1, 2), None
        rule = state.policy.for_layer(module.layer_idx, state.num_layers)  # the layer's rule (Policy.for_layer)
        out, probs = simulated_attention(rule, query, key, value, valid, scaling, LayerCall(
            prompt_len=state.prompt_len, plan=plan, window=window, softcap=softcap, sinks=sinks,
            layer=(module.layer_idx, state.num_layers), queries=state.queries(module, query)))
        state.flag(module.layer_idx, out)
        if state.observer is not None:
            state.observer(module.layer_idx, probs)
        return out, probs
    return real_attention(state, module, query, key, value, attention_mask, scaling, LayerCall(
        window=window, softcap=softcap, sinks=sinks, queries=state.queries(module, query)))


def new_valid(attention_mask, query) -> torch.Tensor:
    """(B, q) bool: the non-pad new columns. Read on the mask's diagonal over the new columns (a token sees
    itself, a pad never; the last row would miss the columns a sliding-window mask hides from it)."""
    B, _, q, _ = query.shape
    if attention_mask is None:
        return torch.ones(B, q, dtype=torch.bool, device=query.device)
    return attention_mask[:, 0, -q:, -q:].diagonal(dim1=-2, dim2=-1).bool()


ROWS = 256  # query rows per block in a prefill: bounds the (B, Hkv, G, rows, S) fp32 scores
FUSED_PREFILL = True  # False: the blocked eager loop serves every prefill (to measure the fused path against it)


def real_attention(state, module, query, key, value, attention_mask, scaling, call: LayerCall):
    """query (B, Hq, q, D) against the evicting layer's slots (B, Hkv, S, D): the layer says what each block of
    query rows may see and takes their attention probabilities (:meth:`EvictingLayer.begin`, ``visible``,
    ``attended``, ``end_forward``); here the math. ``call`` (:class:`h2o.core.step.LayerCall`): ``window``, the
    layer's sliding window (the layer drops what leaves it); ``softcap``; ``sinks``: learned sink logits
    (:func:`masked_softmax`); ``queries``: the forward's queries with what turns them back before RoPE, for a policy
    that reads them (:mod:`h2o.core.prerope`)."""
    window, softcap, sinks, queries = call.window, call.softcap, call.sinks, call.queries
    if state.cache is None:
        raise PolicyError("mode='real' needs a cache: pass cache=h.new_cache() to the model")
    layer = state.cache.layers[module.layer_idx]
    if not layer.serves(key):
        raise RuntimeError("mode='real' needs the cache from h2o.core.attach(...).new_cache() passed to the model")
    B, Hq, q, D = query.shape
    key, value = layer.begin(key, value, q, lambda: new_valid(attention_mask, query), window, queries)
    # a prefill (chunk) in fp32: the fused kernel and the rule's statistics (half precision: the eager rows, as the
    # simulated path computes them; fused, a bf16 top-k selection flipped between the paths: 0.73 logit gap measured),
    # or in any dtype where the model was loaded with a flash kernel (its speed chosen over the paths' equality)
    own = own_kernel(module, state.own)
    if (q > 1 and FUSED_PREFILL and softcap is None and sinks is None
            and (query.dtype == torch.float32 or own is not None)):
        out = real_prefill(layer, query, key, value, scaling, window, own)  # (B, Hq, q, D)
        layer.end_forward(q)
        state.flag(module.layer_idx, out)  # on the contiguous layout: the same values, a faster reduction
        return out.transpose(1, 2), None
    qg = grouped(query, key.shape[1])  # (B, Hkv, G, q, D)
    outs = []
    for r in range(0, q, ROWS):
        logits = scores(qg if q <= ROWS else qg[..., r:r + ROWS, :], key, scaling, softcap)  # (B, Hkv, G, r, S)
        probs = masked_softmax(logits, layer.visible(logits, r), sinks)  # (B, Hkv, G, r, S)
        layer.attended(probs, r, logits)
        outs.append(grouped_values(probs if value.dtype == probs.dtype else probs.to(value.dtype), value))
    layer.end_forward(q)
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, -2)).view(B, Hq, q, D).transpose(1, 2)
    state.flag(module.layer_idx, out)  # NaN/inf guard: no host sync here; Attached.check_logits reads it per step
    return out, (probs.view(B, Hq, q, -1) if q <= ROWS else None)


AttentionInterface.register(NAME, h2o_attention)
AttentionMaskInterface.register(NAME, h2o_mask)
