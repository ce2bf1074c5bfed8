"""Every option of every policy adakv wraps is reachable through ``policy=adakv policy.inner=<name>
policy.<option>=...`` (Hydra), lm-eval's ``--model_args policy=adakv,inner=<name>,<option>=...`` and the API, and
builds the inner policy the option names; an option the inner does not take is refused in one line naming those it
takes (Hydra: exit status 2 before anything loads). No model is loaded."""
from __future__ import annotations

import inspect

import pytest
from lm_eval.utils import simple_parse_args_string

from h2o import PolicyError, make_policy
from h2o.assets.policy_config import group_file
from h2o.core.policies import Policy
from h2o.core.policies.adakv import INNER_OPTIONS, inner_names
from h2o.pipeline.spec import build
from h2o.pipeline.sweep import _compose

BASE = {"self", "budget", "heavy", "recent", "heavy_share"}  # every policy's: adakv's own, passed to the inner
VALUES = {"window": 32, "kernel": 3, "beta": 10, "score": "mean", "seed": 3, "sinks": 2, "n_future_positions": 64,
          "n_sink": 2, "use_covariance": False, "use_vnorm": False, "epsilon": 0.01, "history": 200,
          "count": "important"}  # a value other than every inner's default
TOGETHER = {"decay": {"score": "decay", "decay": 0.9}}  # decay is read only with score=decay


def takes(name: str) -> list[str]:
    """The constructor options of policy ``name`` beyond the budget's."""
    return [k for k in inspect.signature(Policy.registry[name].__init__).parameters if k not in BASE]


def hydra_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


CASES = [(inner, TOGETHER[option] if option in TOGETHER else {option: VALUES[option]})
         for inner in inner_names() for option in takes(inner)]


def state(p: Policy) -> tuple:
    return type(p), {k: state(v) if isinstance(v, Policy) else v for k, v in vars(p).items()}


def test_every_inner_option_is_an_adakv_option_and_a_key_of_its_file():
    """INNER_OPTIONS covers every wrapped policy's constructor, and conf/policy/adakv.yaml has each (null), so Hydra
    sets it without a ``+``; the cases below cover every (inner, option) pair."""
    needed = {k for inner in inner_names() for k in takes(inner)}
    assert needed <= set(INNER_OPTIONS), needed - set(INNER_OPTIONS)
    assert set(INNER_OPTIONS) <= set(group_file("adakv")), set(INNER_OPTIONS) - set(group_file("adakv"))
    assert all(group_file("adakv")[k] is None for k in INNER_OPTIONS)
    assert {"snapkv", "scissorhands", "h2o", "expected_attention", "random", "streaming_llm"} <= set(inner_names())
    assert len(CASES) == sum(len(takes(n)) for n in inner_names()) >= len(set(INNER_OPTIONS))


@pytest.mark.parametrize("inner,options", CASES, ids=[f"{i}-{'-'.join(o)}" for i, o in CASES])
def test_hydra_lm_eval_and_the_api_pass_the_option_to_the_inner(hydra_ctx, inner, options):
    from h2o.tasks.lm_eval_model import lm_policy

    hydra = build("policy", _compose(["policy=adakv", f"policy.inner={inner}",
                                      *(f"policy.{k}={hydra_value(v)}" for k, v in options.items())]).policy)
    args = simple_parse_args_string("pretrained=tiny:llama,policy=adakv,inner=" + inner + "".join(
        f",{k}={v}" for k, v in options.items()))  # lm-eval's own parser
    lm = lm_policy(args.pop("policy"), args)
    api = make_policy("adakv", inner=inner, **options)
    assert args == {"pretrained": "tiny:llama"}  # every key was taken as a policy option
    assert state(hydra) == state(lm) == state(api)
    alone = make_policy(inner, **options)  # the inner built by itself with the option
    assert state(api.inner) == state(alone) and state(alone) != state(make_policy(inner))
    assert all(api.describe()[k] == v for k, v in options.items()), api.describe()


@pytest.mark.parametrize("inner,option,value", [("snapkv", "history", 200), ("scissorhands", "kernel", 3),
                                                ("tova", "window", 32)])
def test_an_option_the_inner_does_not_take_is_one_line_naming_what_it_takes(inner, option, value):
    from h2o.tasks.lm_eval_model import lm_policy

    own = [k for k in INNER_OPTIONS if k in takes(inner)]
    want = f"{option}={value}: inner={inner} has no option {option}; allowed with inner={inner}: " + (
        ", ".join(own) or "none")
    for call in (lambda: make_policy("adakv", inner=inner, **{option: value}),
                 lambda: lm_policy("adakv", {"inner": inner, option: value})):
        with pytest.raises(PolicyError) as err:
            call()
        assert str(err.value).startswith(want) and "\n" not in str(err.value), str(err.value)


def test_hydra_refuses_it_with_exit_2_before_anything_loads(capsys, tmp_path, monkeypatch):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    assert main(["policy=adakv", "policy.inner=snapkv", "policy.history=200", "model=tiny-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "history=200: inner=snapkv has no option history; allowed with inner=snapkv: window, kernel" in err[0]
