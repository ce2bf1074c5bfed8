"""Quantization is an option of the cache and of the simulated values, never state of the policy: ``attach(model,
policy, quant=q)``, ``EvictingCache(..., quant=q)``, a run's ``Plan.quant`` and ``task.run(..., quant=q)``; the
older ``policy.quant = q`` still works with one notice. The policy h2o_reference is read from the policy: the core
takes no ``semantics`` string (its older keyword on ``attach`` still works with one notice)."""
from __future__ import annotations

import inspect

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core import notice as notices
from h2o.core.attach import Attached
from h2o.core.cache import EvictingCache
from h2o.core.quant import QuantError, Uniform

G = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731


def ids(T: int = 24, B: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (B, T), generator=G(seed))


def logits(model, policy, x, **kw) -> torch.Tensor:
    with torch.no_grad(), attach(model, policy, **kw):
        return model(x).logits


def generated(model, policy, x, **kw) -> tuple[torch.Tensor, EvictingCache]:
    with torch.no_grad(), attach(model, policy, mode="real", **kw) as h:
        cache = h.new_cache()
        out = model.generate(x, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out, cache


def test_quant_is_the_caches_option_and_leaves_the_policy_untouched(capsys):
    model, x, quant = tiny_model("llama"), ids(), Uniform(2, 16)
    policy = make_policy("h2o", budget=0.3)
    before = dict(vars(policy))
    quantized, plain = logits(model, policy, x, quant=quant), logits(model, policy, x)
    assert not torch.allclose(quantized, plain, atol=1e-3)  # 2-bit rows change the scores: not vacuous
    out, cache = generated(model, policy, x, quant=quant)
    assert cache.quant is not None and all(layer.quant is cache.quant for layer in cache.layers)
    assert cache.nbytes() < generated(model, policy, x)[1].nbytes()  # packed rows hold fewer bytes
    with attach(model, policy, mode="real", quant=quant) as h:
        assert isinstance(h, Attached) and h.quant is not None and h.new_cache().quant is h.quant
    assert vars(policy) == before and policy.quant is None
    assert capsys.readouterr().err == ""  # the current spelling prints nothing


def test_the_older_policy_quant_still_works_with_one_notice(capsys):
    model, x, quant = tiny_model("llama"), ids(seed=1), Uniform(4, 16)
    notices._SAID.clear()
    old = make_policy("h2o", budget=0.3)
    old.quant = quant
    old.quant = quant  # said once per process
    assert torch.equal(logits(model, old, x), logits(model, make_policy("h2o", budget=0.3), x, quant=quant))
    assert torch.equal(generated(model, old, x)[0], generated(model, make_policy("h2o", budget=0.3), x,
                                                                 quant=quant)[0])
    assert torch.equal(logits(model, old, x, quant=Uniform(2, 16)),  # an explicit quant wins over the older one
                       logits(model, make_policy("h2o", budget=0.3), x, quant=Uniform(2, 16)))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["notice: policy.quant = q is spelled attach(model, policy, quant=q) now (the cache's option)"]


def test_the_core_takes_the_policy_not_a_semantics_string(capsys):
    from h2o.core import simulate
    from h2o.core.model_settings import refuse_unsupported

    for fn in (simulate.forward_plan, simulate.simulated_attention, refuse_unsupported):
        assert "semantics" not in inspect.signature(fn).parameters, fn.__name__
    assert "semantics" not in {f.name for f in Attached.__dataclass_fields__.values()}
    model, x = tiny_model("llama"), ids(seed=2)
    notices._SAID.clear()
    ref = logits(model, make_policy("h2o_reference", budget=0.4), x)
    assert torch.equal(logits(model, make_policy("h2o", budget=0.4), x, semantics="reference"), ref)
    assert not torch.allclose(logits(model, make_policy("h2o", budget=0.4), x), ref, atol=1e-4)
    assert capsys.readouterr().err.count("notice: attach(..., semantics='reference') is spelled") == 1


def test_a_task_takes_the_quantizer_as_an_argument():
    """perplexity's run(quant=q) scores each window as attach(quant=q) does, and differs from quant=None."""
    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.perplexity import PerplexityTask

    model, tok = ModelSpec("tiny-llama", "tiny:llama").load()
    task = PerplexityTask("austen_ppl", window=32, n_windows=2, stride=1, batch_size=2)
    policy, quant = make_policy("h2o", budget=0.3), Uniform(2, 16)
    got = task.run(model, tok, policy, "simulated", 0, quant=quant)
    wins = task.windows(tok)  # (2, 32)
    with torch.no_grad(), attach(model, policy, quant=quant):
        logp = model(wins).logits[:, :-1].float().log_softmax(-1)
    want = -logp.gather(-1, wins[:, 1:, None]).sum() / wins[:, 1:].numel()
    assert got.metrics["nll_per_token"] == pytest.approx(float(want), rel=1e-5)
    assert task.run(model, tok, policy, "simulated", 0).metrics["nll_per_token"] != pytest.approx(
        float(want), rel=1e-4)


def test_a_plan_carries_the_quantizer_and_a_task_that_cannot_store_it_refuses(capsys, tmp_path, monkeypatch):
    from h2o.assets import model_spec
    from h2o.pipeline.run import main
    from h2o.pipeline.sweep import expand

    spec, = expand(["model=tiny-llama", "task=austen_ppl", "quant=uniform", "quant.group_size=16"], True).specs
    assert isinstance(spec.quant, Uniform) and (spec.quant.bits, spec.quant.group_size) == (4, 16)
    assert "_quant" not in vars(spec.policy) and spec.head()["quant"] == spec.quant.describe()
    monkeypatch.chdir(tmp_path)
    model_spec._LOADED.clear()
    assert main(["model=tiny-llama", "task=observations", "quant=uniform", "quant.group_size=16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: quant=uniform4: task observations (observations) does not quantize its cache; "
                          "allowed: quant=none") and "\n" not in err, err
    assert not model_spec._LOADED and not (tmp_path / "runs").exists()


def test_lm_eval_takes_a_built_quantizer_as_the_model_args_build_it():
    """The tasks hand H2OLM a built quantizer; model_args spell it as strings: one quantizer, the same scores."""
    from lm_eval.api.instance import Instance

    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.lm_eval_model import H2OLM

    model, tok = ModelSpec("tiny-llama", "tiny:llama").load()
    args = dict(pretrained=model, tokenizer=tok, policy="h2o", budget=0.3, batch_size=2)
    built = H2OLM(**args, quant=Uniform(2, 16))
    spelled = H2OLM(**args, quant="uniform", quant_bits=2, quant_group_size=16)
    assert built.quant.describe() == spelled.quant.describe() and built.policy.quant is None
    reqs = [Instance("loglikelihood", {}, r, 0) for r in (("A question:", " an answer"), ("Q:", " longer one"))]
    assert built.loglikelihood(reqs) == spelled.loglikelihood(reqs)
    with pytest.raises(QuantError, match="quant_bits: options of a named quant; a built quantizer"):
        H2OLM(**args, quant=Uniform(2, 16), quant_bits=4)
