"""Figure 2 observations: the producer of observations.json."""
import types

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.tasks.observations import Hide, ObservationsTask


class CharTokenizer:
    def __call__(self, text, **kw):
        return types.SimpleNamespace(input_ids=torch.tensor([[ord(c) % 128 for c in text]]))


def test_hiding_every_token_leaves_each_query_only_itself():
    model = tiny_model("llama_gqa")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with attach(model, Hide(torch.ones(1, 2, 20, dtype=torch.bool))):
            hidden = model(ids).logits
        with attach(model, make_policy("local", budget=1)):
            alone = model(ids).logits
        plain = model(ids).logits
    assert torch.allclose(hidden, alone, atol=1e-5) and not torch.allclose(hidden, plain, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama_gqa", "opt"])
def test_observations_record(arch):
    model = tiny_model(arch)
    task = ObservationsTask(name="observations", window=48, n_windows=2, stride=3, mask_ratio=0.1)
    result = task.run(model, CharTokenizer(), make_policy("full"), "simulated", 0)
    obs = result.info["files"]["observations.json"]
    heads = model.config.num_attention_heads
    assert len(obs["sparsity_per_layer"]) == model.config.num_hidden_layers
    assert all(0 <= s <= 1 for s in obs["sparsity_per_layer"])
    # every query row sums to 1, so the column sums of a layer add up to heads x rows x windows
    assert sum(obs["accumulated_attention"]) == pytest.approx(heads * 48 * 2, rel=1e-4)
    assert set(obs["heavy_masked"]) == {"full", "heavy_masked", "random_masked"}
    assert result.metrics["acc_full"] == obs["heavy_masked"]["full"]


class OneDevice(torch.overrides.TorchFunctionMode):
    """Fails any op whose tensors sit on two devices (a 0-dim CPU tensor is allowed: CUDA accepts it too)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        assert len(devices) <= 1, f"{func.__name__} mixes {devices}"
        return func(*args, **kwargs)


def test_observations_keep_each_tensor_on_the_device_of_its_layer():
    """Meta tensors stand in for a GPU: an op mixing them with CPU tensors fails, as it would on CUDA."""
    task = ObservationsTask(name="observations", window=16, n_windows=1, stride=1, mask_ratio=0.25)
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_key_value_heads=2))
    probs = {0: torch.empty(4, 16, 16, device="meta"), 1: torch.empty(4, 16, 16, device="meta")}
    with OneDevice():
        sets = task.hidden_sets(model, probs, torch.Generator().manual_seed(0))
        sparsity = torch.zeros(2, device="meta")
        sparsity[1] += task.layer_sparsity(probs[1]).to(sparsity.device)
    assert {t.device.type for hidden in sets.values() for t in hidden.values()} == {"meta"}
    assert sets["random_masked"][1].shape == (1, 2, 16)
    with pytest.raises(AssertionError, match="mixes"), OneDevice():  # the mode does catch a mix
        torch.zeros(3).scatter_(0, torch.zeros(1, dtype=torch.long, device="meta"), 1.0)
