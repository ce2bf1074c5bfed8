"""Loading microsoft/G-KV's scoring from a checkout for :mod:`h2o.parity.g_kv`: its three files as modules of their
own names (not copied here), and without a GPU its Triton similarity kernel in Triton's interpreter (Triton 3.6:
3.9 removed the block pointers it uses; one NumPy 2.4 incompatibility of that interpreter patched, the kernel
untouched)."""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch

from h2o.parity.r_kv import load

FILES = ("gkv/utils/compression_score.py", "gkv/model/sparse_mask.py", "gkv/model/compression/score_based.py")


def load_reference(root: Path):
    """ScoreBasedKV from ``root``/gkv (a checkout of microsoft/G-KV), its three files loaded as modules of their own
    names (its packages' ``__init__`` files import its model patches, which the scoring does not need). Without
    CUDA its Triton kernel runs in Triton's interpreter."""
    missing = [str(root / f) for f in FILES if not (root / f).is_file()]
    if missing:
        raise SystemExit(f"--reference={root}: no {', '.join(missing)}; allowed: a checkout of microsoft/G-KV")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # its language's own helpers were made for a GPU at their import
            raise SystemExit("triton was imported before this command could set TRITON_INTERPRET=1 (no GPU here); "
                             "allowed: load the reference first, in a fresh process, or TRITON_INTERPRET=1 set")
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl

    if not block_pointers(tl):
        raise SystemExit(f"triton {triton.__version__}: its block pointers are gone, which the reference's "
                         "cal_similarity_triton uses; allowed: triton 3.6 (pip install --target DIR triton==3.6.0, "
                         "then PYTHONPATH=DIR)")
    interpret_index()
    for package in ("gkv", "gkv.utils", "gkv.model", "gkv.model.compression"):
        module = types.ModuleType(package)
        module.__path__ = [str(root / package.replace(".", "/"))]
        sys.modules[package] = module
    for f in FILES:
        load(f[:-3].replace("/", "."), root / f)
    return sys.modules["gkv.model.compression.score_based"].ScoreBasedKV


def block_pointers(tl) -> bool:
    """Whether this Triton still has ``tl.make_block_ptr`` (3.9 raises NotImplementedError in it)."""
    import inspect

    make = getattr(tl, "make_block_ptr", None)
    return make is not None and "NotImplementedError" not in inspect.getsource(make)


def interpret_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into an index with ``int`` of a one-element array, which NumPy
    2.4 refuses; read its one element instead (what the interpreter means; the kernel is untouched)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "one_element", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched.one_element = True
    interpreter._patch_lang_tensor = patched
