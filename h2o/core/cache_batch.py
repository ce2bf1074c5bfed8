"""The evicting cache's batch operations: transformers' hooks for ``generate`` (beam search reorders the batch at
every step, ``num_return_sequences`` repeats it, some callers keep part of it) and the fork of a prefill. The
whole layer state moves with its sequence: keys, values, positions, scores, token counts, the budget (on the
device and on the host), the quantizer's sink; a decoder's state is rebuilt from it at the next step (it makes
the same decisions, by its contract: :class:`h2o.core.policies.base.Decoder`). Mixed into
:class:`h2o.core.cache.EvictingLayer` and :class:`~h2o.core.cache.EvictingCache`.
"""
from __future__ import annotations

import copy

import torch

from .policies import Counts, PolicyError
from .rerotate import KeyRerotation


class BatchHooks:
    """The layer's batch operations (state shapes: :mod:`h2o.core.cache`)."""

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: sequence b continues beam ``beam_idx[b]`` (B,) int64. No host sync when every sequence
        has the same host counts (beams of one prompt, or an unpadded batch); else one, to reorder them."""
        self.select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence ``repeats`` times in a row (``num_return_sequences``, contrastive search)."""
        if self.keys is not None:
            self.batch_select_indices([b for b in range(self.n_tok.shape[0]) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        """Keep the sequences ``indices`` (a list or a (B',) int64 tensor) of the batch, in that order."""
        if self.keys is not None:
            host = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
            self.select_batch(torch.as_tensor(host, device=self.n_tok.device), host)

    def select_batch(self, idx: torch.Tensor, host: list[int] | None = None) -> list[int] | None:
        """Sequence b of the batch becomes sequence ``idx[b]`` (B',) of the old one, on the device and in the host
        counts (``host``: idx as a list; None: read from idx where the host counts differ between sequences).
        A decoder's state is rebuilt from the state at the next step (the same decisions, by its contract).
        Returns ``host`` (as read, if it was), so that the next layer does not read it again."""
        if self.keys is None:
            return host
        self.fullest()
        if getattr(self.policy, "per_sequence", False):
            raise PolicyError(f"policy={self.policy.name}: one policy per sequence; its batch cannot be reordered")
        pick = lambda t: t.index_select(0, idx.to(t.device))  # noqa: E731
        self.keys, self.values, self.pos, self.acc, self.n_tok = map(pick, (self.keys, self.values, self.pos,
                                                                           self.acc, self.n_tok))
        if self.sink is not None:
            self.sink, self.sink_real = (pick(self.sink[0]), pick(self.sink[1])), pick(self.sink_real)
        if self.counts is not None:
            self.counts = self.counts.map(pick)
        lists, n = (self.host_tok, self.host_held, self.host_total, self.below), idx.shape[0]
        alike = all(len(set(x)) <= 1 for x in lists) and (self.host_counts is None or all(
            bool((x == x[0]).all()) for x in self.host_counts.fields()))  # CPU tensors: no device read
        if alike:  # every sequence the same on the host: nothing to read
            rows = [0] * n
        else:
            host = rows = idx.tolist() if host is None else host  # one host sync
        self.host_tok, self.host_held, self.host_total, self.below = ([x[b] for b in rows] if x else [] for x in lists)
        if self.host_counts is not None:
            self.host_counts = self.host_counts.map(lambda x: x[torch.tensor(rows)])
        if self.counts is not None:
            self.counts.host = self.host_counts
        self.room, self.room_list, self.zero, self.decoder = None, [], None, None
        return host

    def copy(self) -> "EvictingLayer":
        """A copy sharing nothing it changes (:func:`duplicate`); a decoder rebuilt at the next step (the same
        decisions, by its contract)."""
        self.fullest()
        new = copy.copy(self)
        vars(new).update({k: duplicate(v) for k, v in vars(self).items()}, decoder=None, served=None)
        if new.counts is not None:
            new.counts.host = new.host_counts
        return new

    def fork(self, src: "EvictingLayer") -> None:
        """Become what this layer's policy holds after the prefill that ``src`` (a layer of a full-policy cache,
        one unpadded prompt, nothing evicted) saw: its keys, values, positions and scores copied (packed where
        this layer quantizes), the budget fixed, then the cut a prefill ends with. The prefill is full attention
        under every policy, so the cut sees the same keys and scores as a real prefill of this policy."""
        if self.policy.new_state(1, 1, 1, src.acc.device).shape[3:] != src.acc.shape[3:]:
            raise PolicyError(f"policy={self.policy.name}: keeps its own state per slot, which a prefill through "
                              f"the full cache does not make; allowed: its own prefill (prefill=each)")
        self.seen, self.n_new, self.window = src.seen, 0, src.window
        self.pos, self.acc, self.n_tok = src.pos.clone(), src.acc.clone(), src.n_tok.clone()
        if self.quant is None:
            self.keys, self.values = src.keys.clone(), src.values.clone()
        else:  # the prompt's keys and values as the quantized cache stores them
            self.kv_dtype = src.keys.dtype
            self.keys, self.values = self.quant.pack_kv(src.keys, src.values, self.layer_idx, 0)
            if self.quant.sink:  # position 0 kept as computed (slot 0: the prompt is unpadded)
                self.sink = (src.keys[..., :1, :].clone(), src.values[..., :1, :].clone())
                self.sink_real = src.pos[:, 0, 0] == 0
        # the host counts and the budget from the copied state (one host sync)
        self.host_tok = self.n_tok.tolist()
        self.host_held = (self.pos[:, 0] >= 0).sum(-1).tolist()
        self.fix_budget()
        self.prompt_ends()


class CacheBatchHooks:
    """The cache's: each layer's, with what is read to the host read once for all layers."""

    def copy(self) -> "EvictingCache":
        """A copy sharing nothing it changes (:meth:`EvictingLayer.copy`): a compressed prompt asked apart."""
        new = copy.copy(self)
        new.layers = [layer.copy() for layer in self.layers]
        return new

    def figures(self) -> dict:
        """Per sequence, from the host counts: ``budget`` (layer 0's) and ``held`` (summed over layers, per KV head)."""
        held = [layer.fullest() for layer in self.layers if layer.host_held]
        return {"budget": list(self.layers[0].host_total), "held": [sum(col) for col in zip(*held)]}

    def positions(self) -> list[torch.Tensor]:
        """Per layer, (B, Hkv, S) int64 the position of the token each slot holds (-1: none), a copy."""
        return [layer.pos.clone() for layer in self.layers]

    def keep_only(self, keep: list[torch.Tensor]) -> None:
        """Each layer keeps the slots ``keep[layer]`` (B, Hkv, S) bool (:meth:`positions`' slots) and frees the rest:
        a cut a rule decides itself (kvzip's replay)."""
        for layer, kept in zip(self.layers, keep):
            layer.keep_only(kept)

    def host_tensors(self) -> list[torch.Tensor]:
        """The tensors the cache keeps on the host on every device (its host counts, a pooled layer's count on its
        way): reading them is no device sync."""
        return [x for layer in self.layers if layer.host_counts is not None
                for x in (*layer.host_counts.fields(), layer.fullest_buf) if x is not None]

    def fork(self, src: "EvictingCache", batch: int = 1) -> "EvictingCache":
        """This (new) cache as its policy holds ``src``'s prefill (:meth:`EvictingLayer.fork`), repeated to
        ``batch`` sequences after the cut (a large batch never holds the whole prompt ``batch`` times)."""
        for layer, s in zip(self.layers, src.layers):
            layer.fork(s)
        if batch > 1:
            self.batch_repeat_interleave(batch)
        return self

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search (:meth:`EvictingLayer.reorder_cache`): beam_idx read to the host at most once per step."""
        host = None
        for layer in self.layers:
            host = layer.select_batch(beam_idx, host)

    def batch_select_indices(self, indices) -> None:
        """Keep the sequences ``indices`` of the batch (the indices read to the host once, not per layer)."""
        host = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        for layer in self.layers:
            layer.batch_select_indices(host)


def duplicate(x):
    """A layer's field as :meth:`BatchHooks.copy` copies it; the policy, the quantizer, numbers as they are."""
    if isinstance(x, (torch.Tensor, Counts)):
        return x.clone() if isinstance(x, torch.Tensor) else x.map(torch.clone)
    if isinstance(x, (list, tuple)):
        return type(x)(duplicate(v) for v in x)
    if isinstance(x, KeyRerotation):
        out = copy.copy(x)
        vars(out).update(prev=duplicate(x.prev), entered=duplicate(x.entered))
        return out
    return x
