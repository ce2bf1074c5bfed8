"""Matplotlib without a display (the Agg backend), a grid of panels, and a figure saved as PNG and PDF."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# Fixed metadata: no matplotlib version, no creation date, so the same figure gives the same bytes on the same build
METADATA = {".png": {"Software": None}, ".pdf": {"Creator": None, "Producer": None, "CreationDate": None}}


def save(fig, out: str | Path, name: str) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150, metadata=METADATA[p.suffix])
    plt.close(fig)
    return paths


def png(fig, path: str | Path, dpi: int = 150) -> Path:
    """The figure as one PNG at ``path`` (its folder made), with :data:`METADATA`; the figure closed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata=METADATA[".png"])
    plt.close(fig)
    return path


def panels(n: int, ncols: int = 3, size=(4.2, 3.2), nrows=None):
    nrows = nrows or -(-n // ncols)
    ncols = min(n, ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                             squeeze=False, layout="constrained")
    for ax in axes.ravel()[n:]:
        ax.set_visible(False)
    return fig, axes.ravel()
