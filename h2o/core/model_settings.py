"""What a model asks of its attention beyond queries, keys and values, checked when it is attached.

transformers passes these per layer to the attention function (:func:`h2o.core.attention.h2o_attention`):

* ``scaling`` (every model), ``softcap`` (Gemma-2's attention logit soft-capping) and ``s_aux`` (GPT-OSS's
  learned sink logits): honoured in both paths;
* ``sliding_window`` (Mistral, Gemma-2/3, Qwen2 with ``use_sliding_window``, GPT-OSS, Cohere2, ...): honoured,
  the policy applies to the tokens inside the layer's window (docs/attention.md);
* refused here in one line (``PolicyError``) before anything runs: chunked attention (Llama-4 ``attention_chunk_size``), bidirectional attention (Gemma-3
  ``use_bidirectional_attention``, ``is_causal=False``), attention dropout in training mode, and
  a whole-forward rule (the paper code's H2O mask, ``Policy.whole_forward``) on a model with sliding layers.
"""
from __future__ import annotations

from .policies import PolicyError


def layer_windows(modules) -> list[int | None]:
    """The sliding window of each attention module as its model passes it (the module's own ``sliding_window``,
    else its config's, as Mistral passes it), None for a global layer."""
    return [getattr(m, "sliding_window", getattr(m.config, "sliding_window", None)) or None for m in modules]


def refuse_unsupported(model, modules, policy) -> None:
    """PolicyError (one line naming the model type and the setting) for what the h2o attention does not do."""
    config = modules[0].config
    kind = getattr(config, "model_type", type(model).__name__)
    layer_types = getattr(config, "layer_types", None) or []
    refused = [
        (getattr(config, "attention_chunk_size", None) is not None or "chunked_attention" in layer_types,
         f"chunked attention (attention_chunk_size={getattr(config, 'attention_chunk_size', None)})"),
        (bool(getattr(config, "use_bidirectional_attention", False)) or not getattr(config, "is_causal", True),
         "bidirectional attention"),
        (model.training and bool(getattr(config, "attention_dropout", 0.0)),
         f"attention dropout {getattr(config, 'attention_dropout', 0.0)} in training mode (call model.eval())"),
    ]
    for bad, setting in refused:
        if bad:
            raise PolicyError(f"model_type={kind}: {setting} is not supported by the h2o attention; allowed: "
                              f"causal attention with optional sliding windows, logit soft-capping and sink logits")
    windows = [w for w in layer_windows(modules) if w is not None]
    if policy.whole_forward and windows:
        raise PolicyError(f"policy={policy.name}: the paper code's rule has no sliding window and model_type={kind} "
                          f"has sliding layers (window {windows[0]}); allowed: policy=h2o")
