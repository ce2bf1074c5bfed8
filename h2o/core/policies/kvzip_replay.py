"""KVzip's context reconstruction (:mod:`.kvzip`): the replay forwards that score the context's keys, and the
selection over all layers and KV heads, as kvpress 0.5.5's ``KVzipPress`` computes them (read from its source).

Replay: the context less its first ``prefix`` tokens (the chat template's text before the user's content, when the
tokenizer has a template; kvpress's pipeline puts the context there) is cut into chunks of ``chunk_size`` tokens.
Chunk ``i`` is replayed as one forward after the context, at the positions that follow it: a prompt ("Repeat the
previous context exactly." for the first chunk; "Repeat the part of the previous context exactly, starting with"
then the previous chunk's last 8 tokens for the others), the template's text after the user's content ("\\n"
without a template), then the chunk itself. Each replay sees the whole context and itself (plain attention; its
tokens are dropped afterwards).

Score, per layer and replay: the replay's queries (after RoPE) against a subset of the keys -- the first
``min(n_sink, start)`` context keys, the chunk's own context keys, and the replay's keys (causal among
themselves) -- a softmax over that subset only, scaled by ``1 / sqrt(head size)``; a context key's score is its
largest probability over the replay's queries and its KV head's query heads. Keys of no chunk (the prefix) score 0.

Selection: the first ``n_sink`` context keys get the largest score + 1 (always kept); then the ``n`` lowest scores
over every layer, KV head and position are the pruned share (``n = int(numel * (1 - share kept))``; kvpress's
``topk`` of the negated scores), which gives each layer its count; each layer then prunes its own lowest scores
over its heads by that count (``layerwise``: each layer the same count). So layers and heads hold uneven counts.
"""
from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .base import PolicyError

CAPTURE = "h2o_kvzip_replay"
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that a later chunk's prompt ends with


def template_parts(tokenizer) -> tuple[int, list[int]]:
    """(tokens of the chat template before the user's content, ids of the text after it) -- kvpress's split of a
    dummy conversation; (0, ids of "\\n") without a template."""
    if tokenizer.chat_template is None:
        prefix, suffix = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        head, suffix = text.split(separator)
        prefix = head.split(dummy)[0]
    return (len(tokenizer.encode(prefix, add_special_tokens=False)),
            tokenizer.encode(suffix, add_special_tokens=False))


def replays(tokenizer, context: list[int], prefix: int, suffix: list[int], chunk_size: int
            ) -> list[tuple[int, int, list[int]]]:
    """(start, end, replay ids) per chunk: the chunk is ``context[start:end]``."""
    out = []
    for start in range(prefix, len(context), chunk_size):
        ask = tokenizer.encode(FIRST if start == prefix else LATER, add_special_tokens=False)
        ask += context[max(start - OVERLAP, start - chunk_size, prefix):start]  # the previous chunk's last OVERLAP
        end = min(start + chunk_size, len(context))
        out.append((start, end, ask + suffix + context[start:end]))
    return out


class Scorer:
    """The scores (layers, 1, Hkv, C) of one context, filled replay by replay (:meth:`observe`)."""

    def __init__(self, layers: int, heads: int, context: int, n_sink: int, dtype, device):
        self.score = torch.zeros(layers, 1, heads, context, dtype=dtype, device=device)
        self.n_sink, self.start, self.end = n_sink, 0, 0

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """query (1, Hq, q, D) the replay's, after RoPE; key (1, Hkv, C + q, D) the context's and the replay's."""
        B, Hq, q, D = query.shape
        H = key.shape[1]
        sink = min(self.n_sink, self.start)
        n = self.end - self.start
        keys = torch.cat([key[:, :, :sink], key[:, :, self.start:self.end], key[:, :, -q:]], dim=2)
        logits = torch.matmul(query.view(B, H, Hq // H, q, D), keys.unsqueeze(2).transpose(-2, -1)) / math.sqrt(D)
        causal = torch.full((q, q), torch.finfo(logits.dtype).min, device=logits.device).triu(1)  # above the diagonal
        logits[..., -q:, -q:] += causal
        probs = torch.softmax(logits, dim=-1)  # (1, H, G, q, sink + n + q)
        self.score[layer][..., self.start:self.end] = probs[..., sink:sink + n].amax(dim=(-3, -2))

    def pruned(self, ratio: float | None, per_head: int | None, layerwise: bool) -> list[torch.Tensor]:
        """Each layer's pruned (head, position) pairs as (1, Hkv, C) bool: ``ratio`` the share removed, or
        ``per_head`` the tokens kept per head (a token-count budget)."""
        score = self.score
        score[..., :self.n_sink] = score.amax() + 1.0
        L, B, H, C = score.shape
        per_layer = B * H * C
        if layerwise or per_head is not None:
            n = int(per_layer * ratio) if per_head is None else B * H * max(C - per_head, 0)
            counts = [n] * L
        else:
            drop = torch.topk(-score.reshape(-1), int(score.numel() * ratio)).indices
            counts = torch.bincount(drop // per_layer, minlength=L).tolist()
        out = []
        for layer, n in enumerate(counts):
            idx = torch.topk(-score[layer].reshape(B, -1), n, dim=1).indices  # (1, n) over heads x positions
            gone = torch.zeros(B, H * C, dtype=torch.bool, device=score.device)
            out.append(gone.scatter_(1, idx, True).view(B, H, C))
        return out


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The replay's attention: plain sdpa, and the layer's scores to the scorer the module holds."""
    module.kvzip_scorer.observe(module.layer_idx, query, key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(CAPTURE, capture_attention)
AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def score_context(model, modules, keys_values, context: list[int], tokenizer, n_sink: int, chunk_size: int
                  ) -> Scorer:
    """The replays of ``context`` after its keys and values ``keys_values`` [(1, Hkv, C, D) x 2 per layer], through
    the model's decoder with plain attention (its attention function restored after). Returns the filled scorer."""
    from transformers import DynamicCache

    prefix, suffix = template_parts(tokenizer)
    k0 = keys_values[0][0]
    scorer = Scorer(len(keys_values), k0.shape[1], len(context), n_sink, model.dtype, k0.device)
    decoder = getattr(model, "model", None) or model.base_model
    previous = model.config._attn_implementation
    for m in modules:
        m.kvzip_scorer = scorer
    model.set_attn_implementation(CAPTURE)
    try:
        for start, end, ids in replays(tokenizer, context, prefix, suffix, chunk_size):
            cache = DynamicCache()
            for layer, (k, v) in enumerate(keys_values):
                cache.update(k, v, layer)
            scorer.start, scorer.end = start, end
            decoder(input_ids=torch.tensor([ids], device=k0.device), cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
        for m in modules:
            del m.kvzip_scorer
    return scorer


def load_tokenizer(model):
    """kvpress's: the tokenizer of ``model.config.name_or_path`` (this machine's files only)."""
    from transformers import AutoTokenizer

    path = model.config.name_or_path
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise PolicyError(f"policy=kvzip: replays the context with the model's tokenizer, and none loads from "
                          f"{path!r} ({type(e).__name__}); allowed: a model folder with its tokenizer") from None
