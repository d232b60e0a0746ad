"""residual.png: each panel has its own colour scale and colour bar in node memories (one shared
scale painted the even methods flat), every cell of a small M carries its value, and the titles rank
the methods by balance cost (what tgdist partition prints), not by the residual. Checked on the
figure drawn."""

import numpy as np
import pytest

from tgdist.partition import artifact
from tgdist.partition.idmap import DualHashMap

pytest.importorskip("matplotlib")


@pytest.fixture
def drawn(monkeypatch):
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig

    def keep(fig, *args, **kw):
        figures.append(fig)
        return savefig(fig, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _eval(cost, residual):
    return {"dedup": {"balance_cost": cost, "residual": residual}, "raw": {"balance_cost": 10 * cost}}


def test_each_panel_has_its_own_scale_and_the_titles_rank_by_balance_cost(tmp_path, drawn):
    """Issue 43's case: interval's max R (292) is below Re-FlexBiCut's (516), whose balance cost is
    the lowest: the titles mark Re-FlexBiCut best. Issue 52: on range's scale (0 .. 5,872) the two
    close panels were one flat colour, so each panel runs from 0 to its own max R, with its own bar."""
    r = {"range": np.array([[0, 5872], [10, 0]]), "interval": np.array([[0, 292], [0, 0]]),
         "reflexbicut": np.array([[0, 516], [4, 0]])}
    measures = {"method": "reflexbicut", "weights": "dedup", "measures": _eval(31140, r["reflexbicut"].tolist()),
                "baselines": {"range": _eval(38361, r["range"].tolist()), "interval": _eval(33334, r["interval"].tolist())}}
    meta = {"data": {"name": "tiny", "source_hash": "abc", "num_nodes": 4}, "num_parts": 2, "method": "reflexbicut",
            "weights": "dedup"}
    out = artifact.save(tmp_path / "p", maps=DualHashMap.from_assignment(np.array([0, 1, 1, 0]), 2), metadata=meta,
                        measures=measures, arrays={}, residuals=r)
    assert (out / "residual.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig, = drawn
    panels = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images]
    assert len(panels) == 3 and len(bars) == 3  # one colour bar per panel
    assert [(im.norm.vmin, im.norm.vmax) for ax in panels for im in ax.images] == [(0.0, 5872.0), (0.0, 292.0),
                                                                                    (0.0, 516.0)]
    assert all("node memories" in b.get_ylabel() and "R (" in b.get_ylabel() for b in bars)
    assert [b.get_ylim() for b in bars] == [(0.0, 5872.0), (0.0, 292.0), (0.0, 516.0)]
    for ax, name in zip(panels, ["range", "interval", "reflexbicut"]):  # the off-diagonal values, row by row
        assert [t.get_text() for t in ax.texts] == [f"{int(r[name][i, j]):,}" for i in range(2) for j in range(2)
                                                    if i != j]
    titles = [ax.get_title() for ax in panels]
    assert titles == ["range: balance cost 38,361\nmax R 5,872", "interval: balance cost 33,334\nmax R 292",
                      "reflexbicut: balance cost 31,140 (best)\nmax R 516"]
    head = fig._suptitle.get_text()
    assert "tiny, M=2, dedup weights" in head and "C_max - C[i, j]" in head and "rank by balance cost" in head
    assert "each panel has its own colour scale" in head


def test_without_balance_costs_no_panel_is_called_best(tmp_path, drawn):
    from tgdist.partition.plot import residual_heatmaps

    residual_heatmaps({"range": np.array([[0, 2], [0, 0]]), "interval": np.zeros((2, 2))}, tmp_path / "r.png")
    fig, = drawn
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["range\nmax R 2", "interval\nmax R 0"]
    # an all-zero panel still has a scale (0 .. 1), not an empty one
    assert [(im.norm.vmin, im.norm.vmax) for ax in panels for im in ax.images] == [(0.0, 2.0), (0.0, 1.0)]
    assert "rank" not in fig._suptitle.get_text()


def test_cell_values_are_written_up_to_eight_trainers(tmp_path, drawn):
    from tgdist.partition.plot import ANNOTATE_UP_TO, residual_heatmaps

    small, large = np.arange(ANNOTATE_UP_TO ** 2).reshape(ANNOTATE_UP_TO, -1), np.ones((9, 9))
    residual_heatmaps({"a": small, "b": large}, tmp_path / "r.png")
    fig, = drawn
    a, b = [ax for ax in fig.axes if ax.images]
    assert len(a.texts) == ANNOTATE_UP_TO * (ANNOTATE_UP_TO - 1) and not b.texts
