"""The one abstraction of the harness: a cache policy.

A policy answers "which cached tokens may this query see". It does so in one of two ways:

* an *evicting* policy (``evicts = True``) keeps at most ``budget`` tokens per (sequence, KV head). When a new
  token arrives and the cache is full, the shared step :func:`select_slot` drops the cached token of lowest
  :meth:`Policy.priority`; the new token then takes its place. The simulated mask (one forward pass) and the
  evicting cache (generation) both call that same step on the same state, so they agree token for token.
* a *restricting* policy (``evicts = False``, top-k) keeps the whole cache and limits each query to some keys
  (:meth:`Policy.restrict`).

At decoding steps the evicting cache reads both through :meth:`Policy.decoder` (one per layer): by default the
two methods above; a policy may keep state between steps that gives the same answers with fewer ops (strided_h2,
fixed_h2: :mod:`.protected`; topk, topk_h2: a top-n without a sort), each tested against the definition.

State shapes used everywhere (S = cache slots, or sequence positions in the simulated path):
    pos   (B, H, S) int64  position of the token in its own sequence (pads excluded), -1 for an empty/pad slot
    acc   (B, H, S) fp32   accumulated attention the token received (summed over a KV head's query heads)
                           (a policy may keep more per slot: (B, H, S, ...), :meth:`Policy.new_state`)
    now   (B,)      int64  position of the token that is arriving (the state is judged as if it were in)
    counts            per-sequence token counts of the budget, each (B,) int64 (see :class:`Counts`)

A budget part is a ratio of the reference length (float, 0 < r <= 1: the scored sequence in lm-eval, the prompt
in generation; ``n = floor(r * L)`` as in the paper) or an absolute token count (int >= 1).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..schedule import COMPRESS, Decode, Schedule, make_schedule  # noqa: F401 (COMPRESS re-exported)
from .budget import BudgetPart, Counts, PolicyError, Unsupported, check_part, to_count  # noqa: F401 (re-exported)
from .checks import BudgetChecks
from .forms import (ACCELERATORS, CLOSED_FORM, DECODER, ROW_KERNEL, RULE, Decoder, KernelForm,  # noqa: F401
                    declared)  # (re-exported)
from .slots import (TIER, TIER_INT, along_slots, bcast, const, keep_top, recent_window,  # noqa: F401 (re-exported)
                    select_slot, tier_key, tiered)

CELLS = 2**24  # held_rows: (rows x slots) priorities judged at once per sequence, bounds the memory


# What a rule reads from a forward beyond keys' positions (Policy.reads; both paths compute only that):
READ_KEYS = "keys"  # the held keys after RoPE, at a cut and at decoding steps (Policy.cut_score, step_score)
READ_WINDOW = "window"  # the attention of a prompt's last Policy.read_window() query rows (snapkv, tova)
READ_ROWS = "rows"  # the attention of every query row, accumulated (h2o's heavy hitters)
READ_QUERIES = "queries"  # the prompt's queries' statistics before RoPE (Policy.query_stats, expected_attention)
# with READ_ROWS or READ_WINDOW: accumulate/accumulate_prompt get the rows' logits (B, H, G, r, S) as computed (scaled,
# soft-capped, unmasked, pad rows not zeroed: ``valid`` given) in place of probabilities (r_kv pools heads' logits)
READ_LOGITS = "logits"
READS = (READ_KEYS, READ_WINDOW, READ_ROWS, READ_QUERIES, READ_LOGITS)
NOTHING: frozenset[str] = frozenset()  # a rule of positions alone (and of the budget): full, local, strided...


class Policy(BudgetChecks):
    """Base class. Subclasses set ``name`` and override :meth:`priority` (evicting) or :meth:`restrict`.

    Every form of a policy's rule is declared on its class: the definition (:meth:`priority` / :meth:`restrict`,
    :meth:`accumulate`), and where it has them its closed form (:meth:`held_rows`, with ``position_only``), its
    incremental decoder (:meth:`decoder`) and its Triton kernel parameters (:meth:`kernel_form`). The paths read
    the faster forms through :func:`declared`, so a subclass that changes the rule falls back to the definition.
    """

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True  # False: keeps the whole cache and restricts each query (top-k)
    # What the rule reads from a forward (a subset of :data:`READS`), declared on every policy's class: a prefill
    # computes the attention output and only these statistics. ``needs_scores``, ``reads_keys``, ``reads_queries``
    # and ``reads_logits`` follow from it (properties below); a wrapper (adakv, PerSequence) takes its inners'.
    reads: ClassVar[frozenset[str]] = NOTHING
    # The closed form of a rule of positions alone (:meth:`held_rows`, the accelerator ``closed_form``): None (none),
    # "global": the priority ignores ``acc`` and a token the cache dropped would never be among the ``total - 1``
    # older tokens of highest priority again; the cache at row i is then the top ``total - 1`` of all older tokens by
    # priority at i, plus token i (the simulated path builds every row at once; tests check it against the loop);
    # "sliding": on a sliding-window layer too, the cache at row i is the top ``total - 1`` of the older tokens
    # *inside the window* (:meth:`held_rows` with ``window``). Holds where, for a dropped token, either every newer
    # token outranks it from then on or no older one does (local, streaming_llm, strided; docs/attention.md): the
    # window takes one older token per row as one arrives. Else the simulated path runs the row loop on sliding layers
    closed_form: ClassVar[str | None] = None
    splits: ClassVar[bool] = True  # the rule reads the heavy and recent parts apart (False: only their sum)
    # True: a layer's budget is shared by its KV heads (Ada-KV): every eviction is a cut of the whole layer by
    # :meth:`keep` (a decoding step too), heads hold uneven counts, the evicting cache stores them padded
    pooled: ClassVar[bool] = False
    # when an evicting policy compresses (h2o.core.schedule, set by :meth:`timed`; read as ``compress`` and
    # ``interval``): Decode (the budget kept at every step), Prefill (kvpress's: cut once to the budget at the
    # prompt's end), Interval (cut back every ``interval`` tokens), Buffer (cut back once budget + N are held)
    schedule: Schedule = Decode()
    real_only: ClassVar[str | None] = None  # why the rule has no simulated form (None: it has one): attach's refusal
    registry: ClassVar[dict[str, type["Policy"]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "reads" in vars(cls):
            cls.reads = frozenset(cls.reads)
            odd = sorted(cls.reads - set(READS))
            if odd:
                raise TypeError(f"{cls.__name__}.reads: {odd} not in {READS}")
            if READ_LOGITS in cls.reads and not cls.reads & {READ_ROWS, READ_WINDOW}:
                raise TypeError(f"{cls.__name__}.reads: {READ_LOGITS!r} names how rows are read; add "
                                f"{READ_ROWS!r} or {READ_WINDOW!r}")
        if vars(cls).get("closed_form") not in (None, "global", "sliding"):
            raise TypeError(f"{cls.__name__}.closed_form={cls.closed_form!r}: allowed: None, 'global', 'sliding'")
        if vars(cls).get("name"):  # its own name: a subclass inheriting one does not replace its parent
            Policy.registry[cls.name] = cls

    # ------------------------------------------------- what follows from ``reads``, ``closed_form`` and the rule
    @property
    def needs_scores(self) -> bool:
        """Whether the rule reads the rows' attention into ``acc`` (:data:`READ_ROWS` or :data:`READ_WINDOW`)."""
        return bool(self.reads & {READ_ROWS, READ_WINDOW})

    @property
    def reads_keys(self) -> bool:
        """Whether a cut's and a decoding step's :meth:`cut_score` / :meth:`step_score` get the held keys."""
        return READ_KEYS in self.reads

    @property
    def reads_queries(self) -> bool:
        """Whether the prompt's queries before RoPE go to ``query_stats`` (h2o.core.prerope.Queries), and at the
        cut ``query_score(stats, keys, values, pos, held)`` replaces ``acc`` (expected_attention)."""
        return READ_QUERIES in self.reads

    @property
    def reads_logits(self) -> bool:
        """Whether the rows are given as logits in place of probabilities (:data:`READ_LOGITS`)."""
        return READ_LOGITS in self.reads

    @property
    def position_only(self) -> bool:
        """Whether the rule has a closed form of positions alone (:attr:`closed_form`)."""
        return self.closed_form is not None

    @property
    def window_closed_form(self) -> bool:
        """Whether that closed form holds inside a sliding window too (``closed_form = "sliding"``)."""
        return self.closed_form == "sliding"

    @property
    def whole_forward(self) -> bool:
        """Whether the rule is a mask over one whole forward (the paper code's H2O, :mod:`.h2o_reference`), not a
        cache: it defines :meth:`forward_mask`. The simulated path only, one unpadded sequence at a time, no sliding
        window; the forward's plan is built once (:meth:`mask_plan`) and each layer's mask from its logits."""
        return type(self).forward_mask is not Policy.forward_mask

    def for_layer(self, layer: int, layers: int) -> "Policy":
        """The rule of layer ``layer`` of ``layers``: both paths ask once per layer (the evicting cache when it makes
        the layer, the simulated path at each layer's attention) and run every hook of that layer on what this
        returns. Default: this policy; a rule with per-layer data (calibrated statistics) returns a copy bound to
        its layer."""
        return self

    def attach_hooks(self, model, state) -> list:
        """Hooks the real path adds to ``model`` for this rule (removed on leaving ``attach``; ``state``: the
        :class:`h2o.core.attach.Attached`): a rule that runs forwards of its own after the prompt (kvzip)."""
        return []

    def read_window(self) -> int:
        """Under :data:`READ_WINDOW`: how many of a forward's last real query rows the rule reads the attention of
        (the rows before them add nothing to its state). 0 for a rule that does not read a window."""
        return 0

    def __init__(self, budget: BudgetPart = 1.0, heavy: BudgetPart | None = None,
                 recent: BudgetPart | None = None, heavy_share: float = 0.5):
        if (heavy is None) != (recent is None):
            raise PolicyError(f"heavy={heavy}, recent={recent}: give both or neither (then budget is split)")
        if heavy is None:
            budget = check_part("budget", budget)
            if budget == 0:
                raise PolicyError("budget=0: a budget must be > 0 (ratio in (0, 1] or token count >= 1)")
            if isinstance(heavy_share, bool) or not isinstance(heavy_share, (int, float)) \
                    or not 0.0 <= heavy_share <= 1.0:
                raise PolicyError(f"heavy_share={heavy_share!r}: expected a number in [0, 1]")
            if isinstance(budget, float):
                heavy, recent = budget * heavy_share, budget - budget * heavy_share
            else:
                heavy = int(round(budget * heavy_share))
                recent = budget - heavy
        heavy, recent = check_part("heavy", heavy), check_part("recent", recent)
        if type(heavy) is not type(recent):
            raise PolicyError(f"heavy={heavy!r}, recent={recent!r}: use two ratios or two token counts")
        if isinstance(heavy, float) and heavy + recent > 1.0 + 1e-9:
            raise PolicyError(f"heavy + recent = {heavy + recent:g}: must be <= 1")
        if heavy + recent == 0:
            raise PolicyError("heavy = recent = 0: the budget must be > 0")
        self.heavy, self.recent = heavy, recent
        self.budget = heavy + recent

    def whole_budget(self) -> None:
        """No recent part: the whole budget is the rule's (``heavy = budget``, ``recent = 0``)."""
        Policy.__init__(self, heavy=self.budget, recent=0.0 if isinstance(self.budget, float) else 0)

    @property
    def quant(self):
        """The quantizer set as ``policy.quant = q`` (None unless set), a second spelling: storage is the cache's
        option, ``attach(model, policy, quant=q)``, which reads this only when given none."""
        return vars(self).get("_quant")

    @quant.setter
    def quant(self, quantizer) -> None:
        from ..notice import notice

        notice("policy.quant = q is spelled attach(model, policy, quant=q) now (the cache's option)")
        self._quant = quantizer

    def timed(self, compress: str, interval: int | None = None) -> "Policy":
        """This policy with the compression timing ``compress`` (:data:`COMPRESS`) and its option ``interval``
        (:func:`h2o.core.schedule.make_schedule`; where a schedule that takes one is given none, the rule's
        ``default_interval`` if it has one: its reference's), if the rule has a form under it
        (:meth:`check_schedule`); returns it."""
        cls = Schedule.registry.get(compress) if isinstance(compress, str) else None
        if interval is None and cls is not None and cls.takes_interval:
            interval = getattr(self, "default_interval", None)
        schedule = make_schedule(compress, interval)
        self.check_schedule(schedule)
        self.schedule = schedule
        return self

    def check_schedule(self, schedule: Schedule) -> None:
        """Unsupported (one line) where the rule has no form under ``schedule``. Default: a rule that keeps the
        whole cache (top-k) has nothing to compress."""
        if not schedule.evicts_each_step and not self.evicts:
            raise Unsupported(f"compress={schedule.name}: {self.name} keeps the whole cache (nothing to compress); "
                              f"allowed: decode")

    @property
    def compress(self) -> str:
        """The schedule's name (:data:`COMPRESS`), the spelling of the command line and of the records."""
        return self.schedule.name

    @property
    def interval(self) -> int | None:
        """The schedule's option ``interval`` (None where it takes none)."""
        return self.schedule.every

    # ----------------------------------------------------------------- budget
    def counts(self, length: torch.Tensor) -> Counts:
        """Budget in tokens for reference lengths ``length`` (B,). At least the query itself is kept."""
        heavy, recent = to_count(self.heavy, length), to_count(self.recent, length)
        total = torch.clamp(heavy + recent, min=1)
        return Counts(total=total, heavy=heavy, recent=total - heavy, length=length)

    def layer_counts(self, counts: Counts, layer: int, layers: int) -> Counts:
        """The budget of layer ``layer`` of ``layers`` from :meth:`counts` (both paths ask per layer). Default:
        the same for every layer; a per-layer budget (pyramidkv) overrides this."""
        return counts

    @property
    def is_full(self) -> bool:
        """True when the policy never drops anything (full cache, or a 100% ratio budget)."""
        return isinstance(self.budget, float) and self.budget >= 1.0 - 1e-9

    # ------------------------------------------------------- evicting policies
    def priority(self, pos: torch.Tensor, acc: torch.Tensor, now: torch.Tensor, counts: Counts) -> torch.Tensor:
        """(B, H, S) float, higher = keep (float64 where tiers are added to positions). Called on valid slots only;
        ties are broken towards older tokens."""
        raise NotImplementedError(f"{type(self).__name__} is not an evicting policy")  # abstract

    def keep(self, prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, counts: Counts,
             arriving: torch.Tensor | None = None) -> torch.Tensor:
        """A cut (the end of a prompt): prio (B, H, S) of the held slots ``valid`` (B, H, S) bool -> (B, H, S) bool
        the kept ones. Default: each head's ``total`` highest, newer first on ties (slots in position order, as
        at a cut). A :attr:`pooled` policy decides for the whole layer, decoding steps too (``arriving``: the
        arriving token's slots, kept; ``pos`` for its ties, slots in any order)."""
        return keep_top(prio, valid, counts.total)

    def held_rows(self, pos: torch.Tensor, now: torch.Tensor, counts: Counts, first: int,
                  window: int | None = None) -> torch.Tensor:
        """Position-only policies, every state at once: pos (B, S) of the columns, now (B, R) the newest token of
        each row (-1: none yet) -> (B, R, S) bool, the older tokens held at that row (the row's token not included).

        The cache evicts from row ``first`` on (rows before it see their whole prefix). Default: the ``total - 1``
        older tokens of highest priority at the row (exact under ``position_only``), among those inside the
        sliding ``window`` if given (exact under ``window_closed_form``); memory is bounded by blocks.
        """
        B, R = now.shape
        S = pos.shape[-1]
        step = max(1, CELLS // max(1, B * S))
        out = []
        for r in range(0, R, step):  # one block when R * S <= CELLS
            n = min(step, R - r)
            cols = pos[:, None, :].expand(B, n, S).reshape(B * n, 1, S)  # (B*n, 1, S) one state per row
            at = now[:, r:r + n].reshape(B * n)  # (B*n,)
            older = (cols >= 0) & (cols < at[:, None, None])
            if window is not None:
                older &= cols > (at - window)[:, None, None]
            c = counts.repeat(n)
            out.append(keep_top(self.priority(cols, None, at, c), older, c.total - 1).view(B, n, S))
        return out[0] if len(out) == 1 else torch.cat(out, 1)

    def new_state(self, B: int, H: int, S: int, device: torch.device) -> torch.Tensor:
        """The state ``acc`` of ``S`` new slots (nothing attended yet): (B, H, S) fp32 zeros. A policy that keeps
        more per slot returns (B, H, S, ...) zeros; both paths move it along axis 2 (:func:`along_slots`)."""
        return torch.zeros(B, H, S, dtype=torch.float32, device=device)

    def accumulate(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add query rows to the accumulated attention, in place: acc (B, H, S), probs (B, H, G, r, S) of the G
        query heads of each KV head, rows in order, pad rows zeroed; valid (B, r) bool real rows (None: all).
        One sum over heads and rows. Both paths call this; score variants override it (:mod:`.score`)."""
        acc += probs.sum((2, 3))

    def accumulate_prompt(self, acc: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None,
                          left: torch.Tensor) -> None:
        """:meth:`accumulate` for the rows of a multi-token forward (a prompt), told where each row lies: left
        (B, r) int64 the tokens after the row up to the forward's last (0: the prompt's last token; pad rows
        any value). Default: :meth:`accumulate` (a score that needs the rows' places overrides this: snapkv)."""
        self.accumulate(acc, probs, valid)

    def cut_score(self, acc: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """The state :meth:`priority` reads at a cut (the end of a prompt), given the held keys (B, H, S, D)
        after RoPE and held (B, H, S) bool. Default: ``acc`` as it is; a score of the keys (knorm, keydiff)
        returns its own (B, H, S) fp32."""
        return acc

    def step_score(self, acc: torch.Tensor, keys: torch.Tensor, held: torch.Tensor, pos: torch.Tensor,
                   counts: Counts) -> torch.Tensor:
        """The state :meth:`priority` reads at a decoding step of a policy with ``reads_keys`` (each row of the
        simulated row loop, each decoding token of the evicting cache): :meth:`cut_score` of the held older keys
        (B, H, S, D) after RoPE, held (B, H, S) bool, the arriving token not among them; pos (B, H, S)."""
        return self.cut_score(acc, keys, held)

    # slots a cut (a prompt's end, a prefill chunk's) leaves empty for the next token, 0 or 1 (:meth:`cut_counts`)
    cut_room: int = 0

    def cut_order(self, acc: torch.Tensor, prio: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                  counts: Counts) -> None:
        """Told a cut's ranking (prio, pos, valid (B, H, S): the held slots, the counts it keeps) before the slots
        are compacted, to set ``acc`` of the kept slots in place. Default: nothing."""

    def cut_counts(self, counts: Counts) -> Counts:
        """The counts a cut keeps: ``counts`` less ``cut_room`` tokens (the heavy part first capped). 0: the cut
        keeps ``total`` and the next token evicts one by the same score; 1 where that decision reads what the cut
        dropped (keydiff's anchor of every held key): the cut keeps ``total - 1``, the decision taken early."""
        if not self.cut_room:
            return counts
        total = (counts.total - self.cut_room).clamp(min=0)
        heavy, host = torch.minimum(counts.heavy, total), counts.host and self.cut_counts(counts.host)
        return Counts(total=total, heavy=heavy, recent=total - heavy, length=counts.length, host=host)

    def decoder(self, counts: Counts, host: Counts) -> "Decoder":
        """The priority at the decoding steps of one evicting-cache layer (counts on the device and on the host).
        Default: :meth:`priority` as it is; a policy may keep state between steps to make the same decisions
        with fewer ops (:class:`h2o.core.policies.protected.Protected`)."""
        return Decoder(self, counts)

    def decoding(self, counts: Counts, host: Counts) -> "Decoder":
        """The decoder the evicting cache uses: :meth:`decoder` where this rule declares one
        (:meth:`accelerators`), else its priority as it is (:class:`Decoder`)."""
        return self.decoder(counts, host) if DECODER in self.accelerators() else Decoder(self, counts)

    def accelerators(self) -> frozenset[str]:
        """The accelerators this rule declares (:data:`ACCELERATORS`), read by both paths: ``closed_form``
        (``position_only``), ``decoder`` (a :meth:`decoder` of its own rule, :func:`declared`), ``row_kernel`` (a
        :meth:`kernel_form` of its own rule). A subclass that changes the rule loses its parent's decoder and
        kernel."""
        out = {CLOSED_FORM} if self.position_only else set()
        make = declared(self, "decoder")
        if make is not None and getattr(make, "__func__", None) is not Policy.decoder:
            out.add(DECODER)
        make = declared(self, "kernel_form")
        if make is not None and make() is not None:
            out.add(ROW_KERNEL)
        return frozenset(out)

    def kernel_form(self) -> KernelForm | None:
        """The simulated path's Triton row kernel for this policy (:class:`KernelForm`); None: the torch row
        loop serves it (on CUDA with a one-line notice, :func:`h2o.core.row_kernel.use_kernel`)."""
        return None

    # --------------------------------------------------- whole-forward rules
    def mask_plan(self, valid: torch.Tensor):
        """A :attr:`whole_forward` rule's plan, built once per forward from valid (B, T) bool (shared by the
        layers)."""
        raise NotImplementedError(f"{type(self).__name__} is not a whole-forward rule")  # abstract

    def forward_mask(self, logits: torch.Tensor, allowed: torch.Tensor, plan) -> torch.Tensor:
        """A :attr:`whole_forward` rule's mask: logits (B, Hkv, G, T, T), allowed (B, 1, 1, T, T) bool causal and
        padding, ``plan`` (:meth:`mask_plan`) -> bool broadcastable to the logits."""
        raise NotImplementedError(f"{type(self).__name__} is not a whole-forward rule")  # abstract

    # ---------------------------------------------------- restricting policies
    def restrict(self, logits: torch.Tensor, acc: torch.Tensor, allowed: torch.Tensor,
                 counts: Counts) -> torch.Tensor:
        """Restrict queries: logits (B, Hkv, G, q, S), acc (B, Hkv, 1, 1, S), allowed (bool, broadcastable) -> bool.

        G is the number of query heads per KV head (1 without grouped-query attention).
        """
        raise NotImplementedError(f"{type(self).__name__} is not a restricting policy")  # abstract

    def describe(self) -> dict:
        out = {"policy": self.name, "budget": self.budget, "heavy": self.heavy, "recent": self.recent}
        return {**out, **self.schedule.describe()}  # the default timing (decode) unnamed

    def __repr__(self):
        return f"{type(self).__name__}(heavy={self.heavy}, recent={self.recent})"
