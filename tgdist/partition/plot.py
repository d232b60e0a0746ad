"""Residual-matrix heatmaps (Sven Fig. 7). matplotlib is imported lazily: it is the optional `plot` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

# what R measures, for the figure: the residual is how even the links are, not which method is best
ANNOTATE_UP_TO = 8  # trainers: up to this M every cell's value is written on it
RESIDUAL_MEANING = "residual R[i, j] = C_max - C[i, j]: how much less link i \u2192 j carries than the busiest link"


def residual_heatmaps(residuals: Mapping[str, np.ndarray], path: str | Path, title: str = "",
                      costs: Mapping[str, int] | None = None, unit: str = "node memories per epoch") -> Path:
    """One heatmap per method of ``R = C_max - C`` (``[M, M]``, eq. (2)), side by side, as PNG.

    Each panel has its own colour scale, from 0 to its own largest R, with its own colour bar
    labelled in ``unit`` (C's unit: node memories fetched over the pre-sampled epoch): the methods'
    residuals differ by tens of times (range's max R 5,872 against interval's 292 on CollegeMsg), so
    one shared scale paints the even methods one flat colour and hides where their links differ.
    Because a colour then means a different amount in each panel, the figure says so, each title
    gives the panel's max R, and with M <= ``ANNOTATE_UP_TO`` every cell carries its value. The
    diagonal (no link) is grey. ``costs`` (method -> balance cost) goes in each panel's title with
    the lowest marked best: tgdist partition ranks methods by the balance cost (the busiest
    trainer's send + receive, which the all-to-all waits for), and a low residual means only even
    links (a method that cuts the busiest link can leave others emptier, so a higher max R), so the
    titles must not let max R read as the ranking. Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = list(residuals)
    shown = {name: np.asarray(residuals[name], dtype=float) for name in names}
    off = {name: r[~np.eye(r.shape[0], dtype=bool)] for name, r in shown.items()}
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    best = min(costs[n] for n in names) if costs and all(n in costs for n in names) else None
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names) + 0.4, 4.6), squeeze=False,
                             layout="constrained")
    for ax, name in zip(axes[0], names):
        r = shown[name]
        m = r.shape[0]
        top = panel_scale(r)
        norm = matplotlib.colors.Normalize(vmin=0.0, vmax=top)
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
        if m <= ANNOTATE_UP_TO:
            for i in range(m):
                for j in range(m):
                    if i != j:  # dark text on the light end of viridis, light text on the dark end
                        ax.text(j, i, f"{int(r[i, j]):,}", ha="center", va="center", fontsize="x-small",
                                color="black" if norm(r[i, j]) > 0.6 else "white")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label=f"R ({unit})")
    lines = [title] if title else []
    lines.append(RESIDUAL_MEANING)
    lines.append("each panel has its own colour scale (0 to its max R): compare panels by the numbers, not the colours")
    if best is not None:
        lines.append("R shows how even the links are; methods rank by balance cost (busiest trainer's send + receive)")
    fig.suptitle("\n".join(lines), fontsize="medium")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def panel_scale(residual: np.ndarray) -> float:
    """The top of a panel's colour scale: its largest off-diagonal R (1 for an all-zero panel, so
    the scale is not empty)."""
    r = np.asarray(residual, dtype=float)
    off = r[~np.eye(r.shape[0], dtype=bool)]
    return max(float(off.max()) if off.size else 0.0, 1.0)
