"""T-CSR, the multi-hop temporal sampler and negative sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tgdist.data.graph import TemporalGraph
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.kernels import reference


def make_graph(src, dst, t, num_nodes=None, **kw) -> TemporalGraph:
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    n = num_nodes or int(max(src.max(), dst.max())) + 1
    return TemporalGraph(src=src, dst=dst, t=np.asarray(t), num_nodes=n, node_map=np.arange(n, dtype=np.int64), **kw)


def small() -> TemporalGraph:
    # events: 0:(0,1)@1  1:(0,2)@2  2:(1,2)@2  3:(0,1)@3  4:(2,0)@5 ; node 3 has no events
    return make_graph([0, 0, 1, 0, 2], [1, 2, 2, 1, 0], [1, 2, 2, 3, 5], num_nodes=4)


def random_graph(seed, num_events=400, num_nodes=40):
    rng = np.random.default_rng(seed)
    return make_graph(rng.integers(0, num_nodes - 4, num_events), rng.integers(0, num_nodes - 4, num_events),
                      np.sort(rng.integers(0, 50, num_events)), num_nodes=num_nodes)


# ---------------------------------------------------------------------------------------------
# T-CSR


def test_tcsr_build():
    c = TCSR.build(small())
    assert c.num_nodes == 4
    assert c.indptr.tolist() == [0, 4, 7, 10, 10]
    assert c.nbr.tolist() == [1, 2, 1, 2, 0, 2, 0, 0, 1, 0]
    assert c.eid.tolist() == [0, 1, 3, 4, 0, 2, 3, 1, 2, 4]
    assert c.t.tolist() == [1, 2, 3, 5, 1, 2, 3, 2, 2, 5]
    assert c.indptr.dtype == np.int64 and c.nbytes() == (5 + 10 + 10 + 10) * 8
    one = TCSR.build(small(), both_directions=False)
    assert one.indptr.tolist() == [0, 3, 4, 5, 5] and one.nbr.tolist() == [1, 2, 1, 2, 0]


# ---------------------------------------------------------------------------------------------
# Recent


def test_recent_one_hop_exact():
    s = TemporalSampler(TCSR.build(small()), fanouts=[3], strategy="recent", num_threads=1)
    (hop,) = s.sample(np.array([0, 2, 3]), np.array([4, 2, 9]))
    assert hop.nbr.tolist() == [[1, 2, 1], [-1, -1, -1], [-1, -1, -1]]
    assert hop.eid.tolist() == [[3, 1, 0], [-1, -1, -1], [-1, -1, -1]]
    assert hop.t.tolist() == [[3, 2, 1], [0, 0, 0], [0, 0, 0]]
    assert hop.mask.tolist() == [[True, True, True], [False] * 3, [False] * 3]
    assert hop.dt.dtype == np.float32 and hop.dt.tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 0]]


def test_recent_two_hops_exact():
    s = TemporalSampler(TCSR.build(small()), fanouts=[2, 2], strategy="recent")
    h1, h2 = s.sample(np.array([0]), np.array([6]))
    assert h1.nbr.tolist() == [[2, 1]] and h1.t.tolist() == [[5, 3]]
    # hop 2: node 2 before t=5 -> events 2 (1,2)@2 and 1 (0,2)@2; node 1 before t=3 -> events 2 and 0
    assert h2.nbr.shape == (2, 2)
    assert h2.eid.tolist() == [[2, 1], [2, 0]]
    assert h2.nbr.tolist() == [[1, 0], [2, 0]]
    assert h2.dt.tolist() == [[3, 3], [1, 2]]


@pytest.mark.parametrize("seed", range(3))
def test_recent_multi_hop_matches_reference(seed):
    g = random_graph(seed)
    s = TemporalSampler(TCSR.build(g), fanouts=[4, 3], strategy="recent")
    rng = np.random.default_rng(seed)
    roots = rng.integers(0, g.num_nodes, 60)
    root_t = rng.choice(g.t, 60)
    h1, h2 = s.sample(roots, root_t)
    want1 = reference.sample_recent(g.src, g.dst, g.t, roots, root_t, 4)
    want2 = reference.sample_recent(g.src, g.dst, g.t, want1[0].reshape(-1), want1[2].reshape(-1), 3)
    for hop, want in ((h1, want1), (h2, want2)):
        for got, w in zip((hop.nbr, hop.eid, hop.t, hop.mask), want):
            np.testing.assert_array_equal(got, w)
    assert h2.nbr.shape == (60 * 4, 3)


def test_float_times_and_dtype_coercion():
    g = make_graph([0, 1], [1, 2], np.array([0.5, 1.5]))
    s = TemporalSampler(TCSR.build(g), fanouts=[2])
    (hop,) = s.sample([1, 1], [1, 2])  # lists and ints are converted
    assert hop.t.dtype == np.float64 and hop.t.tolist() == [[0.5, 0.0], [1.5, 0.5]]
    assert hop.dt.tolist() == [[0.5, 0.0], [0.5, 1.5]]


def test_to_torch_is_zero_copy_on_cpu():
    s = TemporalSampler(TCSR.build(small()), fanouts=[2])
    (hop,) = s.sample(np.array([0, 1]), np.array([9, 9]))
    tt = hop.to_torch()
    assert tt.nbr.dtype == torch.int64 and tt.mask.dtype == torch.bool and tt.dt.dtype == torch.float32
    assert tuple(tt.nbr.shape) == (2, 2)
    assert tt.nbr.data_ptr() == hop.nbr.ctypes.data
    assert tt.eid.tolist() == hop.eid.tolist()


# ---------------------------------------------------------------------------------------------
# Uniform


def test_uniform_draws_are_eligible_and_masked():
    g = random_graph(3)
    s = TemporalSampler(TCSR.build(g), fanouts=[6], strategy="uniform", seed=1)
    roots = np.arange(g.num_nodes)
    root_t = np.full(g.num_nodes, 25)
    (hop,) = s.sample(roots, root_t)
    for r, cand in enumerate(reference.candidate_sets(g.src, g.dst, g.t, roots, root_t)):
        assert set(hop.eid[r][hop.mask[r]].tolist()) <= cand
        assert hop.mask[r].all() == bool(cand) and hop.mask[r].any() == bool(cand)


def test_uniform_deterministic_across_thread_counts_and_seeded():
    g = random_graph(4, num_events=3000, num_nodes=200)
    rng = np.random.default_rng(0)
    roots, root_t = rng.integers(0, 200, 500), rng.choice(g.t, 500)
    c = TCSR.build(g)

    def run(seed, threads):
        # min_parallel_slots=0: every hop takes the parallel kernel, so thread counts really differ
        s = TemporalSampler(c, fanouts=[5, 5], strategy="uniform", seed=seed, num_threads=threads, min_parallel_slots=0)
        first = s.sample(roots, root_t)
        second = s.sample(roots, root_t)  # a second call draws differently, but reproducibly
        return [h.eid for h in first + second]

    old = kernels.set_threads(0)
    try:
        a, b, other = run(7, 1), run(7, 2), run(8, 2)
    finally:
        kernels.set_threads(old)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], other[0])
    assert not np.array_equal(a[0], a[2])


@pytest.mark.parametrize("strategy", ["recent", "uniform"])
def test_serial_and_parallel_hops_agree(strategy):
    g = random_graph(5, num_events=2000, num_nodes=100)
    rng = np.random.default_rng(1)
    roots, root_t = rng.integers(0, 100, 300), rng.choice(g.t, 300)
    c = TCSR.build(g)
    serial = TemporalSampler(c, fanouts=[4, 4], strategy=strategy, seed=3, num_threads=2, min_parallel_slots=10**9)
    parallel = TemporalSampler(c, fanouts=[4, 4], strategy=strategy, seed=3, num_threads=2, min_parallel_slots=0)
    for a, b in zip(serial.sample(roots, root_t), parallel.sample(roots, root_t)):
        for x, y in zip((a.nbr, a.eid, a.t, a.mask, a.dt), (b.nbr, b.eid, b.t, b.mask, b.dt)):
            np.testing.assert_array_equal(x, y)


def test_sampler_config_errors():
    c = TCSR.build(small())
    with pytest.raises(ConfigError, match="strategy must be 'recent' or 'uniform'"):
        TemporalSampler(c, fanouts=[2], strategy="latest")
    with pytest.raises(ConfigError, match="fanouts must be positive"):
        TemporalSampler(c, fanouts=[])
    with pytest.raises(ConfigError, match="fanouts must be positive"):
        TemporalSampler(c, fanouts=[10, 0])


# ---------------------------------------------------------------------------------------------
# Negative sampling


def test_negatives_uniform_over_all_nodes():
    g = make_graph([0, 1], [1, 2], [0, 1], num_nodes=10)
    a = NegativeSampler(g, seed=3).train(1000, 2)
    assert a.shape == (1000, 2) and a.dtype == np.int64
    assert a.min() == 0 and a.max() == 9 and np.bincount(a.ravel()).min() > 150
    np.testing.assert_array_equal(a, NegativeSampler(g, seed=3).train(1000, 2))
    assert not np.array_equal(a, NegativeSampler(g, seed=4).train(1000, 2))


def test_negatives_bipartite_come_from_the_destination_side():
    g = make_graph([0, 1], [3, 4], [0, 1], num_nodes=6, bipartite=True, num_src_nodes=3)
    neg = NegativeSampler(g, seed=0)
    tr = neg.train(500)
    assert tr.shape == (500, 1) and set(np.unique(tr).tolist()) == {3, 4, 5}
    fx = neg.fixed("test", 0, 200, 49)
    assert fx.shape == (200, 49) and set(np.unique(fx).tolist()) == {3, 4, 5}


def test_fixed_evaluation_negatives_are_a_pure_function():
    g = make_graph([0, 1], [1, 2], [0, 1], num_nodes=1000)
    neg = NegativeSampler(g, seed=5)
    whole = neg.fixed("val", 100, 300, 49)
    assert whole.shape == (200, 49) and whole.dtype == np.int64
    assert 0 <= whole.min() and whole.max() < 1000
    # chunking, call order, other draws and a fresh object change nothing
    neg.train(77)
    parts = np.concatenate([neg.fixed("val", 100, 150, 49), neg.fixed("val", 150, 300, 49)])
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(whole, NegativeSampler(g, seed=5).fixed("val", 100, 300, 49))
    # column j does not depend on the number of negatives: AP and ROC-AUC (column 0) are the same
    # whatever train.num_neg_eval is
    for n in (1, 2, 100):
        np.testing.assert_array_equal(neg.fixed("val", 100, 300, n)[:, :min(n, 49)], whole[:, :min(n, 49)])
    # parts, seeds and keys each have their own stream (seed 1 key 0 is not seed 0 key 3)
    assert not np.array_equal(whole, neg.fixed("test", 100, 300, 49))
    assert not np.array_equal(whole, NegativeSampler(g, seed=6).fixed("val", 100, 300, 49))
    assert not np.array_equal(NegativeSampler(g, seed=1).keyed(0, 0, 200, 2), NegativeSampler(g, seed=0).keyed(3, 0, 200, 2))
    # columns are not copies of each other shifted by events
    assert not np.array_equal(whole[1:, 0], whole[:-1, 1])
    # rows are not constant and values spread over the nodes
    assert (whole.std(axis=1) > 0).all() and np.unique(whole).size > 900
