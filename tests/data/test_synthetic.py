"""The seeded synthetic generator: exact against its reference, valid, deterministic, learnable."""

from __future__ import annotations

import numpy as np
import pytest

from tgdist.data import synthetic
from tgdist.data.load import load_graph
from tgdist.data.readers.native import save_native
from tgdist.data.synthetic import generate
from tgdist.errors import ConfigError
from tgdist.kernels import reference


@pytest.mark.parametrize("bipartite", [False, True])
def test_kernel_matches_reference(bipartite):
    kw = dict(num_nodes=150, num_communities=6, bipartite=bipartite, seed=3)
    g = generate(2500, p_repeat=0.4, p_in_community=0.7, **kw)
    lay = synthetic.layout(**kw)
    src, dst = reference.synth_events(2500, reference.splitmix64(3), lay.src_cum, lay.dst_nodes, lay.dst_cum,
                                      lay.comm_ptr, lay.comm, 0.7, 0.4, bipartite, synthetic.RING)
    np.testing.assert_array_equal(g.src, src)
    np.testing.assert_array_equal(g.dst, dst)


def test_graph_is_valid():
    g = generate(5000, 300, seed=1)
    assert g.num_events == 5000 and g.num_nodes == 300 and g.name == "synthetic" and not g.bipartite
    for a in (g.src, g.dst, g.t):
        assert a.dtype == np.int64
    assert (np.diff(g.t) >= 0).all() and g.t[0] >= 0
    assert (np.diff(g.t) == 0).any()  # Poisson arrivals floored to seconds: ties occur
    assert 0 <= min(g.src.min(), g.dst.min()) and max(g.src.max(), g.dst.max()) < 300
    assert not (g.src == g.dst).any()
    assert g.node_map.tolist() == list(range(300))
    assert g.edge_feat is None and g.node_feat is None and g.label is None


def test_bipartite_sides():
    g = generate(4000, 100, bipartite=True, seed=2)
    assert g.bipartite and g.num_src_nodes == synthetic.default_num_src_nodes(100) == 90
    assert g.src.max() < 90 <= g.dst.min() and g.dst.max() < 100
    g = generate(4000, 100, bipartite=True, num_src_nodes=30, seed=2)
    assert g.num_src_nodes == 30 and g.src.max() < 30 <= g.dst.min()


