"""kvzip: each cached key scored by the attention it receives while the model is asked to repeat the context
(KVzip, Kim et al., arXiv 2505.23416), so the cut does not depend on any question; as kvpress 0.5.5's
``KVzipPress`` defines it (its prompt, its chunking, its head and layer aggregation: :mod:`.kvzip_replay`).

Timing: ``prefill`` only (kvpress's). The prompt's forward keeps every token; once it has run, the context is
replayed (:func:`.kvzip_replay.score_context`: extra forwards after the prompt, about 1-2 prefills more) and
the cache is cut: one selection over every layer and KV head, so layers and heads hold uneven counts (stored
padded to a layer's largest head, :attr:`Policy.pooled`). Every later token is kept. ``budget``: a ratio of the
prompt, the share kept over all layers and heads (kvpress's ``compression_ratio`` is ``1 - budget``: it prunes
``int(numel * (1 - budget))``), or a token count kept per head on average (``layers x heads x (C - n)`` pruned).
Each sequence of a batch is scored alone (kvpress scores a batch of one); no sliding-window layers (kvpress refuses
Gemma-3).

The real path only: the score is a forward of other tokens after the prompt, which the simulated path's one-pass
mask over a sequence has no place for.
"""
from __future__ import annotations

import torch

from .base import NOTHING, Counts, PolicyError
from .prefill import PrefillOnly


class KVzip(PrefillOnly):
    name = "kvzip"
    reads = NOTHING  # from the prompt's forward: nothing (the replay's own forwards score it)
    pooled = True  # heads (and layers) hold uneven counts
    run_count_options = ("n_sink", "chunk_size")  # tokens: at most the model's positions
    real_only = ("it scores the context by replaying it after the prompt (extra forwards), which the simulated "
                 "path's one-pass mask cannot hold")

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, n_sink: int = 4,
                 chunk_size: int = 2048, layerwise: bool = False):
        super().__init__(budget, heavy, recent, heavy_share)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise PolicyError(f"n_sink={n_sink!r}: the first tokens always kept must be an int >= 0")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise PolicyError(f"chunk_size={chunk_size!r}: the context tokens per replay must be an int >= 1")
        if not isinstance(layerwise, bool):
            raise PolicyError(f"layerwise={layerwise!r}: expected true or false")
        self.n_sink, self.chunk_size, self.layerwise = n_sink, chunk_size, layerwise

    def keep(self, prio, pos, valid, counts: Counts, arriving=None) -> torch.Tensor:
        """The prompt's own cut keeps everything: the replay's cut follows the forward (:meth:`attach_hooks`)."""
        return valid

    def attach_hooks(self, model, state) -> list:
        """After the first forward of each evicting cache (its prompt): the replay, then the cut."""
        from .kvzip_replay import load_tokenizer

        tokenizer = load_tokenizer(model)

        def after(_module, args, kwargs, _output):
            cache = state.cache
            if cache is None or getattr(cache, "kvzip_scored", False):
                return
            cache.kvzip_scored = True
            ids = kwargs.get("input_ids", args[0] if args else None)
            modules = [m for m in model.modules() if hasattr(m, "h2o")]  # the attention modules
            self.compress_cache(model, modules, cache, ids, tokenizer)

        return [model.register_forward_hook(after, with_kwargs=True)]

    def compress_cache(self, model, modules, cache, ids: torch.Tensor | None, tokenizer) -> None:
        """Score the prompts ``ids`` (B, T) held whole in ``cache`` by their replays and cut every layer. Each
        sequence is scored alone, as kvpress scores a batch of one: its real tokens (slots with ``pos >= 0``, in
        position order; left pads excluded) are its context."""
        from ..model_settings import layer_windows
        from .kvzip_replay import score_context

        if ids is None:
            raise PolicyError("policy=kvzip: the prompt's forward gave no input_ids to replay; allowed: input_ids")
        if any(w is not None for w in layer_windows(modules)):
            raise PolicyError("policy=kvzip: the model has sliding-window layers, where the replay's scores have no "
                              "meaning (kvpress refuses Gemma-3); allowed: a model with global attention only")
        positions = cache.positions()  # per layer (B, Hkv, S)
        keep = [p >= 0 for p in positions]  # each layer's held slots, less what the replays drop
        share = isinstance(self.budget, float)
        for b in range(ids.shape[0]):
            real = positions[0][b, 0] >= 0  # (S,) the sequence's slots, in position order
            context = ids[b, -real.shape[0]:][real].tolist()
            held = [tuple(x[b:b + 1][:, :, real] for x in layer.read()) for layer in cache.layers]  # (1, Hkv, C, D)
            scorer = score_context(model, modules, held, context, tokenizer, self.n_sink, self.chunk_size)
            gone = scorer.pruned(1 - self.budget if share else None, None if share else self.budget, self.layerwise)
            for pos, kept, lost in zip(positions, keep, gone):  # lost (1, Hkv, C) by position
                kept[b] &= ~lost[0].gather(-1, pos[b].clamp(min=0))
        cache.keep_only(keep)

    def describe(self):
        return {**super().describe(), "n_sink": self.n_sink, "chunk_size": self.chunk_size,
                "layerwise": self.layerwise}
