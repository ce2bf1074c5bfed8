"""Quantized KV cache, composable with every policy: ``make_quant("uniform", bits=4)`` (None for ``none``).

Schemes: ``none`` (the cache as it is), ``uniform`` (FlexGen's group-wise min-max, :mod:`.uniform`),
``kvquant`` (KVQuant's methods, :mod:`.kvquant`). ``attach(model, policy, quant=q)`` makes both paths use it:
the evicting cache stores packed rows, the simulated mask attends to the same values decoded (:mod:`.base`).
"""
from .base import BITS, Quantizer, QuantError
from .kvquant import KVQuant
from .uniform import Uniform

SCHEMES = {"none": None, "uniform": Uniform, "kvquant": KVQuant}


def make_quant(name: str = "none", **options) -> Quantizer | None:
    """Build a quantizer by name; a bad name or option fails at once with one line."""
    if name not in SCHEMES:
        raise QuantError(f"quant={name!r}: unknown; allowed: {', '.join(SCHEMES)}")
    if SCHEMES[name] is None:
        if options:
            raise QuantError(f"quant=none: takes no options (got {', '.join(options)})")
        return None
    try:
        return SCHEMES[name](**options)
    except TypeError as e:  # an option the scheme does not take
        raise QuantError(f"quant={name}: {e}") from None


def quant_of(label: str, calibration: str | None = None) -> Quantizer | None:
    """A scheme and its bits in one word, as ``python -m h2o.bench --quant`` takes them: ``uniform4`` ->
    Uniform(4, 64); ``kvquant3`` -> KVQuant(3, calibration); ``none`` -> None."""
    if label == "none":
        return None
    name = label.rstrip("0123456789")
    return make_quant(name, bits=int(label[len(name):]), **({"calibration": calibration} if name == "kvquant" else {}))


__all__ = ["BITS", "SCHEMES", "KVQuant", "Quantizer", "QuantError", "Uniform", "make_quant", "quant_of"]
