"""What every conf/task/*.yaml instantiates: a cheap, validated spec whose ``run`` does the work.

    task = hydra.utils.instantiate(cfg.task)            # validates, loads nothing
    result = task.run(model, tokenizer, policy, semantics="simulated", seed=0, quant=None)

Subclasses: :class:`h2o.tasks.multiple_choice.LmEvalTask` (multiple choice through lm-eval),
:class:`h2o.tasks.summarization.SummarizationTask` (HELM XSUM/CNN-DM, real evicting cache),
:class:`h2o.tasks.perplexity.PerplexityTask` (long-book perplexity, simulated mask per window).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from h2o.core.validate import ConfigError, check


@dataclass
class Result:
    """What a task returns: aggregate metrics, one dict per sample, and extra record fields."""

    metrics: dict[str, float]
    samples: list[dict]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return len(self.samples)


class TaskSpec:
    kind: ClassVar[str] = ""  # multiple_choice | summarization | perplexity (metrics.json task_kind)
    semantics: ClassVar[tuple[str, ...]] = ()  # allowed semantics; the first is the default ("auto")
    quantizes: ClassVar[bool] = False  # True: ``run`` stores keys and values with the run's quantizer (``quant``)

    def resolve_semantics(self, requested: str) -> str:
        """``auto`` -> this kind's default; anything not allowed -> ConfigError."""
        if requested == "auto":
            return self.semantics[0]
        if requested not in self.semantics:
            raise ConfigError(f"semantics={requested!r}: task {self.name} ({self.kind}) allows "
                              f"auto, {', '.join(self.semantics)}")
        return requested

    def check_model(self, model) -> None:
        """ConfigError when this task cannot run on ``model`` (an h2o.assets.model_spec.ModelSpec), judged from
        its config.json without loading (context length, layers); nothing to check by default."""

    def check_data(self) -> None:
        """ConfigError when data this task reads at run time is neither on this machine nor fetched by the task
        itself (``make prefetch`` fetches it): checked by the runner before the model loads, not by a dry run
        (a sweep is listed before its data are fetched); nothing to check by default."""

    def check_policy(self, policy) -> None:
        """ConfigError when this task cannot run ``policy`` (a built h2o.core.policies.Policy), before any load;
        nothing to check by default."""

    def check_quant(self, quant) -> None:
        """ConfigError when this task cannot store its cache with ``quant`` (a built h2o.core.quant quantizer, or
        None for quant=none), before any load: a task that does not quantize refuses every quantizer."""
        if quant is not None and not self.quantizes:
            raise ConfigError(f"quant={quant.label()}: task {self.name} ({self.kind}) does not quantize its cache; "
                              f"allowed: quant=none")

    def run(self, model, tokenizer, policy, semantics: str, seed: int,
            quant=None) -> Result:  # pragma: no cover - abstract
        """``quant``: the KV quantizer the caches store with (None: unquantized; checked by :meth:`check_quant`)."""
        raise NotImplementedError  # abstract

    def add_bos(self, tokenizer) -> bool:
        """Whether the token sequences this task scores start with BOS (resolved: never None). Default: the task
        builds its ids without special tokens (perplexity windows, random-token benchmarks)."""
        return False

    def protocol(self, tokenizer) -> dict[str, Any]:
        """Every setting of this task that changes a number (its config fields less ``name`` and ``batch_size``),
        with ``add_bos_token`` resolved and ``scoring`` (None unless multiple choice): metrics.json ``protocol``."""
        out = {f.name: getattr(self, f.name) for f in (fields(self) if is_dataclass(self) else ())
               if f.name not in NOT_PROTOCOL}
        return {**out, "scoring": getattr(self, "scoring", None), "add_bos_token": self.add_bos(tokenizer)}


NOT_PROTOCOL = ("name", "batch_size")  # settings that cannot change a number


def stderr(values: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n); lm-eval's mean_stderr); 0 for n < 2."""
    n = len(values)
    if n < 2:
        return 0.0
    mu = sum(values) / n
    return (sum((v - mu) ** 2 for v in values) / (n - 1)) ** 0.5 / n ** 0.5


