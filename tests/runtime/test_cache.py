"""FreshGNN's historical embedding cache (tgdist/runtime/cache.py): the exact cases, the policy on a
hand-made sequence, and a trainer with the cache against one without."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tgdist.data.graph import chronological_split
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.data.synthetic import generate
from tgdist.errors import ConfigError
from tgdist.models.modules import build_model
from tgdist.runtime.build import compose, validate
from tgdist.runtime.cache import EmbeddingCache
from tgdist.runtime.trainer import Trainer, memory_for

# ----------------------------------------------------------------------------------------------
# The policy on a hand-made sequence

# six events; event e is (src[e], dst[e]); pair keys are 2 e + (node is the destination)
SRC = np.array([0, 1, 2, 3, 4, 5])
DIM = 2


def hop(pairs, k=None):
    """A sampled hop 1 of one root whose slots are ``pairs`` [(node, event)], padded to ``k``."""
    k = k or len(pairs)
    nbr = np.full((1, k), -1, np.int64)
    eid = np.full((1, k), -1, np.int64)
    for j, (v, e) in enumerate(pairs):
        nbr[0, j], eid[0, j] = v, e
    return SimpleNamespace(nbr=nbr, eid=eid, mask=eid >= 0)


def iterate(cache, pairs, lo, values, grad_norms, k=None):
    """One iteration: look ``pairs`` up, compute the missing ones as ``values[pair]`` (a float per
    pair, broadcast to DIM), and back-propagate so each slot's embedding gets the gradient norm
    ``grad_norms[pair]``. Returns the embeddings the slots got."""
    batch = cache.lookup([hop(pairs, k)], lo)
    rows = batch.compute_rows.numpy() if batch.compute_rows is not None else np.arange(batch.num_rows)
    flat = hop(pairs, k)
    computed = torch.tensor([[values.get((int(flat.nbr[0, r]), int(flat.eid[0, r])), 0.0)] * DIM for r in rows]
                            ).reshape(-1, DIM).requires_grad_(True)
    emb = batch.combine(computed * 1.0)
    w = torch.tensor([[grad_norms.get(p, 0.0) / np.sqrt(DIM)] * DIM for p in pairs]
                     + [[0.0] * DIM] * ((k or len(pairs)) - len(pairs)))
    (emb * w).sum().backward()
    cache.admit(batch)
    return emb.detach()


def cached(cache):
    """{(node, event): stored value} of every pair the id map holds."""
    out = {}
    for key in np.flatnonzero(cache.id_map >= 0):
        e, d = divmod(int(key), 2)
        node = SRC[e] if d == 0 else -1  # destination side: unused in these tests
        out[(int(node), e)] = float(cache.table[cache.id_map[key], 0])
    return out


@pytest.mark.parametrize("share", [True, False])
def test_admission_of_the_smallest_gradients_then_eviction_by_gradient_and_staleness(share):
    cache = EmbeddingCache(SRC, DIM, p_grad=0.5, t_stale=2, size=8, share=share)
    pairs = [(0, 0), (1, 1), (2, 2), (3, 3)]
    iterate(cache, pairs, lo=10, values={p: float(p[1] + 1) for p in pairs},
            grad_norms={(0, 0): 4.0, (1, 1): 1.0, (2, 2): 3.0, (3, 3): 2.0})
    assert cached(cache) == {(1, 1): 2.0, (3, 3): 4.0}  # the half with the smallest gradients
    # iteration 1: (1, 1) and (3, 3) are served as stored; ranked with the computed pairs, (3, 3)
    # now has a large gradient and is evicted, (4, 4) is admitted, (1, 1) stays
    emb = iterate(cache, [(1, 1), (3, 3), (4, 4), (5, 5)], lo=20, values={(4, 4): 5.0, (5, 5): 6.0},
                  grad_norms={(1, 1): 0.5, (3, 3): 9.0, (4, 4): 1.0, (5, 5): 8.0})
    assert emb[:, 0].tolist() == [2.0, 4.0, 5.0, 6.0]
    assert cached(cache) == {(1, 1): 2.0, (4, 4): 5.0}
    st = cache.take_stats()
    assert (st["hit_pairs"], st["admitted"], st["evicted_gradient"], st["evicted_stale"]) == (2, 3, 1, 0)
    # iterations 2 and 3: (1, 1), admitted at iteration 0, is served at staleness 2, not at 3
    iterate(cache, [(1, 1), (5, 5)], lo=30, values={(5, 5): 6.0}, grad_norms={(1, 1): 0.0, (5, 5): 1.0})
    assert cache.take_stats()["hit_pairs"] == 1
    emb = iterate(cache, [(1, 1), (5, 5)], lo=40, values={(1, 1): 7.0, (5, 5): 6.0},
                  grad_norms={(1, 1): 0.0, (5, 5): 1.0})
    st = cache.take_stats()
    assert (st["hit_pairs"], st["evicted_stale"], st["admitted"]) == (0, 1, 1) and emb[0, 0] == 7.0
    assert cached(cache)[(1, 1)] == 7.0  # computed anew and admitted again


def test_t_stale_0_or_p_grad_0_serves_nothing():
    for p_grad, t_stale in ((0.9, 0), (0.0, 5)):
        cache = EmbeddingCache(SRC, DIM, p_grad=p_grad, t_stale=t_stale, size=8)
        for it in range(3):
            iterate(cache, [(0, 0), (1, 1)], lo=10 * it, values={(0, 0): 1.0, (1, 1): 2.0}, grad_norms={})
        assert cache.take_stats()["hit_rows"] == 0


def test_an_entry_is_never_served_to_a_batch_before_the_one_that_computed_it():
    """Memory walks back in time at an epoch's (or a memory segment's) start: an embedding computed
    from memory up to event 100 must not reach a batch that starts at event 50."""
    cache = EmbeddingCache(SRC, DIM, p_grad=1.0, t_stale=10, size=8)
    iterate(cache, [(0, 0)], lo=100, values={(0, 0): 1.0}, grad_norms={})
    emb = iterate(cache, [(0, 0)], lo=50, values={(0, 0): 2.0}, grad_norms={})
    assert cache.take_stats()["hit_rows"] == 0 and emb[0, 0] == 2.0
    assert cached(cache) == {(0, 0): 2.0}  # the new value replaces the later one
    iterate(cache, [(0, 0)], lo=50, values={}, grad_norms={})
    assert cache.take_stats()["hit_rows"] == 1  # same start: served


def test_the_ring_buffer_overwrites_its_oldest_rows():
    cache = EmbeddingCache(SRC, DIM, p_grad=1.0, t_stale=10, size=3)
    iterate(cache, [(0, 0), (1, 1)], lo=0, values={(0, 0): 1.0, (1, 1): 2.0}, grad_norms={})
    iterate(cache, [(2, 2), (3, 3)], lo=1, values={(2, 2): 3.0, (3, 3): 4.0}, grad_norms={})
    assert cached(cache) == {(1, 1): 2.0, (2, 2): 3.0, (3, 3): 4.0} and cache.head == 1
    assert cache.take_stats()["overwritten"] == 1


def test_a_pair_filling_several_slots_is_computed_once_when_shared():
    cache = EmbeddingCache(SRC, DIM, p_grad=1.0, t_stale=10, size=8, share=True)
    batch = cache.lookup([hop([(0, 0), (1, 1), (0, 0)], k=4)], lo=0)
    assert batch.compute_rows.tolist() == [1, 2]  # one slot per pair (its last), none for the empty slot
    st = cache.take_stats()
    assert (st["slots"], st["rows"], st["computed"], st["pairs"]) == (4, 3, 2, 2)
    emb = batch.combine(torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    assert emb.tolist() == [[2.0, 2.0], [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="model=tgat2"):
        validate(compose(["cache.enabled=true"]))
    for bad in ("cache.p_grad=1.5", "cache.t_stale=-1", "cache.size=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            validate(compose(["model=tgat2", "cache.enabled=true", bad]))
    validate(compose(["model=tgat2", "cache=freshgnn"]))


# ----------------------------------------------------------------------------------------------
# A trainer with the cache


def trainer(cache: dict | None, seed: int = 0, dropout: float = 0.1) -> Trainer:
    g = generate(num_events=1500, num_nodes=60, num_communities=3, edge_dim=4, seed=1)
    torch.manual_seed(seed)
    m = build_model("tgn", num_nodes=g.num_nodes, mem_dim=16, time_dim=8, edge_dim=g.edge_dim, num_layers=2,
                    dropout=dropout)
    c = None if cache is None else EmbeddingCache(g.src, 16, **cache)
    return Trainer(g, chronological_split(g), m, memory_for(m, g.num_nodes), TemporalSampler(TCSR.build(g), [5, 5]),
                   NegativeSampler(g, seed), batch_size=50, lr=1e-3, num_neg_eval=1, progress=False, cache=c)


def train(tr: Trainer, steps: int, record=None) -> list[float]:
    """Training steps from the start of the stream; ``record``: a list the cache's batches go to."""
    if record is not None:
        lookup = tr.cache.lookup
        tr.cache.lookup = lambda hops, lo: record.append(lookup(hops, lo)) or record[-1]
    tr.model.train()
    torch.manual_seed(1)  # dropout
    losses = []
    for s, e in list(tr.batches("train"))[:steps]:
        losses.append(tr.step(s, e, tr.negatives.train(e - s, 1), train=True).loss)
    return losses


