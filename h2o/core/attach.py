"""``attach(model, policy)``: put a loaded model into the simulated or the real path, restore it on exit.

    with attach(model, make_policy("h2o", budget=0.2)) as h:          # simulated: one-pass scoring
        logits = model(input_ids).logits
    with attach(model, policy, mode="real") as h:                      # real: an evicting cache
        out = model.generate(input_ids, cache=h.new_cache(), max_new_tokens=64)

Guards (one-line ``PolicyError``): the arguments' types; a model already attached (no nesting); an empty batch or
sequence; a generate batch with a row of padding only; a cache reused for a second ``generate`` (a cache is
single-use: take ``h.new_cache()`` per generation); mode='real' without a cache; a policy that reads the queries
before RoPE (expected_attention) on a model with no rotary embedding to undo (:mod:`h2o.core.prerope`).
Non-finite values: each layer records on the device whether its attention output is finite (no host sync); one
check per forward (= per decoding step), on the LM head's logits, stops the run before sampling with a
``FloatingPointError`` naming the first bad layer and token (or "outside attention" when no layer was bad).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import attention
from .cache import EvictingCache
from .model_settings import refuse_unsupported
from .notice import notice
from .prerope import rope_taps
from .policies import Policy, PolicyError
from .engine import as_paper_rule
from .quant import Quantizer

MODES = ("simulated", "real")
SEMANTICS = ("h2o", "reference")  # the older keyword: "reference" is the paper code's rule (h2o.core.engine)


@dataclass
class Attached:
    """What the attention function reads from each attention module (``module.h2o``)."""

    policy: Policy
    mode: str = "simulated"
    prompt_len: int = 0  # simulated: the first prompt_len columns are a prompt (rows see their whole prefix)
    num_layers: int = 0
    cache: EvictingCache | None = None
    observer: Callable | None = field(default=None, repr=False)  # observer(layer_idx, probs (B, Hq, T, S))
    quant: Quantizer | None = None  # KV quantization (h2o.core.quant), bound to the model: the caches' storage
    peaks: list = field(default_factory=list, repr=False)  # (layer, finite_probe(output)) this forward, on device
    worst: torch.Tensor | None = field(default=None, repr=False)  # their running sum: NaN/inf = a layer was bad
    # per sliding window (None: global layers): (attention mask, valid, forward plan) of the current forward
    memo: dict = field(default_factory=dict, repr=False)
    # Policy.reads_queries: {layer index: the attention module's rotary (h2o.core.prerope.RopeTap)}
    taps: dict = field(default_factory=dict, repr=False)
    own: str = "eager"  # the attention the model was loaded with (a flash kernel serves the real path's prefill)

    def new_cache(self, ref_len: int | None = None) -> EvictingCache:
        """A fresh evicting cache for one generation (real mode). Budget ratios are taken of the prompt's
        length, or of ``ref_len`` if given (to feed a sequence of known length token by token)."""
        if self.mode != "real":
            raise PolicyError(f"mode={self.mode}: new_cache() is for mode='real'")
        self.cache = EvictingCache(self.policy, self.num_layers, ref_len, self.quant)
        return self.cache

    def per_forward(self, attention_mask, query, build: Callable, window: int | None = None):
        """(valid (B, q) bool, ``build(valid)``), computed once per forward and sliding window: transformers
        passes the same mask tensor to every layer of a kind (global, sliding) in a forward and builds new ones
        for the next forward. ``window``: the key of what is built beside the mask (the layer's sliding window, or
        a tuple naming another build for that window)."""
        # no mask (no pad: every column real): the same plan for every forward of this shape and prompt
        key = attention_mask if attention_mask is not None else (query.shape[0], query.shape[-2], self.prompt_len)
        memo = self.memo.get(window)
        same = memo is not None and (memo[0] is key if attention_mask is not None else
                                     isinstance(memo[0], tuple) and memo[0] == key)
        if not same:
            valid = attention.new_valid(attention_mask, query)
            memo = self.memo[window] = (key, valid, build(valid))
        return memo[1:]

    def queries(self, module, query):
        """The forward's queries (B, Hq, q, D) with what turns them back before RoPE, for a policy that reads
        them (:class:`h2o.core.prerope.Queries`); None for the others."""
        tap = self.taps.get(module.layer_idx)
        return None if tap is None else tap.queries(query)

    def flag(self, layer_idx: int, out: torch.Tensor) -> None:
        """Record layer ``layer_idx``'s attention output (B, q, Hq, D) as a value NaN and inf propagate into
        (:func:`finite_probe`), and into the forward's running sum; no host sync (read once per forward by
        :meth:`check_logits`)."""
        peak = finite_probe(out)
        if layer_idx == 0 or self.worst is None:  # a new forward
            self.peaks, self.worst = [], peak
        else:
            self.worst = self.worst + on(peak, self.worst.device)  # a sum: -inf is not lost as in a maximum
        self.peaks.append((layer_idx, peak))

    def check_logits(self, logits: torch.Tensor) -> None:
        """logits (B, q, V): the one host sync per forward. FloatingPointError, before anything samples from
        them, when the logits or any layer's attention output of this forward are non-finite."""
        self.memo.clear()  # the forward is over: the next one builds its own plan (h2o_mask may hand None alike)
        worst = finite_probe(logits)
        if self.worst is not None:
            worst = worst + on(self.worst, worst.device)
        peaks, self.peaks, self.worst = self.peaks, [], None
        if not math.isfinite(worst.item()):
            raise FloatingPointError(self.nonfinite_message(logits, peaks))

    def nonfinite_message(self, logits: torch.Tensor, peaks: list) -> str:
        rows = (~torch.isfinite(logits)).any(-1)  # (B, q)
        offset = self.cache.get_seq_length() - logits.shape[1] if self.cache is not None else 0  # tokens before
        token = f"token {offset + int(rows.any(0).nonzero()[0])}" if bool(rows.any()) else "a token (logits finite)"
        layers = [i for i, peak in peaks if not math.isfinite(peak.item())]
        where = f"attention output in layer {layers[0]}" if layers else "logits, produced outside attention (MLP, " \
                                                                        "norm or LM head; no attention output was)"
        return f"non-finite {where} at {token} ({self.mode} path): stopped before sampling"


