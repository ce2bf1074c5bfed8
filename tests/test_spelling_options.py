"""One spelling of every policy option: each option the factory takes (a group file's keys, and the other arguments
of ``make_policy``: ``compress``, ``window``, ``kernel``, ``beta``, ``seed``, ``sinks``, ...) is an lm-eval
``model_args`` key and a streaming CLI ``--policy`` key, built by the same factory as Hydra's ``instantiate``."""
from __future__ import annotations

import inspect

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lm_eval.utils import simple_parse_args_string

from h2o import PolicyError, make_policy
from h2o.assets import policy_config
from h2o.assets.paths import CONF
from h2o.core.policies import POLICIES, Policy


@pytest.fixture
def hydra(hydra_ctx):
    return lambda overrides: instantiate(compose("config", overrides=overrides).policy)


def state(p: Policy) -> tuple:
    """A policy's class and attributes, a policy it wraps (combined policies, inner=...) compared the same way."""
    return type(p), {k: state(v) if isinstance(v, Policy) else v for k, v in vars(p).items()}


def same(a: Policy, b: Policy) -> bool:
    return state(a) == state(b)


def lm_eval(model_args: str) -> Policy:
    """The policy lm-eval's own parser and our model wrapper's factory build; every policy key is taken."""
    from h2o.tasks.lm_eval_model import lm_policy

    args = simple_parse_args_string(f"pretrained=tiny:llama,{model_args}")
    policy = lm_policy(args.pop("policy"), args)
    assert args == {"pretrained": "tiny:llama"}, args
    return policy


CASES = [  # (Hydra overrides, model_args / streaming spec less the budget)
    (["policy=snapkv", "policy.window=32", "policy.kernel=3"], "snapkv,window=32,kernel=3"),
    (["policy=pyramidkv", "policy.window=16", "policy.kernel=7", "policy.beta=10"],
     "pyramidkv,window=16,kernel=7,beta=10"),
    (["policy=tova", "+policy.compress=prefill"], "tova,compress=prefill"),  # not in tova's file: Hydra's +
    (["policy=random", "policy.seed=3", "+policy.compress=prefill"], "random,seed=3,compress=prefill"),
    (["policy=h2o", "policy.score=decay", "policy.decay=0.9"], "h2o,score=decay,decay=0.9"),
    (["policy=streaming_llm", "policy.sinks=2"], "streaming_llm,sinks=2"),
]


@pytest.mark.parametrize("overrides,spec", CASES, ids=[c[1] for c in CASES])
def test_every_option_is_spelled_alike_in_hydra_lm_eval_and_the_streaming_cli(hydra, overrides, spec):
    from h2o.tasks.streaming_parts import build_policy

    want = hydra([*overrides, "policy.budget=96", "policy.heavy_share=0.5"])
    assert same(lm_eval(f"policy={spec},budget=96,heavy_share=0.5"), want)
    assert same(build_policy(f"{spec},heavy_share=0.5", 96), want)
    name = spec.split(",")[0]
    assert not same(lm_eval(f"policy={name},budget=96,heavy_share=0.5"), want)  # the options changed the policy


@pytest.mark.parametrize("name", POLICIES)
def test_every_key_the_factory_takes_is_a_model_args_key(hydra, name):
    """Each policy with every one of its options given explicitly (at its default) through model_args: all are
    taken and it is Hydra's policy; the keys are its group file's, then the factory's others (``compress``)."""
    keys = policy_config.option_keys(name)
    init = inspect.signature(Policy.registry[name].__init__).parameters
    defaults = {**{k: p.default for k, p in init.items() if k != "self"}, **policy_config.group_file(name),
                "compress": make_policy(name).compress, "interval": make_policy(name).interval}
    assert "compress" in keys and set(policy_config.group_file(name)) - {"name"} <= set(keys)
    spelled = ",".join(f"{k}={'null' if defaults[k] is None else defaults[k]}" for k in keys)
    assert same(lm_eval(f"policy={name},{spelled}"), hydra([f"policy={name}"]))


@pytest.mark.parametrize("call, words", [
    (lambda: lm_eval("policy=local,budget=0.2,window=8"),
     ["--model_args window: no such option for policy=local", "allowed: budget, heavy, recent, heavy_share, compress"]),
    (lambda: lm_eval("policy=tova,compress=later"), ["compress='later'", "allowed: decode, prefill"]),
    (lambda: policy_config.at_budget("snapkv", 96, "--policy ", beta=3),
     ["--policy beta: no such option for policy=snapkv", "heavy_share, compress, window, kernel"]),
])
def test_an_option_the_policy_does_not_take_is_one_line(call, words):
    with pytest.raises(PolicyError) as e:
        call()
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
