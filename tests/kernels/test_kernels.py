"""Numba kernels against their NumPy references (tgdist.kernels.reference) on random graphs."""

from __future__ import annotations

import numpy as np
import pytest

from tgdist.kernels import graph as kernels
from tgdist.kernels import reference


def random_graph(seed: int, num_events: int = 300, num_nodes: int = 30, isolated: int = 5, time_values: int = 40,
                 float_times: bool = False):
    """Events among the first ``num_nodes - isolated`` nodes; few distinct times, so ties abound."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, num_nodes - isolated, num_events).astype(np.int64)
    dst = rng.integers(0, num_nodes - isolated, num_events).astype(np.int64)  # self-loops included
    t = np.sort(rng.integers(0, time_values, num_events))
    t = (t * 0.5 + 1e9).astype(np.float64) if float_times else t.astype(np.int64)
    return src, dst, t


def roots_for(seed: int, src, t, num_nodes: int):
    """Every node (isolated ones too) at the first timestamp, at event times, between them and after
    the end, plus padding roots (-1) as a previous hop produces them."""
    rng = np.random.default_rng(seed + 1)
    roots = np.concatenate([np.arange(num_nodes), np.arange(num_nodes), rng.integers(0, num_nodes, 200), [-1, -1]])
    times = np.concatenate([np.full(num_nodes, t[0]), np.full(num_nodes, t[-1] + 1), rng.choice(t, 200), [t[5], t[0]]])
    if t.dtype.kind == "f":
        times[2 * num_nodes: 2 * num_nodes + 50] += 0.25  # between two event times
    return roots.astype(np.int64), times.astype(t.dtype)


def build(src, dst, t, num_nodes, both=True):
    indptr, nbr, eid = kernels.tcsr_fill(src, dst, num_nodes, both)
    return indptr, nbr, eid, t[eid]


def outputs(n, k, dtype):
    return (np.empty((n, k), np.int64), np.empty((n, k), np.int64), np.empty((n, k), dtype), np.empty((n, k), bool))


def run_recent(csr, roots, root_t, k):
    """The parallel kernel, after checking that the serial twin gives the same arrays."""
    out = outputs(roots.shape[0], k, root_t.dtype)
    kernels.sample_recent(*csr, roots, root_t, k, *out)
    twin = outputs(roots.shape[0], k, root_t.dtype)
    kernels.sample_recent_serial(*csr, roots, root_t, k, *twin)
    for a, b in zip(out, twin):
        np.testing.assert_array_equal(a, b)
    return out


def run_uniform(csr, roots, root_t, k, seed):
    out = outputs(roots.shape[0], k, root_t.dtype)
    kernels.sample_uniform(*csr, roots, root_t, k, seed, *out)
    twin = outputs(roots.shape[0], k, root_t.dtype)
    kernels.sample_uniform_serial(*csr, roots, root_t, k, seed, *twin)
    for a, b in zip(out, twin):
        np.testing.assert_array_equal(a, b)
    return out


# ---------------------------------------------------------------------------------------------
# T-CSR


def test_tcsr_hand_built():
    src = np.array([0, 1, 0, 2, 2], np.int64)
    dst = np.array([1, 2, 2, 2, 0], np.int64)  # event 3 is a self-loop
    indptr, nbr, eid = kernels.tcsr_fill(src, dst, 4, True)
    assert indptr.tolist() == [0, 3, 5, 9, 9]  # node 3 has no events
    assert nbr.tolist() == [1, 2, 2, 0, 2, 1, 0, 2, 0]
    assert eid.tolist() == [0, 2, 4, 0, 1, 1, 2, 3, 4]  # the self-loop (event 3) is listed once
    indptr, nbr, eid = kernels.tcsr_fill(src, dst, 4, False)
    assert indptr.tolist() == [0, 2, 3, 5, 5] and nbr.tolist() == [1, 2, 2, 2, 0] and eid.tolist() == [0, 2, 1, 3, 4]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("both", [True, False])
def test_tcsr_matches_reference(seed, both):
    src, dst, t = random_graph(seed)
    got = kernels.tcsr_fill(src, dst, 30, both)
    want = reference.tcsr(src, dst, 30, both)
    for g, w in zip(got, want):
        assert g.dtype == np.int64
        np.testing.assert_array_equal(g, w)
    indptr, nbr, eid = got
    for u in range(30):  # every list is in time order
        assert (np.diff(t[eid[indptr[u]:indptr[u + 1]]]) >= 0).all()


# ---------------------------------------------------------------------------------------------
# Recent sampling


def test_sample_recent_hand_built():
    src = np.array([0, 0, 1, 0, 2], np.int64)
    dst = np.array([1, 2, 2, 1, 0], np.int64)
    t = np.array([1, 2, 2, 3, 5], np.int64)
    csr = build(src, dst, t, 4)
    roots = np.array([0, 0, 0, 2, 3, -1], np.int64)
    root_t = np.array([1, 3, 9, 2, 9, 9], np.int64)
    nbr, eid, tt, mask = run_recent(csr, roots, root_t, 2)
    # node 0 at t=1: nothing strictly before; at t=3: events 1 (t=2) and 0 (t=1), newest first;
    # at t=9: events 4 and 3. Node 2 at t=2: the tie at t=2 is excluded; node 3 and padding: empty.
    assert nbr.tolist() == [[-1, -1], [2, 1], [2, 1], [-1, -1], [-1, -1], [-1, -1]]
    assert eid.tolist() == [[-1, -1], [1, 0], [4, 3], [-1, -1], [-1, -1], [-1, -1]]
    assert tt.tolist() == [[0, 0], [2, 1], [5, 3], [0, 0], [0, 0], [0, 0]]
    assert mask.tolist() == [[False, False], [True, True], [True, True], [False, False], [False, False], [False, False]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 3, 10, 40])
@pytest.mark.parametrize("float_times", [False, True])
def test_sample_recent_matches_reference(seed, k, float_times):
    src, dst, t = random_graph(seed, float_times=float_times)
    csr = build(src, dst, t, 30)
    roots, root_t = roots_for(seed, src, t, 30)
    got = run_recent(csr, roots, root_t, k)
    want = reference.sample_recent(src, dst, t, roots, root_t, k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    nbr, eid, tt, mask = got
    assert not mask[roots < 0].any() and not mask[root_t == t[0]].any()  # padding and first-timestamp roots
    assert not mask[np.isin(roots, np.arange(25, 30))].any()  # nodes with no history


def test_sample_recent_one_direction_matches_reference():
    src, dst, t = random_graph(7)
    roots, root_t = roots_for(7, src, t, 30)
    got = run_recent(build(src, dst, t, 30, both=False), roots, root_t, 5)
    want = reference.sample_recent(src, dst, t, roots, root_t, 5, both_directions=False)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------------------------
# Uniform sampling


@pytest.mark.parametrize("seed", range(4))
def test_sample_uniform_draws_from_the_candidate_set(seed):
    src, dst, t = random_graph(seed)
    csr = build(src, dst, t, 30)
    roots, root_t = roots_for(seed, src, t, 30)
    nbr, eid, tt, mask = run_uniform(csr, roots, root_t, 8, seed=seed)
    cands = reference.candidate_sets(src, dst, t, roots, root_t)
    for r, cand in enumerate(cands):
        if not cand:
            assert not mask[r].any() and (nbr[r] == -1).all() and (eid[r] == -1).all() and (tt[r] == 0).all()
            continue
        assert mask[r].all()
        assert set(eid[r].tolist()) <= cand
        # the neighbour and time belong to the drawn event
        e = eid[r]
        other = np.where(src[e] == roots[r], dst[e], src[e])
        np.testing.assert_array_equal(nbr[r], other)
        np.testing.assert_array_equal(tt[r], t[e])
        assert (tt[r] < root_t[r]).all()


def test_sample_uniform_same_seed_same_draws_whatever_the_thread_count():
    src, dst, t = random_graph(11, num_events=2000, num_nodes=60, isolated=3)
    csr = build(src, dst, t, 60)
    roots, root_t = roots_for(11, src, t, 60)
    old = kernels.set_threads(0)
    try:
        kernels.set_threads(1)
        one = run_uniform(csr, roots, root_t, 10, seed=123)
        kernels.set_threads(2)
        two = run_uniform(csr, roots, root_t, 10, seed=123)
    finally:
        kernels.set_threads(old)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    other = run_uniform(csr, roots, root_t, 10, seed=124)
    assert not np.array_equal(one[1], other[1])


def test_sample_uniform_is_roughly_uniform():
    # one root with 10 candidates (and one later event it must never see), many draws, fixed seed:
    # the chi-square statistic is a fixed number, so this cannot flake.
    src = np.zeros(11, np.int64)
    dst = np.arange(1, 12, dtype=np.int64)
    t = np.arange(11, dtype=np.int64)
    csr = build(src, dst, t, 12)
    k = 20_000
    _, eid, _, mask = run_uniform(csr, np.array([0], np.int64), np.array([10], np.int64), k, seed=5)
    assert mask.all() and eid.max() == 9
    counts = np.bincount(eid[0], minlength=10)
    chi2 = float(((counts - k / 10) ** 2 / (k / 10)).sum())
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001
    # and across roots: the draws of different roots are not copies of each other
    _, eid2, _, _ = run_uniform(csr, np.zeros(50, np.int64), np.full(50, 10, np.int64), 4, seed=5)
    assert len({tuple(row) for row in eid2.tolist()}) > 40


# ---------------------------------------------------------------------------------------------
# Sven Algorithm 2


def test_organize_hand_built():
    ids = np.array([5, 3, 5, 7, 3, 5], np.int64)
    unique, psi, phi = kernels.organize(ids)
    assert unique.tolist() == [5, 3, 7]
    assert psi.tolist() == [0, 1, 0, 2, 1, 0]
    assert phi.tolist() == [5, 4, 3]


@pytest.mark.parametrize("seed", range(5))
def test_organize_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 500))
    ids = rng.integers(-3, 60, n).astype(np.int64)  # negative ids (padding) are ordinary values
    ids[rng.random(n) < 0.05] = np.iinfo(np.int64).max
    got = kernels.organize(ids)
    want = reference.organize(ids)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    unique, psi, phi = got
    np.testing.assert_array_equal(unique[psi], ids)  # Psi restores the full vector
    np.testing.assert_array_equal(ids[phi], unique)  # Phi points at an occurrence of each id ...
    for u, p in enumerate(phi):  # ... and it is the last one
        assert not (ids[p + 1:] == unique[u]).any()


def test_organize_empty_and_large():
    unique, psi, phi = kernels.organize(np.empty(0, np.int64))
    assert unique.size == psi.size == phi.size == 0
    ids = np.random.default_rng(0).integers(0, 50_000, 400_000).astype(np.int64)
    unique, psi, phi = kernels.organize(ids)
    assert unique.size == np.unique(ids).size
    np.testing.assert_array_equal(unique[psi], ids)


def test_set_threads():
    old = kernels.set_threads(0)
    try:
        assert kernels.set_threads(1) == 1
        assert kernels.set_threads(10_000) == old  # capped at numba's maximum
    finally:
        kernels.set_threads(old)


def test_more_numba_threads_than_numba_has_is_warned(caplog):
    import numba

    from tgdist.kernels.graph import set_threads

    limit = numba.config.NUMBA_NUM_THREADS
    before = numba.get_num_threads()
    try:
        with caplog.at_level("WARNING"):
            assert set_threads(limit + 1) == limit
        assert f"sampler.num_threads={limit + 1}: numba can run only {limit} in this process" in caplog.text
    finally:
        numba.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# MSPipe-S: similar nodes by common neighbours


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("recent, top", [(0, 3), (1, 3), (3, 1), (10, 10), (40, 5)])
@pytest.mark.parametrize("float_times", [False, True])
def test_common_neighbour_rows_matches_reference(seed, recent, top, float_times):
    src, dst, t = random_graph(seed, float_times=float_times)
    indptr, nbr, _, etime = build(src, dst, t, 30)
    rng = np.random.default_rng(seed + 7)
    ids = rng.permutation(30)[:18].astype(np.int64)  # a batch's distinct nodes, in no order
    rows = np.sort(rng.choice(18, 8, replace=False)).astype(np.int64)
    for before in (t[0], t[len(t) // 2], t[-1] + 1):
        got = kernels.common_neighbour_rows(indptr, nbr, etime, ids, rows, before, recent, top)
        want = reference.common_neighbour_rows(src, dst, t, ids, rows, before, recent, top)
        np.testing.assert_array_equal(got, want)
    assert (kernels.common_neighbour_rows(indptr, nbr, etime, ids, rows, t[-1] + 1, 10, 10) >= 0).any()
