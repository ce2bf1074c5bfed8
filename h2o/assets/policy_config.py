"""One spelling of a policy for every entry point: its Hydra group file ``conf/policy/<name>.yaml`` plus options.

    h2o-run policy=h2o policy.budget=0.2 policy.heavy_share=0.5                  Hydra
    python -m h2o.tasks.lm_eval_cli --model_args policy=h2o,budget=0.2,heavy_share=0.5,...      lm-eval
    python -m h2o.tasks.streaming_cli --policy h2o,heavy_share=0.5 --budgets 96     (the budget: --budgets)

Each builds the same object: the group file's values, updated with the options given (the file's keys only, the
values read by Hydra's own override grammar), passed to the file's ``_target_`` (:func:`h2o.make_policy`), as
Hydra's ``instantiate`` of ``cfg.policy`` does. A second spelling of the same thing is accepted with a one-line
notice (:func:`notice`) that names the first.
"""
from __future__ import annotations

from h2o.assets.paths import CONF, group_defaults
from h2o.core.notice import _SAID, notice  # noqa: F401 (re-exported: every entry point's notices)

SKIP = ("_target_", "name")


def group_file(name: str) -> dict:
    """``conf/policy/<name>.yaml`` as a dict (less ``_target_``); PolicyError naming the allowed names."""
    from h2o.core.policies import POLICIES, PolicyError

    if not isinstance(name, str) or name not in POLICIES or not (CONF / "policy" / f"{name}.yaml").is_file():
        raise PolicyError(f"policy={name!r}: unknown; allowed: {', '.join(POLICIES)}")
    return {k: v for k, v in group_defaults("policy", name).items() if k != "_target_"}


def option_keys(name: str) -> list[str]:
    """The options policy ``name`` takes: its group file's keys, then the other arguments its factory reads
    (:func:`h2o.make_policy`: the class's own arguments, and ``compress``, every policy's timing, with
    ``interval``, its option under ``compress=interval``; Hydra spells these with a ``+``:
    ``+policy.compress=prefill``)."""
    import inspect

    from h2o.core.policies import Policy

    params = inspect.signature(Policy.registry[name].__init__).parameters.values()
    own = [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    keys = [k for k in group_file(name) if k not in SKIP]
    return keys + [k for k in (*own, "compress", "interval") if k not in keys]


def policy_options(name: str, options: dict, where: str = "policy.") -> dict:
    """The group file's values updated with ``options``; a key the policy does not take (:func:`option_keys`) is
    a one-line PolicyError (``where``: how the caller spells an option, ``policy.`` for Hydra, ``--model_args ``
    for lm-eval)."""
    from h2o.core.policies import PolicyError

    base, allowed = group_file(name), option_keys(name)
    bad = next((k for k in options if k not in allowed), None)
    if bad is not None:
        raise PolicyError(f"{where}{bad}: no such option for policy={name}; allowed: {', '.join(allowed)}")
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
    from h2o.core.policies import PolicyError

    name, *items = [part.strip() for part in str(text).split(",")]
    name = name[len("policy="):] if name.startswith("policy=") else name
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise PolicyError(f"{where}={text!r}: {item!r} is not key=value (e.g. h2o,budget=0.2,heavy_share=0.5)")
        options[key] = read_value(key, value, f"{where}={text!r}")
    return name, options


def read_value(key: str, value: str, where: str):
    """One option's text as Hydra's override grammar reads ``policy.<key>=<value>`` (0.2, 1e-3, 96, null, true,
    sum); a one-line PolicyError (``where``: the text as given) otherwise."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from h2o.core.policies import PolicyError

    try:
        return OverridesParser.create().parse_override(f"{key}={value}").value()
    except Exception:  # noqa: BLE001 - Hydra's grammar error: spell it in one line
        raise PolicyError(f"{where}: {value!r} is not a value (a number, null, true/false or a word)") from None
