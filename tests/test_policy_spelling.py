"""One spelling of a policy: the policy h2o_reference (the paper code's mask rule, formerly ``semantics=reference``)
and one factory for Hydra, lm-eval's model_args, the streaming CLI and ``python -m h2o.bench``."""
from __future__ import annotations

import json

import pytest
import torch
from lm_eval.utils import simple_parse_args_string
from omegaconf import OmegaConf

from h2o import PolicyError, attach, make_policy
from h2o.assets import policy_config
from h2o.assets.models import tiny_model
from h2o.core.policies.h2o import reference_mask
from h2o.pipeline.spec import build, prepare
from h2o.assets.paths import CONF
from h2o.store.folders import COMPLETE
from h2o.store.identity import identity
from h2o.pipeline.sweep import _compose


def same(a, b) -> bool:
    """Equal policies: one class, one state (``quant`` None, as a run_spec sets it, is the class default)."""
    state = lambda p: {k: v for k, v in vars(p).items() if not (k == "quant" and v is None)}  # noqa: E731
    return type(a) is type(b) and state(a) == state(b)


def ids(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- h2o_reference = the authors' mask
def masked_eager(heavy: int, recent: int):
    """An attention function for transformers' AttentionInterface: eager attention (no GQA, no padding) whose
    rows see what ``reference_mask`` allows, written apart from h2o.core.simulate."""
    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        T = query.shape[2]  # query/key/value (B, H, T, D)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        logits = (query @ key.transpose(-1, -2) * scaling).float().masked_fill(~causal, -torch.inf)  # (B, H, T, T)
        probs = torch.softmax(logits.masked_fill(~reference_mask(logits, heavy, recent), -torch.inf), -1)
        return (probs.to(value.dtype) @ value).transpose(1, 2), probs  # (B, T, H, D)
    return attend


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_h2o_reference_is_the_paper_codes_mask_in_both_spellings(budget):
    from transformers import AttentionInterface

    model, x = tiny_model("llama"), ids(24)
    with torch.no_grad():
        with attach(model, make_policy("h2o_reference", budget=budget)):
            new = model(x).logits
        with attach(model, make_policy("h2o", budget=budget), semantics="reference"):
            old = model(x).logits
        with attach(model, make_policy("h2o", budget=budget)):
            h2o = model(x).logits
        counts = make_policy("h2o", budget=budget).counts(torch.tensor([24]))
        AttentionInterface.register("ref_mask_test", masked_eager(int(counts.heavy), int(counts.recent)))
        model.set_attn_implementation("ref_mask_test")
        ref = model(x).logits
        model.set_attn_implementation("eager")
    assert torch.equal(new, old)
    assert torch.allclose(new, ref, atol=1e-5)
    assert not torch.allclose(new, h2o, atol=1e-3)  # the rule differs from h2o's: the test is not blind


def test_h2o_reference_keeps_the_reference_guards():
    """Simulated only; no sliding window; padding fails in one line (each guard as semantics=reference had)."""
    model = tiny_model("llama")
    with pytest.raises(PolicyError, match="h2o_reference.*mode=real; allowed: mode=simulated"):
        with attach(model, make_policy("h2o_reference"), mode="real"):
            pass
    with pytest.raises(PolicyError, match="the paper code's rule has no sliding window"):
        with attach(tiny_model("gemma3"), make_policy("h2o_reference")):
            pass
    mask = torch.ones(1, 24, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad(), attach(model, make_policy("h2o_reference")):
        with pytest.raises(ValueError, match="needs unpadded input") as e:
            model(ids(24), attention_mask=mask)
    assert "\n" not in str(e.value)
    for bad, needle in ((make_policy("local"), "got local"), (make_policy("h2o", score="mean"), "score=mean")):
        with pytest.raises(PolicyError, match=needle) as e:
            with attach(model, bad, semantics="reference"):
                pass
        assert "h2o or h2_only" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------ records: today's folders are kept
@pytest.mark.parametrize("new,old,folder", [
    (["policy=h2o_reference"], ["policy=h2o", "semantics=reference"], "h2o/0.2/semantics=reference"),
    (["policy=h2o_reference", "policy.budget=64"], ["policy=h2o", "policy.budget=64", "semantics=reference"],
     "h2o/64tok/semantics=reference"),
    (["policy=h2o_reference", "policy.heavy=0.15", "policy.recent=0.05"],
     ["policy=h2o", "policy.heavy=0.15", "policy.recent=0.05", "semantics=reference"],
     "h2o/h0.15-r0.05/semantics=reference"),
])
def test_both_spellings_share_todays_record(hydra_ctx, tmp_path, capsys, new, old, folder):
    root = [f"runs_dir={tmp_path}", "task=bb_copa"]
    a, b = prepare(_compose(root + new)), prepare(_compose(root + old))
    assert a.path == b.path and a.path.relative_to(tmp_path).as_posix().endswith("/" + folder)
    assert same(a.policy, b.policy) and a.policy.name == "h2o_reference" and a.semantics == b.semantics == "reference"
    assert a.head() == b.head() and a.head()["policy"] == "h2o"
    ident = identity(b.cfg, build("policy", b.cfg.policy), b.semantics)
    assert identity(a.cfg, build("policy", a.cfg.policy), a.semantics) == ident
    # a record finished under the older spelling is reused by the new one (check_reusable compares identities)
    b.path.mkdir(parents=True)
    (b.path / "config.yaml").write_text(OmegaConf.to_yaml(b.cfg, resolve=True))
    (b.path / "metrics.json").write_text(json.dumps({**{k: 1 for k in COMPLETE}, "metrics": {}, **b.head()}))
    assert prepare(_compose(root + new)).path == b.path
    err = capsys.readouterr().err
    assert err.count("notice: semantics=reference is spelled policy=h2o_reference now") <= 1  # once per process


def test_h2_only_alias_keeps_its_folder(hydra_ctx, tmp_path):
    run_spec = prepare(_compose([f"runs_dir={tmp_path}", "policy=h2_only", "semantics=reference"]))
    assert run_spec.path.relative_to(tmp_path).as_posix().endswith("/h2_only/0.2/semantics=reference")
    assert same(run_spec.policy, make_policy("h2o_reference", heavy=0.2, recent=0.0))


@pytest.mark.parametrize("args, words", [
    (["policy=h2o_reference", "semantics=simulated"], ["semantics=simulated", "h2o_reference", "semantics=auto"]),
    (["policy=h2o_reference", "task=xsum"], ["policy=h2o_reference", "xsum", "real"]),
    (["policy=h2o", "policy.score=mean", "semantics=reference"], ["score=mean", "h2o or h2_only"]),
])
def test_bad_reference_configs_exit_2_in_one_line(args, words, capsys, tmp_path, monkeypatch):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and all(w in err for w in words), err


# ------------------------------------------------------------------------------ one factory, every entry point
CASES = [  # (Hydra overrides, lm-eval model_args, streaming spec, its older spelling)
    (["policy=h2o", "policy.budget=96", "policy.heavy_share=0.5", "policy.score=decay"],
     "policy=h2o,budget=96,heavy_share=0.5,score=decay", "h2o,heavy_share=0.5,score=decay",
     "h2o:heavy_share=1/2:score=decay"),
    (["policy=streaming_llm", "policy.budget=96", "policy.sinks=8", "policy.heavy_share=0.25"],
     "policy=streaming_llm,budget=96,sinks=8,heavy_share=0.25", "streaming_llm,sinks=8,heavy_share=0.25",
     "streaming_llm:sinks=8:heavy_share=1/4"),
    (["policy=h2o_reference", "policy.budget=96", "policy.heavy_share=0.5"],
     "policy=h2o_reference,budget=96,heavy_share=0.5", "h2o_reference,heavy_share=0.5", None),
    (["policy=full"], "policy=full", "full", None),
]


@pytest.mark.parametrize("overrides,model_args,spec,older", CASES, ids=[c[2] for c in CASES])
def test_one_policy_from_hydra_lm_eval_and_the_streaming_cli(hydra_ctx, overrides, model_args, spec, older):
    from h2o.tasks.streaming_parts import build_policy
    from h2o.tasks.lm_eval_model import lm_policy

    hydra = build("policy", _compose(overrides).policy)
    args = simple_parse_args_string(f"pretrained=tiny:llama,{model_args}")  # lm-eval's own parser
    lm = lm_policy(args.pop("policy"), args)
    assert args == {"pretrained": "tiny:llama"}  # every policy option was taken
    assert same(hydra, lm) and same(hydra, build_policy(spec, 96))
    assert same(hydra, build_policy(f"policy={spec}", 96))  # model_args' own spelling
    if older:
        assert same(hydra, build_policy(older, 96))
    assert not same(hydra, build("policy", _compose(["policy=h2o", "policy.budget=95"]).policy))


def test_hydra_defaults_are_every_entry_points_defaults(hydra_ctx):
    """lm-eval's ``policy=local`` is Hydra's ``policy=local`` (budget 0.2 from conf/policy/local.yaml, where the
    class's own default is 1.0); python -m h2o.bench's variants build the same."""
    from h2o.bench.variants import Variant
    from h2o.tasks.lm_eval_model import lm_policy

    hydra = build("policy", _compose(["policy=local"]).policy)
    assert same(lm_policy("local", {}), hydra) and hydra.budget == 0.2
    assert same(Variant("policy", "local", 0.2).build(), hydra)


def test_older_lm_eval_spellings_still_work_with_a_notice(capsys):
    from h2o.tasks.lm_eval_model import lm_policy

    policy_config._SAID.clear()
    assert same(lm_policy("h2o", {"budget": 0.2}, "reference"), make_policy("h2o_reference", budget=0.2))
    assert same(lm_policy("h2o", {"heavy": 0.1, "recent": 0.1}), make_policy("h2o", budget=0.2))  # Hydra's keys
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["notice: --model_args semantics=reference is spelled policy=h2o_reference now; policy=h2o"]


@pytest.mark.parametrize("call, words", [
    (lambda: policy_config.build_policy("local", "--model_args ", sinks=8),
     ["--model_args sinks: no such option for policy=local", "allowed: budget, heavy, recent, heavy_share"]),
    (lambda: policy_config.parse("h2o,budget"), ["'budget' is not key=value"]),
    (lambda: policy_config.build_policy("nope"), ["policy='nope'", "allowed:", "h2o_reference"]),
])
def test_bad_policy_options_are_one_line(call, words):
    with pytest.raises(PolicyError) as e:
        call()
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--policy", "h2o,foo=1"], ["--policy foo: no such option for policy=h2o"]),
    (["--policy", "h2o", "--policies", "local"], ["give one of them"]),
    (["--policies", "h2o_reference"], ["h2o_reference", "allowed"]),
])
def test_streaming_cli_bad_policies_exit_2(argv, words, capsys):
    from h2o.tasks.streaming_cli import main

    assert main(["--model", "tiny:llama", "--budgets", "96", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
