import numpy as np
import pytest

from tgdist.errors import ConfigError
from tgdist.partition import access as acc
from tgdist.partition import kernels, reference

from partition_helpers import tiny_graph


def test_batch_trainers_split_each_batch_chronologically():
    trainer, group = acc.batch_trainers(num_events=11, batch_size=5, num_parts=2)
    # batches [0,5) [5,10) [10,11): chunks floor(t n / M): sizes 2+3, 2+3, then 0+1
    assert trainer.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert group.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 5]


def test_batch_trainers_sizes_differ_by_at_most_one():
    trainer, _ = acc.batch_trainers(num_events=1200, batch_size=1200, num_parts=7)
    sizes = np.bincount(trainer)
    assert sizes.sum() == 1200 and sizes.max() - sizes.min() <= 1
    assert np.all(np.diff(trainer) >= 0)


def test_roots_only_counts_exactly():
    # events (src, dst): 0:(0,1) 1:(0,2) 2:(3,1) 3:(0,1); batch 4 split over 2 trainers -> events 0,1 | 2,3
    g = tiny_graph([0, 0, 3, 0], [1, 2, 1, 1], [1, 2, 3, 4])
    a = acc.build_access_graph(g, num_parts=2, batch_size=4, fanouts=(), num_neg=0)
    assert a.raw.tolist() == [[2, 1], [1, 2], [1, 0], [0, 1]]
    assert a.dedup.tolist() == [[1, 1], [1, 1], [1, 0], [0, 1]]
    assert a.num_batches == 1 and a.batches_per_part.tolist() == [1, 1]
    assert a.batch_ptr.tolist() == [0, 3, 6]
    assert a.batch_ids.tolist() == [0, 1, 2, 3, 1, 0]


def test_recent_neighbours_are_accessed_too():
    # K=1 recent neighbour of each root strictly before the event time
    g = tiny_graph([0, 1, 0], [1, 2, 2], [1, 2, 3])
    a = acc.build_access_graph(g, num_parts=1, batch_size=3, fanouts=(1,), num_neg=0)
    # event 0 (t=1): roots 0, 1, no history.  event 1 (t=2): roots 1 -> nbr 0 (event 0), 2 -> none.
    # event 2 (t=3): roots 0 -> nbr 1 (event 0), 2 -> nbr 1 (event 1).
    assert a.raw[:, 0].tolist() == [3, 4, 2]
    assert a.dedup[:, 0].tolist() == [1, 1, 1]


def test_negatives_are_roots_and_seeded():
    # bipartite with one source: negatives are drawn from the destinations 1..59 only
    g = tiny_graph(np.zeros(40, dtype=np.int64), np.arange(1, 41), np.arange(40), num_nodes=60, bipartite=True,
                   num_src_nodes=1)
    a = acc.build_access_graph(g, num_parts=2, batch_size=10, fanouts=(), num_neg=2, seed=3)
    b = acc.build_access_graph(g, num_parts=2, batch_size=10, fanouts=(), num_neg=2, seed=3)
    c = acc.build_access_graph(g, num_parts=2, batch_size=10, fanouts=(), num_neg=2, seed=4)
    assert a.raw.sum() == 40 * 4 and a.raw[1:].sum() == 40 * 3
    assert np.array_equal(a.raw, b.raw) and np.array_equal(a.dedup, b.dedup)
    assert not np.array_equal(a.raw, c.raw)
    # node 0 is a root of every event: trainer 0 and 1 each see it once per batch
    assert a.dedup[0].tolist() == [4, 4] and a.raw[0].tolist() == [20, 20]


def test_kernel_matches_reference_on_random_rows():
    rng = np.random.default_rng(0)
    rows = rng.integers(-1, 30, size=(50, 7))
    trainer, group = acc.batch_trainers(50, 12, 3)
    raw = np.zeros((30, 3), dtype=np.int64)
    dedup = np.zeros((30, 3), dtype=np.int64)
    ids = np.empty(rows.size, dtype=np.int64)
    grp = np.empty(rows.size, dtype=np.int64)
    count = kernels.access_counts(rows, group, trainer, raw, dedup, np.full(30, -1, dtype=np.int64), ids, grp)
    ref_raw, ref_dedup, records = reference.access_counts(rows, group, trainer, 30, 3)
    assert np.array_equal(raw, ref_raw) and np.array_equal(dedup, ref_dedup)
    assert list(zip(ids[:count].tolist(), grp[:count].tolist())) == records


def test_chunking_does_not_change_the_counts():
    rng = np.random.default_rng(1)
    n_ev = 500
    g = tiny_graph(rng.integers(0, 40, n_ev), rng.integers(0, 40, n_ev), np.sort(rng.integers(0, 300, n_ev)), num_nodes=40)
    kw = dict(num_parts=4, batch_size=32, fanouts=(3, 2), num_neg=1, seed=5, num_threads=1)
    big = acc.build_access_graph(g, **kw)
    small = acc.build_access_graph(g, chunk_ids=1, **kw)  # one batch per chunk
    assert np.array_equal(big.raw, small.raw) and np.array_equal(big.dedup, small.dedup)
    assert np.array_equal(big.batch_ptr, small.batch_ptr) and np.array_equal(big.batch_ids, small.batch_ids)
    assert big.dedup.sum() == big.batch_ids.size
    # the per-batch records are a CSR whose groups hold unique ids matching the dedup weights
    for grp in range(big.num_batches * 4):
        chunk = big.batch_ids[big.batch_ptr[grp]:big.batch_ptr[grp + 1]]
        assert np.unique(chunk).size == chunk.size
    counts = np.zeros_like(big.dedup)
    for grp in range(big.num_batches * 4):
        np.add.at(counts[:, grp % 4], big.batch_ids[big.batch_ptr[grp]:big.batch_ptr[grp + 1]], 1)
    assert np.array_equal(counts, big.dedup)


def test_train_end_limits_the_epoch():
    g = tiny_graph([0, 1, 2, 3], [1, 2, 3, 0], [1, 2, 3, 4])
    a = acc.build_access_graph(g, num_parts=1, batch_size=2, train_end=2, fanouts=(), num_neg=0)
    assert a.raw[:, 0].tolist() == [1, 2, 1, 0] and a.num_events == 2


@pytest.mark.parametrize("kw, match", [({"num_parts": 0}, "num_parts"), ({"batch_size": 1, "num_parts": 2}, "batch_size"),
                                       ({"num_neg": -1}, "num_neg"), ({"train_end": 0}, "no training events")])
def test_bad_arguments(kw, match):
    g = tiny_graph([0, 1], [1, 2], [1, 2])
    args = {"num_parts": 1, "batch_size": 2, **kw}
    with pytest.raises(ConfigError, match=match):
        acc.build_access_graph(g, **args)


def test_from_weights_validates():
    with pytest.raises(ConfigError):
        acc.from_weights(np.array([[1, -1]]))
    with pytest.raises(ConfigError):
        acc.from_weights(np.array([1, 2]))
    a = acc.from_weights(np.array([[1, 2], [3, 4]]))
    assert a.num_parts == 2 and a.num_nodes == 2 and a.weights("raw") is a.weights("dedup")
    with pytest.raises(ConfigError, match="weights"):
        a.weights("bogus")
