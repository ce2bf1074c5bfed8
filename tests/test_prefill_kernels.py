"""The attention a model was loaded with: every policy runs whatever it was (eager, sdpa: the same results); a
flash kernel (here a stand-in registered under a name with "flash") serves the real path's plain causal prefill;
load_model's and the model configs' default (h2o.assets.models.resolve_attention)."""
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from h2o import attach, make_policy
from h2o.assets.models import resolve_attention, tiny_model
from h2o.core.policies import REAL_POLICIES
from h2o.core import prefill
from tests.calibrated import ready
from h2o.core.prefill import own_kernel

CALLS = []
STAND_IN = "test_fused_stand_in"  # transformers loads a kernel for any name with "flash": none on a CPU


def stand_in(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa forward, counting its calls, taken for a flash kernel (prefill.is_flash patched)."""
    CALLS.append(query.shape[-2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(STAND_IN, stand_in)


def ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def run(model, policy, x, mask=None, steps: int = 2) -> torch.Tensor:
    """A prefill of x (2, T) and ``steps`` decoded tokens through the evicting cache -> logits (2, T + steps, V)."""
    mask = torch.ones_like(x) if mask is None else mask
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        out = [model(x, attention_mask=mask, cache=cache).logits]
        for t in range(steps):
            nxt = out[-1][:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out.append(model(nxt, attention_mask=mask, cache=cache).logits)
    return torch.cat(out, 1)


def loaded(attention: str):
    """The saved tiny LLaMA-GQA (with its tokenizer: kvzip replays the context through it) loaded with
    ``attention``."""
    from h2o.assets.models import load_model
    from h2o.assets.tiny import tiny_checkpoint

    model = load_model(str(tiny_checkpoint("llama_gqa")), attn_implementation=attention)[0]
    assert model.config._attn_implementation == attention
    return model


def policy(name: str, model=None):
    return make_policy("full") if name == "full" else ready(make_policy(name, budget=0.5), model)


@pytest.mark.parametrize("name", REAL_POLICIES)
def test_every_policy_runs_on_a_model_loaded_with_eager_attention(name):
    """Loaded with eager or sdpa attention, the same model gives the same logits under every policy (attached,
    the harness's attention runs): a padded batch's prefill and two decoded tokens."""
    x = ids(40)
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    eager_model = loaded("eager")
    rule = policy(name, eager_model)  # triattention: calibrated over the model (the same weights both ways)
    eager = run(eager_model, rule, x, mask)
    sdpa = run(loaded("sdpa"), rule, x, mask)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(eager, sdpa, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "knorm"])
def test_a_model_loaded_with_flash_attention_prefills_through_its_kernel(name, monkeypatch):
    """A first prompt without pads: one call of the model's own flash kernel per layer (h2o's rows then from each
    block's softmax), the logits those of sdpa's; with pads (a masked prefill) or a decoding token: not called."""
    model = tiny_model("llama_gqa", seed=2)
    x = ids(300)  # more rows than a block of the statistics pass
    want = run(model, policy(name), x)
    model.set_attn_implementation(STAND_IN)
    monkeypatch.setattr(prefill, "is_flash", lambda implementation: implementation == STAND_IN)
    CALLS.clear()
    got = run(model, policy(name), x)
    assert CALLS == [300] * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    CALLS.clear()
    run(model, policy(name), x, mask)
    assert CALLS == []


def test_which_loaded_attention_serves_the_prefill():
    assert own_kernel(None, "sdpa") is None and own_kernel(None, "eager") is None
    assert own_kernel(None, "paged|flash_attention_2") is None and own_kernel(None, "flash_unregistered") is None
    assert own_kernel(None, STAND_IN) is None and own_kernel(None, "flash_attention_2") is not None


def test_load_models_default_attention():
    """auto: sdpa on the CPU and in fp32 (flash attention only on CUDA in half precision, where installed)."""
    assert resolve_attention("auto", "cpu", torch.float32) == "sdpa"
    assert resolve_attention("auto", "cuda", torch.float32) == "sdpa"
    assert resolve_attention("eager", "cpu", torch.float32) == "eager"
    assert resolve_attention("kernels-community/flash-attn", "cuda", torch.bfloat16) == "kernels-community/flash-attn"
    with pytest.raises(ValueError, match="attn_implementation='fast': allowed: auto, sdpa, eager"):
        resolve_attention("fast", "cpu", torch.float32)


def test_model_configs_name_their_attention():
    from omegaconf import OmegaConf

    from h2o.assets.model_spec import ModelSpec
    from h2o.core.validate import ConfigError

    for path in sorted((Path(__file__).parents[1] / "conf" / "model").glob("*.yaml")):
        assert OmegaConf.load(path).attn_implementation == "auto", path
    with pytest.raises(ConfigError, match="model.attn_implementation='fast': allowed: auto"):
        ModelSpec("t", "tiny:llama", "fp32", attn_implementation="fast")


def test_auto_attention_on_a_gpu_is_flash_attention_where_installed(monkeypatch):
    import transformers.utils

    for installed, want in ((True, "flash_attention_2"), (False, "sdpa")):
        monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: installed)
        assert resolve_attention("auto", "cuda:0", torch.bfloat16) == want
        assert resolve_attention("auto", "cuda:0", torch.float32) == "sdpa"