def adds_bos(tokenizer, add_bos_token: bool | None) -> bool:
    """Whether encoding with ``add_bos_token`` (lm-eval's meaning: None = the tokenizer's default, which adds BOS
    for LLaMA and OPT; True/False = ``add_special_tokens``) puts BOS first."""
    kwargs = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and tokenizer.encode("a", **kwargs)[:1] == [bos]


def as_run(policy, semantics: str):
    """The policy a task runs: ``policy``, or under ``semantics="reference"`` (its second spelling) the paper code's
    rule on its heavy/recent split (a RunSpec hands over that rule already; a direct ``run`` call may not)."""
    from h2o.core.engine import as_paper_rule

    return as_paper_rule(policy) if semantics == "reference" else policy


def clamped(policy, lengths: list[int]) -> int:
    """How many requests of these reference lengths the policy's budget rounds a part of to zero (it is raised:
    h2o.core.policies.base.Policy.short): metrics.json ``clamped_requests``. Host ints, no device read."""
    import torch

    return int(policy.short(torch.tensor(lengths, dtype=torch.long)).sum()) if lengths else 0


def cells(samples: list[dict], by_depth: bool, metric: str = "acc") -> list[dict]:
    """The mean score per (length, depth) cell (per length without depths), in the order first seen."""
    groups: dict[tuple, list[float]] = {}
    for s in samples:
        groups.setdefault((s["length"], s["depth"]) if by_depth else (s["length"],), []).append(s[metric])
    keys = ("length", "depth") if by_depth else ("length",)
    return [{**dict(zip(keys, k)), "n": len(v), metric: sum(v) / len(v)} for k, v in groups.items()]


def positive_or_none(name: str, value) -> None:
    check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
          f"{name}={value!r}: expected a positive int or null")


def check_room(key: str, gen_tokens: int, max_pos: int | None, model: str) -> None:
    """ConfigError when ``gen_tokens`` new tokens leave no prompt in the model's ``max_pos`` positions (lm-eval
    keeps a prompt's last ``max_pos - gen_tokens`` tokens); unknown positions: not checked. h2o-run's tasks and the
    lm-eval wrapper's ``--gen_kwargs max_gen_toks``."""
    check(max_pos is None or gen_tokens < max_pos, f"{key}={gen_tokens}: leaves no prompt in model {model}'s "
                                                   f"{max_pos} positions; allowed: < {max_pos}")


_TRUE = ("1", "true", "yes", "on")


def offline_flag() -> str | None:
    """The name of the set offline switch (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE), or None."""
    import os

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return var
    return None


def hub_data_cached(*names: str) -> bool:
    """Whether the Hugging Face caches (datasets, hub) hold a folder whose name mentions one of ``names``
    (two levels deep: ``<owner>___<name>/<config>``, ``datasets--<owner>--<name>``). A cheap scan, no loading."""
    import os
    from pathlib import Path

    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    roots = [Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser(),
             Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()]
    wanted = [n.lower().replace("/", "___") for n in names if n] + [n.lower().replace("/", "--") for n in names if n]
    for root in roots:
        if not root.is_dir():
            continue
        for entry in [*root.glob("*"), *root.glob("*/*")]:
            if entry.is_dir() and any(w in entry.name.lower() for w in wanted):
                return True
    return False


def check_fetched(task: str, lost: str | None, how: str) -> None:
    """ConfigError when ``lost`` says why the data task ``task`` reads at run time are not on this machine (None:
    they are), naming ``make prefetch`` and then ``how`` (what else does: the module's own command, a local file)."""
    check(lost is None, f"task={task}: its data are not on this machine ({lost}); allowed: fetch them first with "
                        f"`make prefetch EXP=<experiment>`{how}")


def check_hub_data(task: str, dataset: str, names: tuple[str, ...]) -> None:
    """ConfigError when an offline switch is set and the hub data set is not in the local cache."""
    flag = offline_flag()
    check(flag is None or hub_data_cached(*names),
          f"task={task}: needs hub data ({dataset}) but {flag}=1 and it is not in the local Hugging Face cache; "
          f"allowed offline: the bb_* tasks and austen_ppl (or unset {flag})")
