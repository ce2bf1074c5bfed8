"""The budget checks every policy carries (:class:`h2o.core.policies.base.Policy` inherits them): which parts a
rule reads, which requests a ratio clamps, a ratio that yields no token at the model's longest context, and options
a rule does not read. All on the host, before or outside the forward passes."""
from __future__ import annotations

import torch

from .budget import BudgetPart, PolicyError, to_count


class BudgetChecks:
    """Mixin of :class:`~h2o.core.policies.base.Policy`: reads ``splits``, ``budget``, ``heavy``, ``recent``, ``name``."""

    def needs(self) -> list[tuple[str, BudgetPart, int]]:
        """(name, part, tokens) for each budget part the rule reads and the tokens it needs from it: each part
        that is not 0 needs one token; a policy that reads only the whole budget needs it to hold one."""
        if not self.splits:
            return [("budget", self.budget, 1)]
        return [(name, part, 1) for name, part in (("heavy", self.heavy), ("recent", self.recent)) if part]

    def short(self, length: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the reference lengths (B,) at which a ratio part rounds below what it needs (:meth:`needs`),
        so :meth:`counts` raises it (the cache keeps less than the rule asks: the query alone, no heavy hitter,
        fewer sinks). Runs count these requests (metrics.json ``clamped_requests``); host tensors, no device read."""
        out = torch.zeros(length.shape, dtype=torch.bool)
        for _, part, need in self.needs():
            if isinstance(part, float):
                out |= to_count(part, length.cpu()) < need
        return out

    def check_reach(self, longest: int, where: str) -> None:
        """PolicyError when a ratio part gives less than it needs even at ``longest`` tokens (the model's longest
        context, named by ``where``): every request would be clamped (:meth:`short`)."""
        self.check_token_options(getattr(self, "token_options", ()), longest, where)
        for name, part, need in self.needs():
            if isinstance(part, float) and int(to_count(part, torch.tensor([longest]))[0]) < need:
                scale = part / self.budget if isinstance(self.budget, float) and self.budget > 0 else 1.0
                least = need / (longest * scale)
                of = "" if name == "budget" else f" (its {name} part {part:.3g})"
                raise PolicyError(f"budget={self.budget:g}{of}: {part:.3g} x {longest} positions ({where}) = "
                                  f"{part * longest:.3g} tokens; {self.name} needs at least {need} there; "
                                  f"allowed: a ratio >= {float(f'{least * 1.0005:.3g}'):g} or a token count")

    def check_token_options(self, names, longest: int, where: str) -> None:
        """PolicyError for an option of ``names`` that is a token count longer than ``longest`` tokens (the model's
        longest context, named by ``where``): no sequence the model holds has that many. :meth:`check_reach` checks
        :attr:`token_options` (scissorhands' ``history``, an observation ``window``: a per-slot history of that
        length is allocated), :meth:`check_run_counts` the counts a whole run's sequence bounds."""
        for name in names:
            value = getattr(self, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > longest:
                low = 0 if name == "n_sink" else 1
                raise PolicyError(f"{name}={value}: longer than any sequence the model holds ({longest} positions, "
                                  f"{where}); allowed: {name} in {low}-{longest} tokens")

    def check_run_counts(self, longest: int, where: str) -> None:
        """PolicyError for a token count that a whole run's sequence bounds, longer than ``longest`` (the model's
        positions, named by ``where``): the schedule's ``interval`` (no cut would come after the prompt's) and
        :attr:`run_count_options` (kvzip's sinks and replay chunk). Not checked against a benchmark's prompt alone
        (its generated tokens come after)."""
        self.check_token_options(("interval", *getattr(self, "run_count_options", ())), longest, where)

    def check_rotary(self, rotary: bool | None, model: str) -> None:
        """PolicyError when the rule reads the queries before RoPE (expected_attention) and the model's config says
        it has no rotary embedding (``rotary`` False; None: unknown, left to the check at attach, h2o.core.prerope):
        the same refusal as at attach, from the config, before the model loads."""
        if rotary is False and getattr(self, "reads_queries", False) and not getattr(self, "is_full", False):
            raise PolicyError(f"policy={self.name}: model {model} has no rotary embedding in its config (its queries "
                              f"carry no rotation to undo); allowed: a model with rotary embeddings in rotate-half "
                              f"layout (Llama, Mistral, Qwen, Gemma, GPT-NeoX)")

    def check_unused(self, options, prefix: str = "policy.") -> None:
        """PolicyError for an option (a mapping as given) the rule does not read: the same computation as without
        it, which a run would record in a second folder. The API takes them (tests pass ``decay`` to every score)."""
        import inspect

        given = [k for k in ("heavy", "recent") if not self.splits and options.get(k) is not None]
        if given:
            raise PolicyError(f"{', '.join(f'{prefix}{k}={options[k]}' for k in given)}: {self.name} reads only the "
                              f"whole budget, no heavy/recent split; allowed: {prefix}budget={self.budget:g} (their "
                              f"sum) with heavy and recent null")
        default = inspect.signature(type(self).__init__).parameters.get("decay")
        score = options.get("score", "sum")
        if default is not None and score != "decay" and options.get("decay", default.default) != default.default:
            raise PolicyError(f"{prefix}decay={options['decay']}: read only with {prefix}score=decay (here score="
                              f"{score}); allowed: {prefix}score=decay, or decay left at {default.default}")
