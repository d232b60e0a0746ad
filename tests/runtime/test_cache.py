"""FreshGNN's historical embedding cache (tgdist/runtime/cache.py): the exact cases, the policy on a
hand-made sequence, and a trainer with the cache against one without."""

import json
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


# ----------------------------------------------------------------------------------------------
# Pruning before the memory read


def test_the_memory_of_pruned_nodes_is_not_read():
    """A training step reads (and so updates) exactly the roots, the hop-1 neighbours and the
    hop-2 neighbours of the slots layer 1 computes, in the order of the unpruned table; nodes that
    only served or shared slots reach are left out."""
    tr = trainer({"p_grad": 0.9, "t_stale": 5, "size": 10_000})
    sampled, reads, batches = [], [], []
    sample, read = tr.sample, tr.memory.read
    tr.sample = lambda *a: sampled.append(sample(*a)) or sampled[-1]
    tr.memory.read = lambda ids: reads.append(ids.clone()) or read(ids)
    train(tr, 10, batches)
    assert len(sampled) == len(reads) == len(batches) == 10
    pruned = 0
    for s, ids, batch in zip(sampled, reads, batches):
        h1, h2 = s.hops
        rows = np.arange(batch.num_rows) if batch.compute_rows is None else batch.compute_rows.numpy()
        needed = (set(s.ids[s.root_idx].tolist()) | set(h1.nbr[h1.mask].tolist())
                  | set(h2.nbr[rows][h2.mask[rows]].tolist()))
        assert ids.tolist() == [v for v in s.ids.tolist() if v in needed]
        pruned += s.ids.numel() - ids.numel()
    assert pruned > 0 and sum(b.hit.sum() for b in batches) > 0


def test_pruning_before_the_read_trains_as_the_lookup_at_compute_time():
    """``Trainer.step`` looks the cache up when it prepares the batch and reads the pruned node
    set; ``compute`` of a batch prepared without the lookup looks it up itself and updates every
    node's memory. Both serve the same pairs and train the same model, up to float rounding: the
    memory update runs over fewer rows, so sums are taken in another order.

    Plain SGD, so a rounding difference in a gradient moves a parameter by lr times that
    difference (Adam divides by the gradient's running scale, and turned a 1e-8 difference of a
    near-zero gradient entry into an lr-sized step: 1.2e-4 on one of 32 entries on another CPU).
    Tolerances, from float32's epsilon (1.19e-7): the losses and memory are computed through about
    STEPS x DEPTH roundings of values of magnitude at most 1 (memory is a GRU state, |s| < 1); each
    parameter receives STEPS updates of lr x (gradient, of magnitude ~1, rounded through DEPTH
    operations)."""
    steps, depth, eps, lr = 12, 8, torch.finfo(torch.float32).eps, 0.1
    setting = {"p_grad": 0.9, "t_stale": 5, "size": 10_000}
    a, b = trainer(setting), trainer(setting)
    for tr in (a, b):
        tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=lr)
    start = [p.detach().clone() for p in a.model.parameters()]
    loss_a = train(a, steps)
    b.model.train()
    torch.manual_seed(1)
    loss_b = [b.compute(b.prepare(s, e, b.negatives.train(e - s, 1)), train=True).loss
              for s, e in list(b.batches("train"))[:steps]]
    assert loss_a == pytest.approx(loss_b, rel=steps * depth * eps)
    sa, sb = a.cache.take_stats(), b.cache.take_stats()
    assert sa == sb and sa["hit_rows"] > 0
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(a.model.parameters(), start))
    assert moved > 1e3 * steps * depth * eps  # training moved them far beyond the tolerance below
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=max(1.0, float(p.detach().abs().max())) * steps * depth * eps)
    torch.testing.assert_close(a.memory.mem, b.memory.mem, rtol=0, atol=steps * depth * eps)


def test_a_batch_looked_up_ahead_of_its_iteration_is_refused():
    """A lookup is the cache at one iteration: computing the batch after another one trained
    would serve it from a cache that has moved on."""
    tr = trainer({"p_grad": 0.9, "t_stale": 5, "size": 10_000})
    tr.model.train()
    (s0, e0), (s1, e1) = list(tr.batches("train"))[:2]
    late = tr.prepare(s1, e1, tr.negatives.train(e1 - s1, 1), lookup=True)
    tr.step(s0, e0, tr.negatives.train(e0 - s0, 1), train=True)
    with pytest.raises(RuntimeError, match="looked up in the embedding cache at its iteration 0, but is computed at 1"):
        tr.compute(late, train=True)


@pytest.mark.slow
def test_a_prefetching_run_with_the_cache_is_bit_identical(tmp_path):
    """The prefetch worker only samples; the lookup and the pruned read are made in order, when
    the batch is about to train, so the cache serves what it serves without prefetching."""
    from tgdist.runtime.run import Run

    small = ["data.max_events=1500", "model=tgat2", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
             "train.num_neg_eval=4", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1",
             "train.epochs=2", "cache=freshgnn"]
    out = {}
    for name, extra in (("plain", []), ("ahead", ["pipeline.prefetch=2"])):
        cfg = compose(small + extra + [f"run_dir={tmp_path / name}"])
        summary = Run(cfg, tmp_path / name).train()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        out[name] = ({k: v for k, v in summary.items() if k.startswith(("val_", "test_", "loss"))},
                     [json.loads(x)["cache"] for x in lines])
    assert out["ahead"] == out["plain"] and out["plain"][1][0]["hit_rows"] > 0


def test_a_run_resumed_mid_epoch_with_the_cache_ends_as_the_uninterrupted_one(tmp_path):
    """The cache is part of the checkpoint (each trainer's table, id map, ring and iteration): a
    run stopped mid-epoch and resumed serves and admits as the uninterrupted one, to the same
    metrics and cache statistics (it started with an empty cache: test AP 0.4-1 point off)."""
    from tests.runtime.runs import SMALL, lines, metrics, run

    base = [*SMALL, "model=tgat2", "cache=freshgnn", "train.epochs=2"]
    full, d_full = run(tmp_path, "full", base=base)
    stopped, d = run(tmp_path, "part", ["train.checkpoint_every=3", "train.stop_after_batches=16"], base=base)
    assert stopped["stopped"]
    resumed, d2 = run(tmp_path, "resumed", [f"train.resume={d}"], base=base)
    assert metrics(resumed) == metrics(full)
    assert [x["cache"] for x in lines(d2)] == [x["cache"] for x in lines(d_full)]
    assert lines(d_full)[0]["cache"]["hit_rows"] > 0
