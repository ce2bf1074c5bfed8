"""Real path: a transformers ``Cache`` whose layers physically hold at most the budget of keys and values.

Protocol (the paper's generation protocol): the prompt is prefilled with full attention; the layer then keeps the
budget (``policy.counts`` of the prompt's length, fixed from then on) and frees the rest. At each decoding step,
if the cache is full, the slot of the token the policy drops (:func:`h2o.core.policies.select_slot`) is overwritten in
place by the arriving token: no shift, no re-gather. A later multi-token forward is a prefill chunk: it attends to
the cache and itself causally, then the cache is cut back to the budget (chunked prefill).

Per-layer state (S = slots, ``budget`` once full; the largest budget of the batch when sequences differ):
    keys, values (B, Hkv, S, D)   pos (B, Hkv, S) int64 (-1: empty or pad)   acc (B, Hkv, S) fp32 (or per
    slot (B, Hkv, S, ...): Policy.new_state)
    n_tok (B,) int64 tokens of each sequence seen (pads excluded)            counts: budget per sequence
``get_seq_length`` reports the logical length (tokens seen, pads included), so positions stay right.

Host copies of the counts (tokens seen, slots held, budget per sequence) decide where a decoding token goes: no host
sync in a decoding step (a prefill counts its tokens, one per layer). A decoding token is never a pad.

Sliding-window layers (``window``): what leaves the window goes before the policy decides, whose budget applies
inside it (docs/attention.md); the heads then differ, so such a layer decides on the device
(:meth:`EvictingLayer.step_in`, the one decoding step of every layer), the host keeping an upper bound of the slots held.
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .policies import Counts, Policy, PolicyError
from .policies.base import bcast
from .cache_batch import BatchHooks, CacheBatchHooks
from .cache_cut import CutHooks
from .rerotate import KeyRerotation, KeyShifter, held_alike
from .masks import serial
from . import step


class EvictingLayer(BatchHooks, CutHooks, DynamicLayer):
    def __init__(self, policy: Policy, ref_len: int | None = None, quant=None, layer_idx: int = 0,
                 rerotate: KeyShifter | None = None, num_layers: int = 1):
        super().__init__()
        self.policy = policy
        # positions inside the cache (h2o.core.rerotate): the held keys renumbered after each forward's eviction
        self.rerotation = KeyRerotation(rerotate) if rerotate is not None else None
        self.tok_before: list[int] = []  # per sequence: tokens seen before the current forward
        self.quant, self.layer_idx = quant, layer_idx  # quant: slots hold packed rows (h2o.core.quant)
        self.num_layers = num_layers  # the model's layers (a per-layer budget, Policy.layer_counts)
        self.served = None  # quant: weak reference to the last keys handed out by update
        # quant.sink: the first real token's (key, value) as computed (B, Hkv, 1, D), sink_real (B,) whether the
        # sequence has one; fresh: the first forward's keys and values until its pads are known (capture_sink)
        self.sink = self.sink_real = self.fresh = None
        self.ref_len = ref_len  # reference length of the budget; default: the prefill's tokens
        self.pos = self.acc = self.n_tok = None
        self.counts: Counts | None = None
        self.decoder = None  # the policy's priority at decoding steps (Policy.decoder), made once the budget is fixed
        self.host_counts: Counts | None = None  # the budget on the host (CPU tensors)
        self.host_tok: list[int] = []  # per sequence on the host: tokens seen, slots held, budget
        self.host_held: list[int] = []
        self.host_total: list[int] = []
        self.room: torch.Tensor | None = None  # (B,) bool on the device: below budget (rebuilt when it changes)
        self.room_list: list[bool] = []
        self.seen = 0  # columns seen, pads included
        self.n_new = 0  # columns appended by the last update (0 for a decoding step)
        self.zero: torch.Tensor | None = None  # (B, Hkv, 1, ...) the state of a new slot (Policy.new_state)
        self.window: int | None = None  # the layer's sliding window (None: a global layer)
        # the current forward (begin): its new tokens, their non-pad columns (B, q) (None: a decoding token), the
        # held slots (B, Hkv, 1, 1, S) bool (None: every slot)
        self.q, self.valid, self.held = 0, None, None
        self.compressed = False  # Policy.compress "prefill": the first forward's cut is done
        self.generated = 0  # decoding tokens since the last prompt (chunk): the schedule's cuts (compress=interval)
        self.below: list[int] = []  # per sequence: the room the prompt's cut left below the budget (cuts_after)
        self.queries = None  # Policy.reads_queries: the prompt's query statistics, from its forward to its cut
        self.sent = self.fullest_buf = None  # pooled: the largest head's count on its way to the host (fullest)

    # ----------------------------------------------------------------- transformers API
    def update(self, key_states, value_states, *args, **kwargs):
        """key/value_states (B, Hkv, q, D). Returns the stored (B, Hkv, S, D) tensors."""
        q = key_states.shape[-2]
        self.tok_before = self.host_tok or [0] * key_states.shape[0]
        self.fullest()  # a pooled layer's last decoding step: its count in, its slots shrunk
        if self.quant is not None:  # quant: store packed rows (B, Hkv, q, P) uint8 instead of the tensors
            self.kv_dtype = key_states.dtype
            if self.quant.sink and self.seen == 0:
                self.fresh = (key_states, value_states)
            key_states, value_states = self.quant.pack_kv(key_states, value_states, self.layer_idx, self.seen)
        if self.keys is None or q > 1:
            self.append(key_states, value_states)
        else:  # a decoding step: one real token in
            self.step_in(key_states, value_states)
            self.n_tok += 1
            self.host_tok = [n + 1 for n in self.host_tok]
            self.n_new = 0
        self.seen += q
        return self.read()

    def read(self):
        """The (B, Hkv, S, D) keys and values attention uses: as held, or decoded from packed rows (quant)."""
        if self.quant is None:
            return self.keys, self.values
        keys, values = self.quant.unpack_kv(self.keys, self.values, self.layer_idx, self.kv_dtype)
        if self.sink is not None:  # the slot holding position 0 (if still held) reads the sink as computed
            keys, values = self.quant.put_sink(keys, values, self.sink, (self.pos == 0) & self.sink_real[:, None, None])
        self.served = weakref.ref(keys)
        return keys, values

    def serves(self, key) -> bool:
        """Whether ``key`` is what this layer's last update returned (the model was given this cache)."""
        return key is self.keys or (self.served is not None and self.served() is key)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask transformers builds covers only the new columns (causal + padding among them); the cached part
        # is described by ``pos`` and masked by the attention function.
        return query_length, self.seen

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be cropped (no assisted decoding)")  # abstract: n/a

    # --------------------------------------------- the attention function's protocol
    # One forward of ``q`` new tokens, per layer: ``begin`` (the new columns' pads known), then per block of query
    # rows ``visible`` (what they may see) and ``attended`` (their attention probabilities), then ``end_forward``.
    # Only the layer reads its positions, scores, budget and slots; the attention function does the math.
    def begin(self, key, value, q: int, valid_of, window: int | None = None, queries=None):
        """The forward's ``q`` new tokens are in (``update``); ``valid_of()`` gives (B, q) bool their non-pad
        columns (read only where needed: a decoding token is never a pad). ``window``: the layer's sliding
        window (None: global); ``queries``: the forward's queries with what turns them back before RoPE
        (:class:`h2o.core.prerope.Queries`, a policy that reads them). Registers the new positions (the budget is
        fixed on the first forward), keeps a prompt's query statistics for its cut, and returns the keys and
        values (B, Hkv, S, D) to attend to."""
        self.window, self.q = window, q  # known from the first forward (a prefill or first token: appended)
        self.valid = valid_of() if self.n_new or q > 1 else None  # (B, q); decoding: all valid
        if self.n_new:
            self.register_new(self.valid[:, -self.n_new:])
        if queries is not None and q > 1 and self.limited():  # the prompt's queries, pads excluded (pos -1)
            self.queries = self.policy.query_stats(queries, q, self.pos[:, 0, -q:], self.n_tok)
        if self.fresh is not None:  # quant.sink, the first forward: its first real token kept as computed
            key, value = self.capture_sink(key, value, self.valid)
        B, S = key.shape[0], key.shape[-2]
        every = window is None and not self.policy.pooled and all(h == S for h in self.host_held)  # all held
        self.held = None if every and q == 1 else (self.pos >= 0).view(B, -1, 1, 1, S)  # (B, Hkv, 1, 1, S)
        return key, value

    def visible(self, logits: torch.Tensor, r: int) -> torch.Tensor | None:
        """What query rows r.. of this forward may see: logits (B, Hkv, G, rows, S) fp32 -> bool broadcastable to
        them (None: every slot). A prefill (chunk) row sees the held slots and the new columns up to itself (and
        within the window); a decoding row what the policy holds, or restricts to (top-k)."""
        q = self.q
        if q > 1:
            rows = logits.shape[-2]
            stop = r + rows - q
            row_pos = self.pos[:, :, None, -q + r:(stop if stop < 0 else None), None]  # (B, Hkv, 1, rows, 1)
            key_pos = self.pos[:, :, None, None, :]  # (B, Hkv, 1, 1, S)
            allowed = self.held & (key_pos <= row_pos)
            if self.window is not None:
                allowed &= key_pos > row_pos - self.window
            return allowed
        if not self.policy.evicts and not self.policy.is_full:
            B, S = logits.shape[0], logits.shape[-1]
            return self.decoding().restrict(logits, self.acc.view(B, -1, 1, 1, S), self.held)
        return self.held

    def attended(self, probs: torch.Tensor, r: int, logits: torch.Tensor | None = None) -> None:
        """The attention probabilities (B, Hkv, G, rows, S) of query rows r.. (as :meth:`visible` allowed) into
        the scores; pad rows add nothing. ``logits``: the rows' logits, given instead to a rule that reads them
        (``Policy.reads_logits``)."""
        logit_rule = self.policy.reads_logits
        if self.q > 1:
            rows = probs.shape[-2]
            valid = self.valid[:, r:r + rows]  # (B, rows)
            at = self.pos.shape[-1] - self.q + r
            left = (self.n_tok - 1)[:, None] - self.pos[:, 0, at:at + rows]  # (B, rows) tokens after each row
            rows_in = logits if logit_rule else probs if self.unpadded() else probs * valid[:, None, None, :, None]
            self.policy.accumulate_prompt(self.acc, rows_in, valid, left)
        elif self.policy.needs_scores:  # a decoding token is never a pad
            self.policy.accumulate(self.acc, logits if logit_rule else probs)

    # ------------------------------------------------------------------------- storage
    def append(self, key_states, value_states):
        B, H, q, _ = key_states.shape
        empty_pos = torch.full((B, H, q), -1, dtype=torch.long, device=key_states.device)
        empty_acc = self.policy.new_state(B, H, q, key_states.device)
        if self.keys is None:
            self.keys, self.values, self.pos, self.acc = key_states, value_states, empty_pos, empty_acc
            self.n_tok = torch.zeros(B, dtype=torch.long, device=key_states.device)
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.pos, self.acc = torch.cat([self.pos, empty_pos], -1), torch.cat([self.acc, empty_acc], 2)
        self.n_new = q
        if self.decoder is not None:  # new slots: a decoder's state is rebuilt at the next step
            self.decoder.reset()

    def step_in(self, key_states, value_states):
        """One decoding token (a real token, never a pad), in one order on every layer: what left the sliding window
        goes; the slots each sequence holds with the token in (:meth:`held_after_step`, on the host) say whether the
        storage takes a new slot; the token goes into the slot the rule frees (:func:`step.evict_slot`: a rule that
        evicts at each step) or an empty one; a pooled layer (:attr:`Policy.pooled`, Ada-KV: the heads share the
        budget) is then cut back to its budget, the token kept (:func:`step.pool_keep`), and its slots shrink to the
        largest head's count. On a global layer a token that needs a new slot in some sequence takes the new slot
        in every sequence (:meth:`grow`: no slot is searched)."""
        # whether the token evicts one held token when the budget is full (the schedule ``decode``; under ``prefill``
        # and ``interval`` it takes a new or empty slot, :mod:`h2o.core.schedule`)
        evicts = self.limited() and self.policy.schedule.evicts_each_step
        pooled = evicts and self.policy.pooled
        if self.window is not None:  # what left the window is gone before the policy decides
            step.expire_slots(self.pos, self.n_tok, self.window)
        bound, S = self.held_after_step(evicts, pooled), self.keys.shape[-2]
        if self.window is None and not pooled and (not evicts or max(bound) > S):
            return self.grow(key_states, value_states)
        if max(bound) > S:  # some sequence may need one more slot: an empty one (pos -1), filled below
            self.append(key_states, value_states)
        with serial(key_states.device):  # tiny bookkeeping ops: one thread is faster
            slot = self.freed_slot() if evicts and not pooled else (self.pos < 0).byte().argmax(-1, keepdim=True)
        self.place(slot, key_states, value_states)  # slot (B, H, 1)
        self.host_held = bound
        if pooled:
            with serial(key_states.device):
                arriving = self.pos == bcast(self.n_tok)
                a = self.arrival(self.pos >= 0, None, None if not self.policy.reads_keys else ~arriving)
                keep = step.pool_keep(self.policy, a, self.counts, arriving)  # (B, H, S)
            self.pool_compact(keep, True)

    def place(self, slot, key_states, value_states):
        """The arriving token (keys/values (B, H, 1, D or row bytes)) into ``slot`` (B, H, 1): stored here, its
        position and a fresh score by :func:`step.place`."""
        slot4 = slot.view(*slot.shape, 1)
        idx = slot4.expand(key_states.shape)  # (B, H, 1, D or row bytes)
        self.keys.scatter_(-2, idx, key_states)
        if value_states.shape != key_states.shape:  # quantized rows of keys and values can differ in width
            idx = slot4.expand(value_states.shape)
        self.values.scatter_(-2, idx, value_states)
        # one position for the whole batch: a scalar, no index tensor
        step.place(self.pos, self.acc, slot, self.host_tok[0] if len(set(self.host_tok)) == 1 else self.n_tok)

    def limited(self) -> bool:
        """Whether the budget can drop a token (an evicting policy below 100%, not compressed once already)."""
        return self.policy.evicts and not self.policy.is_full and not self.compressed

    def grow(self, key_states, value_states):
        """One arriving token (a real token, never a pad) in a new slot: a policy that keeps every token, or below
        budget with no empty slot. Its position and zero score are appended as they are (no registration)."""
        B, H = key_states.shape[:2]
        if self.zero is None or self.zero.shape[:2] != (B, H):
            self.zero = self.policy.new_state(B, H, 1, self.acc.device)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.pos = torch.cat([self.pos, self.n_tok.view(-1, 1, 1).expand(B, H, 1)], -1)
        self.acc = torch.cat([self.acc, self.zero], 2)
        self.host_held = [h + 1 for h in self.host_held]
        if self.decoder is not None:  # a new slot: a decoder's state is rebuilt at the next step
            self.decoder.reset()

    def register_new(self, valid_new: torch.Tensor):
        """Positions of the ``n_new`` appended columns; valid_new (B, q) bool. Fixes the budget on first call.
        A single new column (decoding) is a real token; a prefill chunk counts its tokens (one host sync)."""
        pos_new = torch.where(valid_new, self.n_tok[:, None] + valid_new.long().cumsum(-1) - 1, -1)
        self.pos[..., -valid_new.shape[1]:] = pos_new[:, None, :]
        new = [1] * valid_new.shape[0] if valid_new.shape[1] == 1 else valid_new.sum(-1).tolist()
        self.n_tok += valid_new.sum(-1) if valid_new.shape[1] > 1 else 1
        self.host_tok = [n + k for n, k in zip(self.host_tok or [0] * len(new), new)]
        self.host_held = [h + k for h, k in zip(self.host_held or [0] * len(new), new)]
        if self.counts is None:
            self.fix_budget()

    def capture_sink(self, keys, values, valid: torch.Tensor):
        """The first forward (quant.sink), positions registered: keep each sequence's first real token (valid
        (B, q) bool, the non-pad columns) as computed and put it into the keys/values (B, Hkv, S, D) read."""
        first = valid.long().argmax(-1)[:, None, None, None]  # (B, 1, 1, 1) column of position 0
        self.sink = tuple(x.gather(-2, first.expand(-1, x.shape[1], 1, x.shape[-1])) for x in self.fresh)
        self.sink_real, self.fresh = valid.any(-1), None
        return self.quant.put_sink(keys, values, self.sink, (self.pos == 0) & self.sink_real[:, None, None])

    def fix_budget(self):
        """The budget per sequence (on the host, then copied once) from the tokens seen, or ``ref_len``."""
        ref = self.host_tok if self.ref_len is None else [self.ref_len] * len(self.host_tok)
        counts = self.policy.layer_counts(self.policy.counts(torch.tensor(ref)), self.layer_idx, self.num_layers)
        self.host_total, self.host_counts, self.decoder = counts.total.tolist(), counts, None
        self.counts = counts.map(lambda x: x.to(self.n_tok.device, copy=True))  # a copy: apart on the CPU too
        self.counts.host = counts  # what a rule reads as numbers: no device read

    def end_forward(self, q: int) -> None:
        """After the attention of a forward of ``q`` new tokens: a prefill (chunk) is cut back to the budget; with
        positions inside the cache, the held keys are renumbered (:class:`h2o.core.rerotate.KeyRerotation`)."""
        if q > 1 or self.seen == q:  # a prompt (chunk), or the first forward: the schedule counts from its end
            self.prompt_ends(cut=q > 1)
        else:
            self.scheduled_cut()
        if self.rerotation is not None:
            tok = self.tok_before
            first_new = tok[0] if len(set(tok)) == 1 else torch.tensor(tok)
            held = self.host_held[0] if self.window is None and len(set(self.host_held)) == 1 else None  # exact
            self.keys.copy_(self.rerotation.renumber(self.pos, self.keys, first_new, held))

    def nbytes(self) -> int:
        """Bytes of the keys and values held (quant: the packed rows: codes, scales, outliers, indices; the sink)."""
        self.fullest()
        sink = 0 if self.sink is None else self.sink[0].nbytes + self.sink[1].nbytes
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes + sink


