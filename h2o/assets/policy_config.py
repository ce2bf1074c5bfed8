"""One spelling of a policy for every entry point: its Hydra group file ``conf/policy/<name>.yaml`` plus options.

    h2o-run policy=h2o policy.budget=0.2 policy.heavy_share=0.5                  Hydra
    python -m h2o.tasks.lm_eval_cli --model_args policy=h2o,budget=0.2,heavy_share=0.5,...      lm-eval
    python -m h2o.bench.streaming --policy h2o,heavy_share=0.5 --budgets 96     (the budget: --budgets)

Each builds the same object: the group file's values, updated with the options given (the file's keys only, the
values read by Hydra's own override grammar), passed to the file's ``_target_`` (:func:`h2o.make_policy`), as
Hydra's ``instantiate`` of ``cfg.policy`` does. Older spellings that still work print a one-line notice
(:func:`notice`) and name the current one.
"""
from __future__ import annotations

import sys

from h2o.assets.paths import CONF, group_defaults

SKIP = ("_target_", "name")
TIMING = "compress"  # every policy takes it (Policy.timed), its file naming it or not (Hydra: ++policy.compress)


def group_file(name: str) -> dict:
    """``conf/policy/<name>.yaml`` as a dict (less ``_target_``); PolicyError naming the allowed names."""
    from h2o.core.policies import POLICIES, PolicyError

    if not isinstance(name, str) or name not in POLICIES or not (CONF / "policy" / f"{name}.yaml").is_file():
        raise PolicyError(f"policy={name!r}: unknown; allowed: {', '.join(POLICIES)}")
    return {k: v for k, v in group_defaults("policy", name).items() if k != "_target_"}


def policy_options(name: str, options: dict, where: str = "policy.") -> dict:
    """The group file's values updated with ``options``; a key the file does not have is a one-line PolicyError
    (``where``: how the caller spells an option, ``policy.`` for Hydra, ``--model_args `` for lm-eval)."""
    from h2o.core.policies import PolicyError

    base = group_file(name)
    bad = next((k for k in options if (k not in base and k != TIMING) or k in SKIP), None)
    if bad is not None:
        raise PolicyError(f"{where}{bad}: no such option for policy={name}; allowed: "
                          f"{', '.join([k for k in base if k not in SKIP] + [TIMING] * (TIMING not in base))}")
    return {**base, **options}


def build_policy(name: str, where: str = "policy.", **options):
    """The policy ``policy=<name> policy.<key>=<value> ...`` composes to in Hydra (conf/policy/<name>.yaml), with
    Hydra's check that no option given goes unread (``Policy.check_unused``)."""
    from h2o.core.policies import make_policy

    policy = make_policy(**policy_options(name, options, where))
    policy.check_unused(options, where)
    return policy


def at_budget(name: str, budget, where: str = "policy.", **options):
    """:func:`build_policy` with ``budget`` (a CLI's ``--budget``/``--budgets``); ``full`` takes none."""
    return build_policy(name, where, **options) if name == "full" else build_policy(name, where, budget=budget,
                                                                                    **options)


def parse(text: str, where: str = "--policy") -> tuple[str, dict]:
    """``"h2o,budget=0.2,heavy_share=0.5"`` (or ``"policy=h2o,..."``: lm-eval's model_args) -> (name, options);
    values by Hydra's override grammar (0.2, 1e-3, 96, null, true, sum). One-line PolicyError for a bad item."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from h2o.core.policies import PolicyError

    name, *items = [part.strip() for part in str(text).split(",")]
    name = name[len("policy="):] if name.startswith("policy=") else name
    parser, options = OverridesParser.create(), {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise PolicyError(f"{where}={text!r}: {item!r} is not key=value (e.g. h2o,budget=0.2,heavy_share=0.5)")
        try:
            options[key] = parser.parse_override(f"{key}={value}").value()
        except Exception:  # noqa: BLE001 - Hydra's grammar error: spell it in one line
            raise PolicyError(f"{where}={text!r}: {value!r} is not a value (a number, null, true/false or "
                              f"a word)") from None
    return name, options


_SAID: set[str] = set()


def notice(text: str) -> None:
    """One line on stderr, once per process, for an older spelling that still works."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"notice: {text}", file=sys.stderr, flush=True)
