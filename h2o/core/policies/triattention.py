"""triattention: keep the keys that the model's typical query is expected to attend to from afar (TriAttention, Mao
et al., arXiv 2604.04921), as its reference code (WeianMao/triattention v0.2.0, ``triattention/methods/
triattention.py`` with ``pruning_utils.py``) scores them: key-only, from statistics of the queries calibrated
offline per model (``python -m h2o.assets.triattention``).

Per layer and query head ``h`` the calibration holds, over the frequencies ``f`` of the rotary (a channel pair
``(i, i + r/2)`` as one complex number), the mean query before RoPE ``qbar[h, f]`` (complex) and its mean modulus
``qabs[h, f]``. A held key at position ``p`` is turned back to before RoPE with its position
(``k~[f] = k[f] e^{-i w_f p} / a``, ``w_f`` the rotary's frequency, ``a`` its attention scaling), and scored as the
query centre's attention logit averaged over the future distances ``d = t - p + o``, ``t`` the position after the
newest token, ``o`` in the geometric offsets ``1, 2, 4, ..., offset_max_length``:

    s_h(k) = mean_o sum_f a^2 |qbar_f| |k~_f| cos(d w_f + arg(qbar_f conj(k~_f)))     (the distance preference)
             + sum_f a^2 (qabs_f - |qbar_f|) |k~_f|                                  (the norms)

The mean over ``o`` is taken in closed form (``mean_o e^{i o w_f}``, a constant per frequency: the same sum in one
pass instead of one per offset). With ``normalize_scores`` each query head's scores are standardised over the
scored tokens (mean 0, standard deviation 1, population, at least 1e-6); a KV head ranks by the maximum (or mean:
``head_aggregation``) over its query heads. The prompt's tokens are never scored (the reference's
``allow_prefill_compression=False``): they are kept first, the oldest first where the budget holds fewer, and
the generated tokens compete for the rest. Each (layer, KV head) chooses on its own (the reference's
``per_layer_perhead_pruning``), or, with ``per_head_pruning=True`` (the reference's default mode), one set of
positions per KV head index is kept in every layer: each layer's scores of its query heads (standardised as above)
aggregated over the group of a KV head (``head_aggregation``), then the mean over the layers, ranked once
(:meth:`TriAttention.layers_priority`). A cut over all layers cannot happen inside one layer's attention: each layer
keeps what it holds at its own cut, and after a forward whose cut is due (the schedule's, per sequence) the rule
cuts every layer at once (:meth:`TriAttention.attach_hooks`, ``EvictingCache.positions`` and ``keep_only``). The
real path only; ``compress=decode`` refused (a step's slot is chosen per layer).

Channels the rotary does not turn (GPT-NeoX's partial rotary) are paired the same way with ``w = 0``, ``a = 1``
(for them the preference is the expected dot product, constant in the distance); the reference has full rotary
only. Models without RoPE (OPT) have no rotation to undo: refused at calibration and at the pipeline's check.

Timing: the reference cuts back to ``budget`` once the cache holds ``budget + divide_length`` tokens, the prompt
counted (``use_slack_trigger``, its default): ``compress=buffer``, this rule's default, with ``interval`` 128 where
none is given (its ``divide_length``); ``compress=interval`` cuts every 128 generated tokens instead, the same steps
where ``budget - prompt`` is a multiple of it (docs/triattention.md). ``compress=decode``: the arriving token takes
the slot of the lowest-scored older generated token, ``t`` then the arriving token's position plus one.

State: at a cut or a decoding step :meth:`cut_score` hands the held keys on (B, H, S, D); :meth:`priority` scores
them with their positions. The statistics are per layer: :meth:`for_layer` returns the rule bound to one layer's.
"""
from __future__ import annotations

import copy

import torch

from .base import READ_KEYS, TIER, Counts, Policy, PolicyError, keep_top
from .budget import Unsupported
from ..schedule import Buffer, Schedule