def finite_probe(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim value that is finite iff every element of ``x`` is (NaN, inf and -inf all propagate into a sum),
    short of a sum of finite values past fp32's range (3e38): one reduction (7x faster on the CPU than
    ``vector_norm(x, inf)``: 15 ms against 140 ms for a 1k-token prompt's logits). fp16 sums in fp32."""
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum()


def on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device`` (a model split over devices); no op when it is there already."""
    return x if x.device == device else x.to(device)


def attention_modules(model):
    """The modules that call the attention interface: they carry ``layer_idx`` and a config."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
            and type(m).__name__.endswith("Attention")]


def check_input(_model, args, kwargs) -> None:
    """Forward pre-hook: PolicyError for an empty batch or sequence (transformers fails inside a reshape)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and 0 in x.shape[:2]:
        name = "input_ids" if ids is not None else "inputs_embeds"
        raise PolicyError(f"{name} of shape {tuple(x.shape)}: an empty {'batch' if x.shape[0] == 0 else 'sequence'}; "
                          f"a forward needs at least one row of at least one token")


def single_use_generate(model, state: Attached):
    """``model.generate`` that refuses a cache already used (it would continue the old sequence silently), unless
    the call says it continues one on purpose: ``continue_cache=True`` (a prompt prefilled and compressed first,
    then generate fed its remaining tokens, as h2o.tasks.question_after does)."""
    generate = model.generate

    def guarded(*args, continue_cache: bool = False, **kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
            empty = (~mask.bool().any(-1)).nonzero().flatten().tolist()  # one host read per generate call
            if empty:
                raise PolicyError(f"attention_mask row {empty[0]} of {mask.shape[0]} is all padding: nothing to "
                                  f"generate from; allowed: rows with at least one real token (drop the empty ones)")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if state.mode == "real" and cache is None:
            raise PolicyError("mode='real' needs a cache: model.generate(..., cache=h.new_cache())")
        if isinstance(cache, EvictingCache) and cache.get_seq_length() > 0 and not continue_cache:
            raise PolicyError(f"this EvictingCache already holds {cache.get_seq_length()} tokens: a cache is "
                              f"single-use; take h.new_cache() for each generate call")
        return generate(*args, **kwargs)

    return guarded


@contextmanager
def attach(model, policy: Policy, mode: str = "simulated", semantics: str = "h2o", prompt_len: int = 0,
           quant: Quantizer | None = None):
    """``quant`` (h2o.core.quant, None: unquantized): how the caches store keys and values, in both paths: the
    evicting caches of ``new_cache()`` hold packed rows, the simulated path attends to the same values decoded.
    Accepted with a one-line notice naming the first spelling: ``semantics="reference"`` (the paper code's rule, for an
    h2o or h2_only policy) and a quantizer set as ``policy.quant`` (read when ``quant`` is not given)."""
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy={policy!r}: expected a Policy, e.g. h2o.make_policy('h2o', budget=0.2)")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
        raise PolicyError(f"prompt_len={prompt_len!r}: expected an int >= 0")
    if mode not in MODES:
        raise PolicyError(f"mode={mode!r}: allowed: {', '.join(MODES)}")
    if semantics not in SEMANTICS:
        raise PolicyError(f"semantics={semantics!r}: allowed: {', '.join(SEMANTICS)}")
    quant = quant if quant is not None else policy.quant
    if semantics == "reference":
        policy = as_paper_rule(policy)  # a policy out of the rule's scope: the error, without the notice
        notice(f"attach(..., semantics='reference') is spelled attach(..., make_policy({policy.name!r}, ...)) now")
    if mode == "simulated" and policy.real_only:
        raise PolicyError(f"policy={policy.name}: mode=simulated: {policy.real_only}; allowed: mode=real")
    if policy.whole_forward and mode != "simulated":
        raise PolicyError(f"policy={policy.name} (the paper code's mask rule): mode={mode}; allowed: mode=simulated")
    if mode == "simulated" and policy.evicts and policy.schedule.once and not prompt_len and not policy.is_full:
        raise PolicyError(f"compress=prefill: {policy.name} compresses a prompt at its end, and this forward has no "
                          f"prompt (prompt_len=0); allowed: a task with a prompt, or compress=decode")
    modules = attention_modules(model)
    if not modules:
        raise PolicyError(f"{type(model).__name__}: no attention module with layer_idx found")
    if model.config._attn_implementation == attention.NAME or any(hasattr(m, "h2o") for m in modules):
        raise PolicyError(f"{type(model).__name__} is attached already: attach() does not nest; leave the outer "
                          f"`with attach(...)` first")
    refuse_unsupported(model, modules, policy)
    # the queries before RoPE (a policy that reads them): refused in one line on a model without a rotation to undo
    taps = rope_taps(model, modules, policy.name) if policy.reads_queries and not policy.is_full else {}
    state = Attached(policy, mode, prompt_len=prompt_len, num_layers=len(modules),
                     quant=quant.bind(model) if quant is not None else None, taps=taps)
    state.own = model.config._attn_implementation
    head = model.get_output_embeddings()
    handles = [] if head is None else [head.register_forward_hook(lambda _m, _i, logits: state.check_logits(logits))]
    handles.append(model.register_forward_pre_hook(check_input, with_kwargs=True))
    handles += [m.register_forward_pre_hook(taps[m.layer_idx].capture, with_kwargs=True) for m in modules
                if m.layer_idx in taps]  # each module's (cos, sin) as transformers passes it
    model.set_attn_implementation(attention.NAME)
    model.generate = single_use_generate(model, state)
    for m in modules:
        m.h2o = state
    extra = []  # a rule's own hooks (Policy.attach_hooks)
    try:
        extra = policy.attach_hooks(model, state) if mode == "real" else []
        yield state
    finally:
        for m in modules:
            del m.h2o
        del model.generate  # the class's own again
        for handle in [*handles, *extra]:
            handle.remove()
        model.set_attn_implementation(state.own)
