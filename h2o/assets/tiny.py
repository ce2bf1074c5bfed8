"""Tiny random checkpoints with a byte-level tokenizer, so tests run the whole harness (lm-eval included).

``tiny_checkpoint("llama")`` saves :func:`h2o.assets.models.tiny_model` (2 layers, vocab 256) with
:func:`byte_tokenizer` into ``<cache>/models/tiny-<arch>-s<seed>`` once; ``load_model(path)`` and
``lm_eval --model h2o --model_args pretrained=<path>`` then load it like any checkpoint. The model config
name ``tiny:<arch>`` (conf/model/tiny-*.yaml) resolves to that folder.

The tokenizer maps each UTF-8 byte to the token of the same id (GPT-2's byte-to-unicode alphabet, no
merges): id 0 is the pad, 1 BOS, 2 EOS (bytes that never occur in text). Positions go up to 4096 so that
few-shot prompts fit (one token per byte).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.assets.paths import cache_dir, cache_lock

MAX_POSITIONS = 4096


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable unicode map, as a list indexed by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer():
    """A fast tokenizer: one token per UTF-8 byte, id == byte value; pad 0, BOS 1, EOS 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=alphabet[0], bos_token=alphabet[1],
                                   eos_token=alphabet[2], model_max_length=MAX_POSITIONS)


def tiny_checkpoint(arch: str, seed: int = 0) -> Path:
    """Folder of the saved tiny ``arch`` model (see :data:`h2o.assets.models.TINY_ARCHS`) with the byte tokenizer."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny:{arch}: unknown architecture; allowed: {', '.join(TINY_ARCHS)}")
    out = cache_dir() / "models" / f"tiny-{arch}-s{seed}"
    if (out / "config.json").exists():
        return out
    with cache_lock(f"tiny-{arch}"):
        if (out / "config.json").exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-tiny-{arch}-", dir=out.parent))
        try:
            from transformers.utils import logging as hf_logging

            shown = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # a check phase prints one line at most (no "Writing model shards")
            try:
                tiny_model(arch, seed, max_position_embeddings=MAX_POSITIONS).save_pretrained(tmp)
            finally:
                if shown:
                    hf_logging.enable_progress_bar()
            byte_tokenizer().save_pretrained(tmp)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
