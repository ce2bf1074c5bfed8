"""TriAttention's calibration beside ours: the reference's ``scripts/calibrate.py`` and our
:func:`h2o.assets.triattention.calibrate`, each over :data:`TEXT` on the committed golden
model in bfloat16 (the reference's dtype), compared statistic by statistic (``python -m h2o.parity.triattention
--reference DIR``; docs/triattention.md)."""
from __future__ import annotations

from pathlib import Path

import torch

# the text both calibrations read (and the golden parity's: h2o.parity.triattention)
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his lady to him "
        "one day, have you heard that Netherfield Park is let at last?")


def calibration_ids() -> torch.Tensor:
    """:data:`TEXT` as the reference's calibration reads it (``tokenizer.encode``, the model folder's tokenizer)."""
    from transformers import AutoTokenizer

    from h2o.parity.golden import MODEL_DIR

    return AutoTokenizer.from_pretrained(MODEL_DIR).encode(TEXT, return_tensors="pt")


def ours_in_bf16() -> dict:
    """Our calibration of the committed model loaded in bfloat16 (the reference's dtype) over
    :func:`calibration_ids`."""
    from transformers import AutoModelForCausalLM

    from h2o.assets.triattention import calibrate
    from h2o.parity.golden import MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, attn_implementation="eager").eval()
    return calibrate(model, calibration_ids(), "bf16", {})


def reference_calibration(root: Path, tmp: Path) -> dict:
    """The reference's ``scripts/calibrate.py`` over :data:`TEXT` on the committed model (CPU, eager) -> per
    statistic (L, Hq, F) in our layout."""
    import importlib.util

    from h2o.parity.golden import MODEL_DIR

    spec = importlib.util.spec_from_file_location("triattention_reference_calibrate", root / "scripts" / "calibrate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp / "text.txt").write_text(TEXT)
    script.calibrate(str(MODEL_DIR), str(tmp / "text.txt"), str(tmp / "ref_stats.pt"), max_length=4096,
                     device="cpu", attn_implementation="eager")
    stats = torch.load(tmp / "ref_stats.pt", map_location="cpu", weights_only=True)["stats"]
    L, H = 1 + max(int(k[5:7]) for k in stats), 1 + max(int(k[12:14]) for k in stats)
    return {name: torch.stack([torch.stack([stats[f"layer{i:02d}_head{h:02d}"][name] for h in range(H)])
                               for i in range(L)]) for name in ("q_mean_real", "q_mean_imag", "q_abs_mean")}


def calibration_gaps(ours: dict, reference: dict) -> dict:
    """The largest |ours - reference| of each statistic (and the largest |reference|)."""
    return {k: {"largest_gap": float(f"{float((ours[k].float() - torch.as_tensor(v)).abs().max()):.2e}"),
                "largest": round(float(torch.as_tensor(v).abs().max()), 3)} for k, v in reference.items()}
