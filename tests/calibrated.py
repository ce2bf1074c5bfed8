"""A rule that reads a model's offline statistics (``Policy.needs_calibration``: triattention) as a run has it: the
generic tests build every registered rule by name and hand it here with the model at hand. Over a tiny model it is
calibrated on a few sentences of Austen (h2o.assets.triattention.calibrate: a model without RoPE refuses there in
one line, as a run does); without a model (a test of the attention function on random tensors), statistics drawn at
random in the calibration's format: the rule's mechanics, not a model's preference."""
import torch

AUSTEN = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
          "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
          "considered the rightful property of some one or other of their daughters.")


def austen_ids() -> torch.Tensor:
    from h2o.assets.tiny import byte_tokenizer

    return torch.tensor(byte_tokenizer()(AUSTEN, add_special_tokens=False).input_ids)[None]  # (1, T)


def random_stats(layers: int, heads: int, head_dim: int, seed: int = 0) -> dict:
    """Statistics in the calibration's format for ``layers`` layers of ``heads`` query heads: the default rotary
    (base 10000) over the whole head, the mean queries drawn at random."""
    g, F = torch.Generator().manual_seed(seed), head_dim // 2
    omega = (10000.0 ** (-torch.arange(F, dtype=torch.float64) / F)).expand(layers, F)
    mean = torch.randn(layers, heads, F, 2, generator=g)
    return {"layers": layers, "rotary": torch.full((layers,), head_dim), "omega": omega,
            "scale": torch.ones(layers, F, dtype=torch.float64), "q_mean_real": mean[..., 0],
            "q_mean_imag": mean[..., 1], "q_abs_mean": mean.norm(dim=-1) + torch.rand(layers, heads, F, generator=g),
            "digest": "random", "model": "random"}


def ready(policy, model=None, layers: int = 1, heads: int = 4, head_dim: int = 16):
    """``policy`` with its statistics where it reads some: ``model``'s (calibrated here), else random ones of that
    shape; any other policy as it is."""
    if not getattr(policy, "needs_calibration", False):
        return policy
    if model is None:
        return policy.calibrated(random_stats(layers, heads, head_dim))
    from h2o.assets.triattention import calibrate

    return policy.calibrated(calibrate(model, austen_ids(), "test", {"model": "test"}))
