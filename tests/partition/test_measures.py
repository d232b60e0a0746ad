import itertools

import numpy as np
import pytest

from tgdist.errors import ConfigError
from tgdist.partition import access as acc
from tgdist.partition import kernels, measures, reference

from partition_helpers import planted_weights, tiny_graph

# three trainers, three vertices: w(t, v) by rows v
W3 = np.array([[4, 2, 0],
               [0, 3, 3],
               [1, 1, 1]])


def test_comm_matrix_by_hand():
    comm, local = measures.comm_matrix(W3, np.array([0, 1, 2]), 3)
    # C[i, j] = accesses of trainer i to vertices owned by j != i
    assert comm.tolist() == [[0, 0, 1], [2, 0, 1], [0, 3, 0]]
    assert local.tolist() == [4, 3, 1]


def test_balance_cost_by_hand():
    # loads = row sums [1, 3, 3] + column sums [2, 3, 2]
    assert measures.balance_cost(W3, np.array([0, 1, 2]), 3) == 6
    m = measures.measure(W3, np.array([0, 1, 2]), 3)
    assert m.load.tolist() == [3, 6, 5] and m.send.tolist() == [2, 3, 2] and m.recv.tolist() == [1, 3, 3]
    assert (m.balance_cost, m.max_link, m.total_volume) == (6, 3, 7)
    assert m.local_fraction == pytest.approx(8 / 15)
    # two trainers: the local assignment costs 2, the crossed one 6
    w2 = np.array([[5, 0], [0, 5], [3, 1], [1, 3]])
    assert measures.balance_cost(w2, np.array([0, 1, 0, 1]), 2) == 2
    assert measures.balance_cost(w2, np.array([0, 1, 1, 0]), 2) == 6


def test_residual_by_hand():
    comm, _ = measures.comm_matrix(W3, np.array([0, 1, 2]), 3)
    assert measures.residual(comm).tolist() == [[0, 3, 2], [1, 0, 2], [3, 0, 0]]


def test_load_identity_used_by_the_methods():
    # load_j = A_j + sum_{v on j} (s_v - 2 w(t_j, v)): the additive form Re-FlexBiCut updates
    rng = np.random.default_rng(0)
    for seed in range(5):
        w = planted_weights(50, 4, seed)
        owner = rng.integers(0, 4, 50)
        total = w.sum(axis=1)
        expect = [w[:, j].sum() + (total - 2 * w[:, j])[owner == j].sum() for j in range(4)]
        assert measures.measure(w, owner, 4).load.tolist() == expect


def test_owner_matrix_matches_reference():
    w = planted_weights(40, 5, 1)
    owner = np.random.default_rng(1).integers(0, 5, 40)
    assert np.array_equal(kernels.owner_matrix(w, owner, 5), reference.owner_matrix(w, owner, 5))


def test_lower_bound_is_below_the_optimum():
    for seed in range(6):
        w = planted_weights(7, 3, seed, hot_frac=0.3)
        cap = 3
        best = min(measures.balance_cost(w, np.array(o), 3) for o in itertools.product(range(3), repeat=7)
                   if np.bincount(o, minlength=3).max() <= cap)
        assert measures.lower_bound(w, 3, cap) <= best


def test_lower_bound_by_hand():
    # (a) 2 * sum(s - max) / M = 2 * (2 + 3 + 2) / 3 = 14 / 3 -> 5
    # (b) trainer 1 needs A_1 = 6 and no vertex has c_1(v) = s_v - 2 w(t_1, v) < 0: its load is >= 6
    assert measures.lower_bound(W3, 3) == 6
    # ... and 6 is what the identity assignment achieves (test_balance_cost_by_hand)
    # two trainers that need the same vertices: (a) = 2 * (4 + 0 + 1) / 2 = 5 = A_j (b)
    assert measures.lower_bound(np.array([[4, 4], [0, 0], [1, 1]]), 2) == 5


def test_bad_assignment_is_a_config_error():
    with pytest.raises(ConfigError, match="shape"):
        measures.comm_matrix(W3, np.array([0, 1]), 3)
    with pytest.raises(ConfigError, match="values"):
        measures.comm_matrix(W3, np.array([0, 1, 3]), 3)


def test_per_batch_costs_match_reference_and_sum_to_the_epoch():
    rng = np.random.default_rng(2)
    n_ev, n = 300, 30
    g = tiny_graph(rng.integers(0, n, n_ev), rng.integers(0, n, n_ev), np.arange(n_ev), num_nodes=n)
    a = acc.build_access_graph(g, num_parts=3, batch_size=40, fanouts=(), num_neg=0)
    owner = rng.integers(0, 3, n)
    cost, link, volume = measures.batch_costs(a, owner)
    trainer, group = acc.batch_trainers(n_ev, 40, 3)
    groups = [[[] for _ in range(3)] for _ in range(a.num_batches)]
    for e in range(n_ev):
        groups[group[e] // 3][trainer[e]] += [g.src[e], g.dst[e]]
    ref = reference.batch_costs(groups, owner, 3, a.num_batches)
    assert np.array_equal(cost, ref[0]) and np.array_equal(link, ref[1]) and np.array_equal(volume, ref[2])
    # dedup weights count unique accesses per batch, so the per-batch volumes add up to the epoch's
    assert volume.sum() == measures.measure(a.dedup, owner, 3).total_volume


def test_evaluate_has_both_weights_and_per_batch():
    g = tiny_graph([0, 0, 3, 0], [1, 2, 1, 1], [1, 2, 3, 4])
    a = acc.build_access_graph(g, num_parts=2, batch_size=4, fanouts=(), num_neg=0)
    e = measures.evaluate(a, np.array([0, 1, 0, 1]))
    assert e["sizes"] == [2, 2]
    # raw: trainer 0 needs 0 (x2), 1, 2 -> fetches 1 from 1; trainer 1 needs 3, 1 (x2), 0 -> fetches 0 from 0
    assert e["raw"]["comm"] == [[0, 1], [1, 0]] and e["dedup"]["comm"] == [[0, 1], [1, 0]]
    assert e["per_batch"]["num_batches"] == 1 and e["per_batch"]["balance_cost"]["max"] == 2