DIVIDE_LENGTH = 128  # the reference's divide_length: tokens between two cuts
CALIBRATE = "python -m h2o.assets.triattention model=<name>"  # the command that writes a model's statistics
AGGREGATIONS = ("max", "mean")  # over a KV head's query heads (the reference's layer_perhead_aggregation)


def complex_pairs(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """(..., D) -> (..., D/2) complex: the rotary's channel pairs ``(i, i + r/2)`` for ``i < r/2``, then the
    channels it leaves as they are paired the same way (``(r + i, r + (D - r)/2 + i)``)."""
    r, rest = rotary // 2, (x.shape[-1] - rotary) // 2
    real = torch.cat([x[..., :r], x[..., rotary:rotary + rest]], -1)
    imag = torch.cat([x[..., r:rotary], x[..., rotary + rest:]], -1)
    return torch.complex(real, imag)


class LayerStats:
    """One layer's calibration, on the keys' device and in at least fp32: ``qbar`` (Hq, F) complex, ``extra``
    (Hq, F) ``a_f^2 (qabs - |qbar|)``, ``weight`` (F,) ``a_f^2``, ``omega`` (F,) float64, ``scale`` (F,) ``a_f``
    (1 for channels the rotary leaves), ``rotary`` its channels, ``future`` (F,) complex ``mean_o e^{i o w}``."""

    def __init__(self, cal: dict, layer: int, max_length: int):
        self.rotary = int(cal["rotary"][layer])
        self.omega = cal["omega"][layer].double()  # (F,)
        self.scale = cal["scale"][layer].double()  # (F,)
        self.qbar = torch.complex(cal["q_mean_real"][layer].float(), cal["q_mean_imag"][layer].float())  # (Hq, F)
        self.weight = self.scale.pow(2)
        self.extra = (cal["q_abs_mean"][layer].float() - self.qbar.abs()) * self.weight.float()  # (Hq, F)
        # the future distances' offsets: 1, 2, 4, ... up to max_length (the reference's geometric offsets)
        o = torch.tensor([2 ** i for i in range(max_length.bit_length())], dtype=torch.float64)  # (O,)
        self.future = torch.polar(torch.ones(()).double(), o[:, None] * self.omega).mean(0)  # (F,) complex128
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> "LayerStats":
        if device != self.device:
            for name in ("omega", "scale", "qbar", "weight", "extra", "future"):
                setattr(self, name, getattr(self, name).to(device))
            self.device = device
        return self


class TriAttention(Policy):
    name = "triattention"
    splits = False  # one budget: the prompt's tokens first, then the generated ones by score
    reads = frozenset({READ_KEYS})  # the held keys after RoPE, at a cut and at each decoding step
    schedule = Buffer(DIVIDE_LENGTH)  # the reference's slack trigger: cut once budget + divide_length are held
    default_interval = DIVIDE_LENGTH  # where a schedule that takes an interval is given none

    def __init__(self, budget=2048, heavy=None, recent=None, heavy_share=0.5, stats=None,
                 normalize_scores: bool = True, offset_max_length: int = 65536, head_aggregation: str = "max",
                 allow_prefill_compression: bool = False, per_head_pruning: bool = False):
        super().__init__(budget, heavy, recent, heavy_share)
        self.whole_budget()  # no recent part
        for key, value in (("normalize_scores", normalize_scores),
                           ("allow_prefill_compression", allow_prefill_compression),
                           ("per_head_pruning", per_head_pruning)):
            if not isinstance(value, bool):
                raise PolicyError(f"{key}={value!r}: allowed: true or false")
        if isinstance(offset_max_length, bool) or not isinstance(offset_max_length, int) or offset_max_length < 1:
            raise PolicyError(f"offset_max_length={offset_max_length!r}: the farthest future distance; allowed: an "
                              f"int >= 1")
        if head_aggregation not in AGGREGATIONS:
            raise PolicyError(f"head_aggregation={head_aggregation!r}: allowed: {', '.join(AGGREGATIONS)}")
        self.normalize_scores, self.offset_max_length = normalize_scores, offset_max_length
        self.head_aggregation, self.allow_prefill_compression = head_aggregation, allow_prefill_compression
        self.calibration = load_stats(stats)
        self.layer: LayerStats | None = None
        self.per_head_pruning = per_head_pruning
        self.pending: Counts | None = None  # per_head_pruning: the budget of a layer's cut left to attach_hooks
        if per_head_pruning and not self.is_full:  # this instance's answers, as kvzip's (no flag of its own)
            self.real_only = ("per_head_pruning=true cuts every layer at once after a forward, which the simulated "
                              "path's one-pass mask of one layer cannot hold; allowed there: per_head_pruning=false")
            self.pooled = True  # each layer keeps all at its own cut (keep), its storage recounted; then one cut

    def check_schedule(self, schedule: Schedule) -> None:
        if self.per_head_pruning and schedule.evicts_each_step:
            raise Unsupported(f"compress={schedule.name}: per_head_pruning=true cuts every layer at once after a "
                              f"forward, not one slot per layer at each step; allowed: buffer, interval, prefill "
                              f"(or per_head_pruning=false)")

    @property
    def needs_calibration(self) -> bool:
        """True while no statistics are given (``stats=None``): a run finds its model's before the model loads
        (``h2o.assets.triattention.require``; the pipeline and lm-eval's ``--model h2o`` call it) and binds them
        here with :meth:`calibrated`."""
        return self.calibration is None and not self.is_full

    def calibrated(self, stats) -> "TriAttention":
        """This rule with the statistics ``stats`` (a calibration dict or its file): a copy."""
        out = copy.copy(self)
        out.calibration = load_stats(stats)
        return out

    def for_layer(self, layer: int, layers: int) -> "TriAttention":
        """This rule bound to layer ``layer``'s statistics (a copy); PolicyError in one line without a calibration
        or with one of another shape. A full budget never scores: the rule as it is."""
        if self.is_full:
            return self
        if self.calibration is None:
            raise PolicyError(f"policy={self.name}: no calibration (stats=None): the rule scores keys with the "
                              f"model's query statistics; write them with `{CALIBRATE}`")
        have = self.calibration["layers"]
        if have != layers or not 0 <= layer < layers:
            raise PolicyError(f"policy={self.name}: the calibration of {self.calibration['model']} has {have} layers, "
                              f"this model {layers}; allowed: the model's own (`{CALIBRATE}`)")
        bound = copy.copy(self)
        bound.layer = LayerStats(self.calibration, layer, self.offset_max_length)
        return bound

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        """keys (B, H, S, D) -> (B, H, S, D) in at least fp32: what :meth:`priority` scores."""
        return keys.to(torch.promote_types(keys.dtype, torch.float32))

    def priority(self, pos, acc, now, counts: Counts) -> torch.Tensor:
        """pos (B, H, S) (-1: not held), acc (B, H, S, D) the held keys (:meth:`cut_score`), now (B,) -> (B, H, S)
        float64: the prompt's tokens a tier above, oldest first; the others by score. ``per_head_pruning``: none
        (the layer's cut keeps all: :meth:`keep`)."""
        if self.pooled:
            return torch.zeros(pos.shape, dtype=torch.float64, device=pos.device)
        return self.tiered(pos, counts, lambda scored: self.scores(acc, pos, now, scored))

    def tiered(self, pos, counts: Counts, score_of) -> torch.Tensor:
        """pos (B, H, S) (-1: not held) -> (B, H, S) float64: the prompt's tokens (where pinned) a tier above, oldest
        first; the other held tokens by ``score_of(scored)`` (scored (B, H, S) bool -> (B, H, S)); 0 where not held."""
        held = pos >= 0
        pinned = held & (pos < counts.length.view(-1, 1, 1)) if not self.allow_prefill_compression \
            else torch.zeros_like(held)
        scored = held & ~pinned
        return torch.where(pinned, 2 * TIER - pos.double(), torch.where(scored, score_of(scored).double(), 0.0))

    def scores(self, keys: torch.Tensor, pos: torch.Tensor, now: torch.Tensor, scored: torch.Tensor
               ) -> torch.Tensor:
        """keys (B, Hkv, S, D) after RoPE, pos (B, Hkv, S), now (B,), scored (B, Hkv, S) bool -> (B, Hkv, S) fp32:
        each KV head's aggregate over its query heads of their (standardised) scores; 0 where not scored."""
        score = self.head_scores(keys, pos, now)  # (B, H, G, S)
        mask = scored[:, :, None]  # (B, H, 1, S)
        if self.normalize_scores:
            n = mask.sum(-1, keepdim=True).clamp(min=1)
            mean = (score * mask).sum(-1, keepdim=True) / n
            std = (((score - mean) * mask).pow(2).sum(-1, keepdim=True) / n).sqrt().clamp(min=1e-6)
            score = (score - mean) / std
        score = score.amax(2) if self.head_aggregation == "max" else score.mean(2)  # (B, H, S)
        return score.masked_fill(~scored, 0.0)

    def head_scores(self, keys: torch.Tensor, pos: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """keys (B, Hkv, S, D) after RoPE, pos (B, Hkv, S), now (B,) -> (B, Hkv, G, S) fp32: each query head's score
        of each key (module doc), its G query heads per KV head."""
        if self.layer is None:
            raise PolicyError(f"policy={self.name}: the rule is not bound to a layer's statistics (for_layer); "
                              f"with no calibration, write one with `{CALIBRATE}`")
        st = self.layer.to(keys.device)
        H = keys.shape[1]
        at = pos.clamp(min=0).double()  # (B, H, S)
        turn = torch.polar(1.0 / st.scale, -at[..., None] * st.omega)  # (B, H, S, F) complex128
        k = complex_pairs(keys.double(), st.rotary) * turn  # (B, H, S, F) before RoPE
        ahead = torch.polar(st.weight, (now.double().view(-1, 1, 1) + 1 - at)[..., None] * st.omega) * st.future
        F = st.qbar.shape[-1]
        qbar, extra = st.qbar.view(H, -1, 1, F)[None], st.extra.view(H, -1, 1, F)[None]  # (1, H, G, 1, F)
        trig = (qbar * (k.conj() * ahead).to(qbar.dtype)[:, :, None]).real.sum(-1)  # (B, H, G, S)
        return trig + (k.abs().float()[:, :, None] * extra).sum(-1)

    def layers_priority(self, rules: list["TriAttention"], keys: list[torch.Tensor], pos: torch.Tensor,
                        now: torch.Tensor, counts: Counts) -> torch.Tensor:
        """``per_head_pruning``: each layer's rule (:meth:`for_layer`) and keys (B, Hkv, S, D) after RoPE, the same
        positions pos (B, Hkv, S) in every layer (-1: not held), now (B,) -> (B, Hkv, S) float64 one priority per KV
        head for every layer: the prompt's tokens a tier above, oldest first; the others by the mean over the layers
        of each layer's :meth:`scores` (its query heads standardised, aggregated over the group: the reference's
        ``_select_per_head_independent``)."""
        held = pos >= 0
        return self.tiered(pos, counts, lambda scored: torch.stack([
            rule.scores(self.cut_score(None, k, held), pos, now, scored)
            for rule, k in zip(rules, keys)]).mean(0))  # the mean over layers of each layer's (B, Hkv, S)

    def keep(self, prio, pos, valid, counts: Counts, arriving=None) -> torch.Tensor:
        """``per_head_pruning``: a layer's cut keeps everything and leaves its budget ``counts`` (a sequence the
        schedule spares: all its slots) to the cut of every layer after the forward (:meth:`attach_hooks`)."""
        if not self.pooled:
            return super().keep(prio, pos, valid, counts, arriving)
        self.pending = counts
        return valid

    def attach_hooks(self, model, state) -> list:
        """``per_head_pruning``: after each forward through an evicting cache whose layers' cuts were due (each
        kept what it held, :meth:`keep`), :meth:`cut_layers`. None otherwise. A model with sliding-window layers is
        refused here, before any forward (they drop other positions than its global layers)."""
        if not self.pooled:
            return []
        from ..model_settings import layer_windows

        if any(w is not None for w in layer_windows([m for m in model.modules() if hasattr(m, "h2o")])):
            raise PolicyError("policy=triattention: per_head_pruning=true: the model has sliding-window layers, "
                              "which hold other positions than its global ones; allowed: per_head_pruning=false")

        def after(_module, args, kwargs, _output):
            cache = kwargs.get("past_key_values")
            cache = cache if cache is not None else kwargs.get("cache", state.cache)
            bound = [layer.policy for layer in getattr(cache, "layers", ())]  # each layer's copy of this rule
            counts = bound[0].pending if bound and isinstance(bound[0], TriAttention) else None
            if counts is not None:
                for rule in bound:
                    rule.pending = None
                self.cut_layers(cache, bound, counts)

        return [model.register_forward_hook(after, with_kwargs=True)]

    def cut_layers(self, cache, rules: list["TriAttention"], counts: Counts) -> None:
        """Cut every layer of ``cache`` at once to one set of positions per (sequence, KV head): the budget
        ``counts`` (a sequence the schedule spares: all its slots, so it keeps what it holds) ranked by
        :meth:`layers_priority` with ``rules``, the layers' own rules (bound once, when the cache made them). Every layer holds the same positions in the same slots (each layer registers the
        same tokens, and this cut keeps the same slots in every layer); layers holding others are refused."""
        positions = cache.positions()
        pos = positions[0]
        if any(not torch.equal(p, pos) for p in positions[1:]):
            raise PolicyError("policy=triattention: per_head_pruning=true: the layers hold different positions; "
                              "allowed: per_head_pruning=false")
        held = pos >= 0
        now = pos.amax((1, 2))  # (B,) the newest token: every layer kept what it held
        keys = [layer.read()[0] for layer in cache.layers]
        prio = self.layers_priority(rules, keys, pos, now, counts)
        cache.keep_only([keep_top(prio, held, counts.total)] * len(positions))

    def describe(self) -> dict:
        cal = self.calibration or {}
        return {**super().describe(), "normalize_scores": self.normalize_scores,
                "offset_max_length": self.offset_max_length, "head_aggregation": self.head_aggregation,
                "allow_prefill_compression": self.allow_prefill_compression,
                **({"per_head_pruning": True} if self.per_head_pruning else {}),  # false: records as before
                "calibration": {k: cal.get(k) for k in ("model", "digest", "text", "tokens")} if cal else None}


# the fields of a calibration (h2o.assets.triattention writes them; load_stats checks them)
FIELDS = ("layers", "rotary", "omega", "scale", "q_mean_real", "q_mean_imag", "q_abs_mean", "digest")


def load_stats(stats) -> dict | None:
    """A calibration (``h2o.assets.triattention``'s dict, or a path to its file; None: none) checked for its fields."""
    if stats is None or isinstance(stats, dict):
        cal = stats
    else:
        from pathlib import Path

        path = Path(str(stats)).expanduser()
        if not path.is_file():
            raise PolicyError(f"stats={stats!r}: no such file; allowed: a calibration file written by `{CALIBRATE}`")
        cal = torch.load(path, map_location="cpu", weights_only=True)
    if cal is not None and any(k not in cal for k in FIELDS):
        raise PolicyError(f"stats: not a calibration (fields {', '.join(k for k in FIELDS if k not in cal)} missing); "
                          f"allowed: a file written by `{CALIBRATE}`")
    return cal