def test_deterministic_per_seed_and_independent_of_chunking(monkeypatch):
    kw = dict(num_events=3000, num_nodes=200, edge_dim=3, node_dim=2, seed=9)
    a = generate(**kw)
    monkeypatch.setattr(synthetic, "CHUNK", 1000)
    b = generate(**kw)
    for k in ("src", "dst", "t", "edge_feat", "node_feat"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert a.source_hash == b.source_hash
    c = generate(**{**kw, "seed": 10})
    assert not np.array_equal(a.dst, c.dst) and a.source_hash != c.source_hash
    assert generate(**{**kw, "p_repeat": 0.3}).source_hash != a.source_hash


def test_features():
    g = generate(6000, 400, num_communities=4, edge_dim=5, node_dim=3, seed=4)
    assert g.edge_feat.shape == (6000, 5) and g.edge_feat.dtype == np.float32
    assert g.node_feat.shape == (400, 3) and g.node_feat.dtype == np.float32
    comm = synthetic.layout(400, num_communities=4, seed=4).comm
    # edge features cluster by the destination's community: the nearest class mean recovers it
    means = np.stack([g.edge_feat[comm[g.dst] == c].mean(axis=0) for c in range(4)])
    nearest = ((g.edge_feat[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == comm[g.dst]).mean() > 0.9


def test_structure_parameters_have_their_effect():
    comm = synthetic.layout(2000, seed=5).comm
    g = generate(40_000, 2000, seed=5)
    assert (comm[g.src] == comm[g.dst]).mean() > 0.75  # p_in_community 0.8, repeats keep it
    flat = generate(40_000, 2000, seed=5, p_in_community=0.0, p_repeat=0.0)
    assert (comm[flat.src] == comm[flat.dst]).mean() < 0.1  # about 1/20
    # power-law activity: the busiest node has far more events than the average one
    deg = np.bincount(np.concatenate([g.src, g.dst]), minlength=2000)
    assert deg.max() > 20 * deg.mean()


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """Probability that a positive scores above a negative (ties count half)."""
    scores = np.concatenate([pos, neg])
    order = scores.argsort(kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for v in np.unique(scores):  # average ranks of ties
        m = scores == v
        ranks[m] = ranks[m].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def heuristic_auc(g, comm, seed=0) -> float:
    """Score = 2 * (the pair met before) + (same community), on the last 30% of events, against
    uniform random destinations: what a memory-based model can pick up at least."""
    cut = int(0.7 * g.num_events)
    seen = set(zip(g.src[:cut].tolist(), g.dst[:cut].tolist()))
    seen |= {(v, u) for u, v in seen}
    neg = np.random.default_rng(seed).integers(0, g.num_nodes, g.num_events - cut)
    src, dst = g.src[cut:], g.dst[cut:]

    def score(u, v):
        return np.array([2 * ((a, b) in seen) for a, b in zip(u.tolist(), v.tolist())]) + (comm[u] == comm[v])
    return auc(score(src, dst), score(src, neg))


def test_links_are_learnable():
    comm = synthetic.layout(1000, seed=6).comm
    learnable = heuristic_auc(generate(30_000, 1000, seed=6), comm)
    noise = heuristic_auc(generate(30_000, 1000, seed=6, p_repeat=0.0, p_in_community=0.0), comm)
    assert learnable > 0.85 and noise < 0.7 and learnable - noise > 0.2


def test_progress_reports(monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK", 400)
    calls = []
    generate(1000, 50, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(400, 1000), (800, 1000), (1000, 1000)]


def test_native_round_trip(tmp_path):
    g = generate(2000, 100, edge_dim=2, bipartite=True, seed=1)
    h = load_graph(save_native(g, tmp_path / "s.npz"))
    for k in ("src", "dst", "t", "edge_feat", "node_map"):
        np.testing.assert_array_equal(getattr(h, k), getattr(g, k))
    assert (h.bipartite, h.num_src_nodes, h.source_hash) == (True, g.num_src_nodes, g.source_hash)


def test_config_path():
    from tgdist.config import DataConfig, SyntheticConfig
    from tgdist.data.load import load_data
    cfg = DataConfig(format="synthetic", synthetic=SyntheticConfig(num_events=500, num_nodes=50, seed=2))
    g = load_data(cfg)
    np.testing.assert_array_equal(g.dst, generate(500, 50, seed=2).dst)


@pytest.mark.parametrize("kw, msg", [
    (dict(num_events=0), "num_events must be >= 1"),
    (dict(num_nodes=1), "num_nodes must be >= 2"),
    (dict(num_communities=0), r"num_communities must be in \[1, max\(num_nodes, 20\)\] = \[1, 20\], got 0"),
    ({"num_communities": 10**9}, r"num_communities must be in \[1, max\(num_nodes, 20\)\] = \[1, 20\], got 1,000,000,000"),
    (dict(p_repeat=1.5), "p_repeat must be in"),
    (dict(p_in_community=-0.1), "p_in_community must be in"),
    (dict(activity_exponent=0), "activity_exponent must be a finite number > 0"),
    ({"activity_exponent": float("inf")}, "activity_exponent must be a finite number > 0, got inf"),
    (dict(edge_dim=-1), "edge_dim and node_dim must be >= 0"),
    (dict(bipartite=True, num_src_nodes=10), "num_src_nodes must be in"),
    (dict(num_src_nodes=3), "only meaningful with bipartite"),
])
def test_bad_parameters(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        generate(**{"num_events": 100, "num_nodes": 10, **kw})
