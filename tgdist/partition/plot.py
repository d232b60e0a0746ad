"""Residual-matrix heatmaps (Sven Fig. 7). matplotlib is imported lazily: it is the optional `plot` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np


def residual_heatmaps(residuals: Mapping[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """One heatmap per method of ``R = C_max - C`` (``[M, M]``, eq. (2)), side by side, as PNG.

    Each panel has its own colour scale (R is relative to that method's busiest link); the
    diagonal (no link) is grey. Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = list(residuals)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        r = np.asarray(residuals[name], dtype=float)
        m = r.shape[0]
        shown = np.ma.masked_array(r, mask=np.eye(m, dtype=bool))
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
        im = ax.imshow(shown, cmap=cmap, interpolation="nearest")
        off = r[~np.eye(m, dtype=bool)]
        ax.set_title(f"{name} (max R {int(off.max()) if off.size else 0:,})")
        ax.set_xlabel("owner j (serves)")
        ax.set_ylabel("trainer i (fetches)")
        if m <= 16:
            ax.set_xticks(range(m))
            ax.set_yticks(range(m))
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
