"""``python -m h2o.assets.triattention model=<name>``: TriAttention's query statistics for a model
(``policy=triattention``), as its reference's ``scripts/calibrate.py`` computes them, written once per model into
the cache.

    python -m h2o.assets.triattention model=smollm2-135m          # -> <cache>/triattention/<digest>.pt
    python -m h2o.assets.triattention model=tiny-llama windows=2 window=64

The model (a conf/model name) reads ``windows`` windows of ``window`` tokens of Jane Austen's novels (the text
KVQuant's calibration reads, between the windows ``austen_ppl`` scores: h2o.assets.calibrate); every layer's
queries are turned back to before RoPE (h2o.core.prerope: the rotation the module applied, undone) and, per query
head and rotary frequency (a channel pair ``(i, i + r/2)`` as one complex number), their mean and their mean modulus
are kept, with the rotary's frequencies and attention scaling per layer. The file is keyed by the sha256 of the
model's weight files (:func:`weights_digest`), which every run that uses it records (``policy.describe()``).

The reference runs one forward over one text of up to 32,768 tokens and recomputes the queries from ``q_proj``
(without a query norm: Qwen-3's ``q_norm`` is left out there); here several windows, and the queries the model
attended with (docs/triattention.md).
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from h2o.assets.paths import group_defaults

WEIGHTS = ("*.safetensors", "*.bin", "*.pt")  # the weight files of a checkpoint folder
FORMAT = 1


# ----------------------------------------------------------------------------------------------- where
def checkpoint_folder(pretrained: str) -> Path | None:
    """The local folder of a conf/model's ``pretrained`` (packaged, tiny, a folder, a hub id in the local cache),
    None where it is not on this machine (nothing is fetched)."""
    from h2o.assets.model_spec import resolve_pretrained

    try:
        path = Path(resolve_pretrained(pretrained))
    except Exception:  # a packaged model not fetched yet
        return None
    if path.is_dir():
        return path
    try:
        from transformers.utils import cached_file

        found = cached_file(str(pretrained), "config.json", local_files_only=True,
                            _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None
    return Path(found).parent if found else None


def weights_digest(folder: Path) -> str:
    """sha256 of the weight files in ``folder`` (names and bytes, in name order); remembered in the cache by path,
    size and time of each file, so a large checkpoint is read once."""
    from h2o.assets.paths import cache_dir

    files = sorted({p for pattern in WEIGHTS for p in Path(folder).glob(pattern)})
    if not files:
        raise FileNotFoundError(f"{folder}: no weight files ({', '.join(WEIGHTS)})")
    stamp = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    memo = cache_dir() / "triattention" / "digests.json"
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    if stamp in known:
        return known[stamp]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(json.dumps({**known, stamp: h.hexdigest()}))
    return h.hexdigest()


def stats_file(digest: str) -> Path:
    """Where the statistics of the model whose weights have ``digest`` live: ``<cache>/triattention/<digest>.pt``."""
    from h2o.assets.paths import cache_dir

    return cache_dir() / "triattention" / f"{digest}.pt"


def require(model) -> Path:
    """The statistics file of ``model`` (a :class:`h2o.assets.model_spec.ModelSpec`, a conf/model name or a
    ``pretrained`` id or folder), found without loading it; PolicyError in one line naming the command where there
    is none (Unsupported: a sweep lists the job as refused, naming the command, and runs the others)."""
    from h2o.core.policies import PolicyError
    from h2o.core.policies.budget import Unsupported

    if isinstance(model, str):
        name, pretrained = conf_name(model), model
        pretrained = group_defaults("model", model).get("pretrained", model)
    else:
        name, pretrained = model.name, model.pretrained
        if model.geometry()[1] is False:
            raise PolicyError(f"policy=triattention: model={name} has no rotary embedding in its config (its keys "
                              f"carry no rotation to undo); allowed: a model with RoPE (Llama, Mistral, Qwen, Gemma, "
                              f"GPT-NeoX)")
    folder = checkpoint_folder(pretrained)
    if folder is None:
        raise Unsupported(f"policy=triattention: model={name} is not on this machine, so it has no calibration; "
                          f"fetch it, then run `python -m h2o.assets.triattention model={name}`")
    try:
        path = stats_file(weights_digest(folder))
    except FileNotFoundError:  # a folder with a config and no weights (a tiny model built from its config)
        raise Unsupported(f"policy=triattention: model={name} has no weight files in {folder}, so it has no "
                          f"calibration; allowed: a model with its weights on this machine") from None
    if not path.is_file():
        raise Unsupported(f"policy=triattention: no calibration for model={name} (weights {path.stem[:12]}); write "
                          f"it once with `python -m h2o.assets.triattention model={name}`")
    return path


def conf_name(model: str) -> str:
    """The conf/model name of ``model`` (a name already, or a ``pretrained`` id one of them names; else itself)."""
    from h2o.assets.paths import CONF

    if (CONF / "model" / f"{model}.yaml").is_file():
        return model
    names = [p.stem for p in sorted((CONF / "model").glob("*.yaml"))]
    return next((n for n in names if group_defaults("model", n).get("pretrained") == model), model)


# ----------------------------------------------------------------------------------------------- statistics
def rotation(tap) -> tuple:
    """(inverse frequencies (r/2,) float64, attention scaling) of the rotary a layer applies (Gemma-3: its type's)."""
    kind = tap.kind[0] if tap.kind else None
    inv = getattr(tap.rotary, f"{kind}_inv_freq", None) if kind else None
    inv = tap.rotary.inv_freq if inv is None else inv
    scale = getattr(tap.rotary, f"{kind}_attention_scaling", None) if kind else None
    scale = getattr(tap.rotary, "attention_scaling", 1.0) if scale is None else scale
    return inv.double().cpu(), float(scale)


def query_stats(model, windows) -> dict:
    """The statistics of ``model``'s queries over ``windows`` (N, W) token ids (module doc): per layer ``omega`` and
    ``scale`` (F,) (the channels the rotary leaves: 0 and 1), ``rotary`` its channels, and per query head
    ``q_mean_real``, ``q_mean_imag``, ``q_abs_mean`` (F,); F = head size / 2."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from h2o.core.attach import attention_modules
    from h2o.core.policies.triattention import complex_pairs
    from h2o.core.prerope import rope_taps

    modules = attention_modules(model)
    taps = rope_taps(model, modules, "triattention")  # one line for a model without RoPE (OPT)
    sums: dict[int, list] = {}

    def recording(module, query, key, value, attention_mask, scaling, **kwargs):
        i = module.layer_idx
        q = taps[i].queries(query.detach()).before_rope(query.shape[2]).double()  # (1, Hq, T, D)
        c = complex_pairs(q, taps[i].applied[0].shape[-1])[0]  # (Hq, T, F)
        at = sums.setdefault(i, [0, 0, 0])
        at[0], at[1], at[2] = at[0] + c.sum(1), at[1] + c.abs().sum(1), at[2] + c.shape[1]
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("h2o_calibrate", recording)
    AttentionMaskInterface.register("h2o_calibrate", eager_mask)
    before = model.config._attn_implementation
    hooks = [m.register_forward_pre_hook(taps[m.layer_idx].capture, with_kwargs=True) for m in modules]
    model.set_attn_implementation("h2o_calibrate")
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in windows:
                model(row[None].to(device))
    finally:
        model.set_attn_implementation(before)
        for h in hooks:
            h.remove()
    out = {k: [] for k in ("omega", "scale", "rotary", "q_mean_real", "q_mean_imag", "q_abs_mean")}
    for i in sorted(sums):
        total, modulus, n = sums[i]
        mean = (total / n).cpu()  # (Hq, F)
        F = mean.shape[-1]
        inv, a = rotation(taps[i])
        r = 2 * inv.numel()
        out["omega"].append(torch.cat([inv, torch.zeros(F - r // 2, dtype=torch.float64)]))
        out["scale"].append(torch.cat([torch.full((r // 2,), a, dtype=torch.float64),
                                       torch.ones(F - r // 2, dtype=torch.float64)]))
        out["rotary"].append(r)
        out["q_mean_real"].append(mean.real.float())
        out["q_mean_imag"].append(mean.imag.float())
        out["q_abs_mean"].append((modulus / n).float().cpu())
    stacked = {k: torch.stack(v) for k, v in out.items() if k != "rotary"}
    return {**stacked, "rotary": torch.tensor(out["rotary"]), "layers": len(sums)}


def calibrate(model, windows, digest: str, meta: dict) -> dict:
    """The calibration dict ``policy=triattention`` reads (``stats=``): :func:`query_stats` and ``meta``."""
    return {"format": FORMAT, "digest": digest, "tokens": int(windows.numel()), **meta, **query_stats(model, windows)}


def save(cal: dict, path: Path) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(cal, tmp)
    tmp.replace(path)  # no half-written file
    return path


# ----------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    from h2o.cli.args import guard

    return guard(run)(sys.argv[1:] if argv is None else argv)


def run(argv: list[str]) -> int:
    from h2o.assets.calibrate import calibration_windows
    from h2o.assets.model_spec import ModelSpec
    from h2o.assets.paths import CONF
    from h2o.core.validate import ConfigError, check

    allowed = {"model": None, "windows": 8, "window": 512}
    args = dict(allowed)
    for item in argv:
        key, eq, value = item.partition("=")
        check(bool(eq) and key in allowed, f"{item!r}: allowed: {', '.join(f'{k}=...' for k in allowed)}")
        args[key] = value
    names = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    check(args["model"] in names, f"model={args['model']!r}: allowed: {', '.join(names)}")
    for key in ("windows", "window"):
        check(str(args[key]).isdigit() and int(args[key]) >= 1, f"{key}={args[key]!r}: allowed: an int >= 1")
    node = {k: v for k, v in group_defaults("model", args["model"]).items() if k != "_target_"}
    spec = ModelSpec(**node)
    check(spec.geometry()[1] is not False, f"model={spec.name}: no rotary embedding in its config (its queries carry "
                                           f"no rotation to undo); allowed: a model with RoPE")
    t0 = time.time()
    model, tokenizer = spec.load()
    folder = checkpoint_folder(spec.pretrained)
    if folder is None:
        raise ConfigError(f"model={spec.name}: its checkpoint folder is not on this machine")
    digest = weights_digest(folder)
    windows = calibration_windows(tokenizer, int(args["window"]), int(args["windows"]))
    cal = calibrate(model, windows, digest, {"model": spec.name, "text": "austen", "window": int(args["window"]),
                                             "windows": int(args["windows"])})
    path = save(cal, stats_file(digest))
    print(f"[calibrate] {spec.name}: {cal['tokens']} tokens, {cal['layers']} layers -> {path} "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