def scores(tr: Trainer) -> tuple:
    res = tr.evaluate("val")
    return res["val_ap"], res["val_auc"]


def test_t_stale_0_is_bit_identical_to_no_cache():
    """Nothing reused (and each slot computed, share_in_batch=false): the same losses, parameters
    and memory, bit for bit, dropout included."""
    a, b = trainer(None), trainer({"p_grad": 0.9, "t_stale": 0, "size": 1000, "share": False})
    assert train(a, 8) == train(b, 8)
    assert b.cache.take_stats()["admitted"] > 0  # the cache did its work, and served nothing
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(a.memory.mem, b.memory.mem)
    assert scores(a) == scores(b)


def test_sharing_a_pair_within_the_batch_changes_only_the_dropout_draws():
    """Without dropout, computing a pair once and sharing it gives the uncached loss (up to float
    summation order)."""
    a, b = trainer(None, dropout=0.0), trainer({"p_grad": 0.9, "t_stale": 0, "size": 1000}, dropout=0.0)
    assert train(a, 5) == pytest.approx(train(b, 5), rel=1e-5)


def test_a_hit_returns_exactly_the_stored_embedding():
    batches = []
    tr = trainer({"p_grad": 0.5, "t_stale": 5, "size": 10_000})
    train(tr, 8, batches)
    stored = {}  # pair key -> the value admitted, as computed
    served = 0
    for batch in batches:
        computed = batch.computed.detach()
        emb = batch.embeddings.detach()
        for i, key in enumerate(batch.keys):
            rows = batch.valid_rows[batch.pair_of_row == i]
            if batch.hit[i]:
                for r in rows:
                    assert torch.equal(emb[r], stored[key])
                served += len(rows)
            else:
                stored[key] = computed[batch.value_pos[i]].clone()
                for r in rows:  # shared within the batch
                    assert torch.equal(emb[r], stored[key])
    assert served > 0
    for key in np.flatnonzero(tr.cache.id_map >= 0):
        assert torch.equal(tr.cache.table[tr.cache.id_map[key]], stored[key])


def test_evaluation_does_not_use_the_cache():
    a, b = trainer(None), trainer({"p_grad": 0.9, "t_stale": 5, "size": 1000})
    b.model.load_state_dict(a.model.state_dict())
    assert scores(a) == scores(b)
    assert b.cache.take_stats()["rows"] == 0