class EvictingCache(CacheBatchHooks, Cache):
    """One :class:`EvictingLayer` per decoder layer. Use through :func:`h2o.core.attach` (mode="real")."""

    def __init__(self, policy: Policy, num_layers: int, ref_len: int | None = None, quant=None,
                 rerotate: KeyShifter | None = None):
        """``rerotate``: positions inside the cache (:mod:`h2o.core.rerotate`; not with ``quant``: packed rows
        cannot be rotated); the model is then given :meth:`next_position` onwards as its position ids."""
        if rerotate is not None and quant is not None:
            raise PolicyError("rerotate: positions inside the cache rotate stored keys, not packed rows (quant)")
        if rerotate is not None and policy.pooled:
            raise PolicyError(f"rerotate: positions inside the cache number every head's tokens alike; policy="
                              f"{policy.name} gives heads uneven counts (pooled: one cut of a layer's heads together, "
                              f"or of every layer after the forward); allowed: a policy with per-head budgets")
        super().__init__(layers=[EvictingLayer(policy.for_layer(i, num_layers), ref_len, quant, i, rerotate,
                                               num_layers) for i in range(num_layers)])
        self.policy, self.quant = policy, quant

    def next_position(self) -> int:
        """Positions inside the cache (``rerotate``): the tokens every layer holds, the next token's number."""
        return held_alike([layer.rerotation for layer in self.layers])

    def held_tokens(self, layer: int | None = None) -> torch.Tensor:
        """(L, B, Hkv) int64 tokens each layer holds per sequence and KV head (slots with ``pos >= 0``; ``layer``:
        that layer's (B, Hkv) alone); beside :meth:`nbytes` (the slots stored, empty ones included) it shows what
        padding to the largest costs."""
        if layer is not None:
            return (self.layers[layer].pos >= 0).sum(-1)
        return torch.stack([(one.pos >= 0).sum(-1) for one in self.layers])

    def footprint(self) -> dict:
        """What the cache holds beside what it stores, for the whole batch: ``tokens_held`` (token x KV head
        entries over all layers), ``slots_stored`` (the same count of stored slots, empty ones of padded heads
        included), ``bytes_held`` (what the held tokens' keys and values take) and ``bytes_stored``
        (:meth:`nbytes`). They differ only where heads hold uneven counts (a :attr:`Policy.pooled` policy)."""
        held = slots = held_bytes = 0
        for layer in self.layers:
            if layer.keys is None:
                continue
            layer.fullest()
            n, stored = int((layer.pos >= 0).sum()), layer.pos.numel()
            rows = layer.keys.nbytes + layer.values.nbytes  # every slot takes the same bytes
            held, slots = held + n, slots + stored
            held_bytes += rows // stored * n + layer.nbytes() - rows  # + the sink
        extra = self.quant.const_bytes() if self.quant else 0
        return {"tokens_held": held, "slots_stored": slots, "bytes_held": held_bytes + extra,
                "bytes_stored": self.nbytes()}

    def nbytes(self) -> int:
        """Bytes of keys and values held by all layers (quant: plus its offline constants, once)."""
        return sum(layer.nbytes() for layer in self.layers) + (self.quant.const_bytes() if self.quant else 0)
