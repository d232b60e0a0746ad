"""Residual-matrix heatmaps (Sven Fig. 7). matplotlib is imported lazily: it is the optional `plot` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

# what R measures, for the figure: the residual is how even the links are, not which method is best
RESIDUAL_MEANING = "residual R[i, j] = C_max - C[i, j]: how much less link i \u2192 j carries than the busiest link"


def residual_heatmaps(residuals: Mapping[str, np.ndarray], path: str | Path, title: str = "",
                      costs: Mapping[str, int] | None = None, unit: str = "node memories per epoch") -> Path:
    """One heatmap per method of ``R = C_max - C`` (``[M, M]``, eq. (2)), side by side, as PNG.

    The panels share one colour scale, from 0 to the largest R of any of them, with one colour bar
    labelled in ``unit`` (C's unit: node memories fetched over the pre-sampled epoch), so equal
    colours are equal amounts; the diagonal (no link) is grey. ``costs`` (method -> balance cost)
    goes in each panel's title with the lowest marked best: tgdist partition ranks methods by the
    balance cost (the busiest trainer's send + receive, which the all-to-all waits for), and a low
    residual means only even links (a method that cuts the busiest link can leave others emptier,
    so a higher max R), so the titles must not let max R read as the ranking. Raises ImportError
    when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = list(residuals)
    shown = {name: np.asarray(residuals[name], dtype=float) for name in names}
    off = {name: r[~np.eye(r.shape[0], dtype=bool)] for name, r in shown.items()}
    top = max((float(o.max()) for o in off.values() if o.size), default=0.0)
    norm = matplotlib.colors.Normalize(vmin=0.0, vmax=max(top, 1.0))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    best = min(costs[n] for n in names) if costs and all(n in costs for n in names) else None
    fig, axes = plt.subplots(1, len(names), figsize=(3.9 * len(names) + 1.2, 4.4), squeeze=False,
                             layout="constrained")
    im = None
    for ax, name in zip(axes[0], names):
        r = shown[name]
        m = r.shape[0]
        im = ax.imshow(np.ma.masked_array(r, mask=np.eye(m, dtype=bool)), cmap=cmap, norm=norm,
                       interpolation="nearest")
        max_r = f"max R {int(off[name].max()) if off[name].size else 0:,}"
        if costs and name in costs:
            mark = " (best)" if costs[name] == best else ""
            ax.set_title(f"{name}: balance cost {costs[name]:,}{mark}\n{max_r}", fontsize="medium")
        else:
            ax.set_title(f"{name}\n{max_r}", fontsize="medium")
        ax.set_xlabel("owner j (serves)")
        ax.set_ylabel("trainer i (fetches)")
        if m <= 16:
            ax.set_xticks(range(m))
            ax.set_yticks(range(m))
    fig.colorbar(im, ax=list(axes[0]), fraction=0.046 / len(names) * 1.5, pad=0.02,
                 label=f"residual R ({unit})")
    lines = [title] if title else []
    lines.append(RESIDUAL_MEANING)
    if best is not None:
        lines.append("R shows how even the links are; methods rank by balance cost (busiest trainer's send + receive)")
    fig.suptitle("\n".join(lines), fontsize="medium")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
