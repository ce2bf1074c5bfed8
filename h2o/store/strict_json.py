"""Records as strict JSON: JSON has no inf or nan, so a record never holds one (h2o.store.files writes every
run record through :func:`dumps`; the bench and streaming JSONL records too).

The rule: an inf or nan anywhere in a record is written as ``null``, and an object record gains ``nonfinite``:
{dotted path: "inf" | "-inf" | "nan"} naming each (analysis reads a metric named there as NaN, left out of every
mean); a record with none is written unchanged. ``allow_nan=False`` then refuses any that is left.
"""
from __future__ import annotations

import json
import math
from typing import Any

NONFINITE = "nonfinite"  # the field naming what a record held as inf or nan (written as null)


def finite(obj: Any, where: str = "", found: dict | None = None) -> Any:
    """``obj`` with every inf and nan float replaced by None (strict JSON has no such numbers); each one's dotted
    path and value as text go to ``found`` (e.g. ``{"metrics.ppl": "inf"}``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if found is not None:
            found[where or "."] = str(obj)
        return None
    if isinstance(obj, dict):
        return {k: finite(v, f"{where}.{k}" if where else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v, f"{where}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def strict(obj: Any) -> Any:
    """A record as written: strict JSON. The rule: an inf or nan anywhere is written as null, and an object record
    gains ``nonfinite``: {dotted path: "inf" | "-inf" | "nan"} naming each (analysis reads those metrics as NaN,
    left out of every mean); a record with none is written unchanged."""
    found: dict = {}
    out = finite(obj, "", found)
    if found and isinstance(out, dict):
        out[NONFINITE] = {**(out.get(NONFINITE) or {}), **found}
    return out


def dumps(obj: Any, **kw) -> str:
    """json.dumps of :func:`strict` (obj), refusing any non-finite number left (allow_nan=False)."""
    return json.dumps(strict(obj), allow_nan=False, default=str, **kw)
