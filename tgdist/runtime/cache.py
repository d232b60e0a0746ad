"""FreshGNN's historical embedding cache (freshgnn.txt sections 3-5) for two-layer temporal models.

What is cached: the inner-layer (layer-1) embedding of a hop-1 pair (v, e): node v at the time of
the event e through which the sampler reached it. Its key is ``2 e + d`` with ``d = 1`` when v is
e's destination (and not also its source), so an id map of ``2 * num_events`` entries gives every
pair a slot in O(1) (section 4.2's node id map, one entry per (node, event) pair).

Why a served embedding is never from the future: the layer-1 embedding of (v, e) reads v's memory
and that of v's hop-2 neighbours, sampled strictly before e's time, as the memory stood when the
embedding was computed. Memory then held only events before that iteration's batch start ``lo``.
Each entry records that ``lo`` and is served only to an iteration whose batch starts at or after
it, so it depends on events before the serving batch, as the uncached path does. A walk that goes
back in time (a new epoch, memory parallelism's next segment) cannot be served an embedding from a
later point of the stream. What the cache does change is how old the memory and the parameters
behind an embedding are: at most ``t_stale`` iterations (the controlled staleness).

Policy (section 4.1), once per training iteration, after backward: the batch's distinct pairs, the
computed and the served ones, are ranked by the norm of the loss gradient with respect to their
inner embedding (summed over the slots a pair fills). The fraction ``p_grad`` with the smallest
norms is admitted (computed pairs are written, served ones kept); served pairs among the rest are
evicted. An entry admitted at iteration a is served at iteration c only if ``c - a <= t_stale``,
and dropped when found older; ``t_stale = 0`` or ``p_grad = 0`` serves nothing.

Table (section 4.2): ``size`` rows, written at a ring-buffer head that wraps around, so an admission
overwrites the oldest rows (their pairs leave the id map); an eviction only clears the id map entry,
and the ring recycles the row. (FreshGNN moves the head back every ``t_stale`` iterations; the
default size, the most rows ``t_stale`` iterations can admit, makes the wrap do the same.)

Pruning (section 5, CSR2 in our dense layout): a served pair's hop-2 row is dropped before layer 1's
attention, which then runs over the other rows only, forward and backward; layer 2's key and value
terms are computed once per distinct inner row. A batch about to train is looked up when it is
prepared (``Trainer.prepare(lookup=True)``), and the nodes only its dropped hop-2 rows reach leave its
unique table (``prune_nodes``), so their memory is neither read nor updated. A batch read ahead of
its iteration (epoch-parallel read-ahead, MSPipe) is looked up when it is computed, since the cache
changes every iteration; its whole read is then updated. Hop 2 is always sampled in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tgdist.kernels import graph as kernels
from tgdist.uploads import upload


@dataclass
class CacheStats:
    """Counters since the last ``take_stats``. Rows are hop-1 slots (``[num_roots * K1]``)."""

    iterations: int = 0
    slots: int = 0  # hop-1 slots, empty ones included: the rows layer 1 computes without a cache
    computed: int = 0  # rows layer 1 computed (fewer than slots: served, shared or empty slots skipped)
    rows: int = 0  # hop-1 slots holding a neighbour: inner embeddings the model needs
    hit_rows: int = 0  # of them served from the cache: hop-2 rows not expanded
    nbrs: int = 0  # sampled hop-2 neighbours (the hop-2 expansion without a cache)
    nbrs_avoided: int = 0  # of them, those of the served rows: not attended over
    pairs: int = 0  # distinct (node, event) pairs
    hit_pairs: int = 0
    admitted: int = 0
    evicted_gradient: int = 0  # served pairs outside the p_grad fraction
    evicted_stale: int = 0  # found older than t_stale
    overwritten: int = 0  # rows the ring buffer reused while their pair was still cached

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["hit_rate"] = self.hit_rows / self.rows if self.rows else 0.0
        return d


@dataclass
class CachedBatch:
    """One training batch's view of the cache, made by ``EmbeddingCache.lookup`` and handed to the
    embedding (``EmbedInput.inner``), which computes the rows ``compute_rows`` and calls
    ``distinct`` (or ``combine``); ``EmbeddingCache.admit`` reads it after backward.

    ``iteration``: the cache's iteration at the lookup (the batch must be computed at that one);
    ``valid_rows [num_valid]``: the hop-1 slots holding a neighbour (flat indices into
    ``[num_rows = num_roots * K1]``); ``pair_of_row [num_valid]``: their distinct pair, of
    ``keys [num_pairs]``; ``hit [num_pairs]``: served; ``hit_values [num_hit_pairs, dim]``: the
    served embeddings, a leaf whose gradient admission reads; ``compute_rows``: the slots whose
    inner embedding layer 1 computes (None: every slot, as without a cache); ``source [num_rows]``:
    each slot's row in ``[computed | hit_values | a zero row]`` (None with ``compute_rows``);
    ``grad_pos``, ``grad_pair``: computed rows and the pair whose gradient each adds to;
    ``value_pos [num_pairs]``: the computed row a pair's value is admitted from."""

    iteration: int
    lo: int
    num_rows: int
    valid_rows: np.ndarray
    pair_of_row: np.ndarray
    keys: np.ndarray
    hit: np.ndarray
    hit_values: torch.Tensor
    compute_rows: torch.Tensor | None
    source: torch.Tensor | None
    grad_pos: np.ndarray
    grad_pair: np.ndarray
    value_pos: np.ndarray
    computed: torch.Tensor | None = field(default=None)  # [len(compute_rows) or num_rows, dim], set by distinct
    values: torch.Tensor | None = field(default=None)  # [computed | hit_values | zero], set by distinct

    def distinct(self, computed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's distinct inner embeddings ``[computed | served | a zero row]`` from the
        ``computed`` rows (``compute_rows``), and each hop-1 slot's row in them, ``source
        [num_rows]`` (None: row i is slot i, as without a cache). Layer 2 gathers its per-row key
        and value terms through ``source``, so they are computed once per distinct row; the
        zero row stands for empty slots, which layer 2 masks."""
        if computed.requires_grad:
            computed.retain_grad()  # admission ranks pairs by this gradient
        self.computed = computed
        if self.source is None:
            self.values = computed
        else:
            self.values = torch.cat([computed, self.hit_values, computed.new_zeros(1, self.hit_values.shape[1])])
        return self.values, self.source

    def combine(self, computed: torch.Tensor) -> torch.Tensor:
        """The inner embeddings of every hop-1 slot ``[num_rows, dim]`` (``distinct``, gathered)."""
        self.distinct(computed)
        return self.embeddings

    @property
    def embeddings(self) -> torch.Tensor | None:
        """``[num_rows, dim]``: each hop-1 slot's inner embedding, once ``distinct`` has run."""
        if self.values is None or self.source is None:
            return self.values
        return self.values.index_select(0, self.source)


class EmbeddingCache:
    """The table, its id map and ring-buffer head, and the admission / eviction policy.

    ``src [num_events]``: the graph's sources (a pair's key tells v's side of e); ``dim``: the
    inner embedding size; ``size``: table rows; ``device``: where the table lives."""

    def __init__(self, src: np.ndarray, dim: int, *, p_grad: float, t_stale: int, size: int,
                 share: bool = True, device: torch.device | str = "cpu"):
        if not 0 <= p_grad <= 1 or t_stale < 0 or size < 1:
            raise ValueError(f"EmbeddingCache: p_grad={p_grad} must be in [0, 1], t_stale={t_stale} at least 0, "
                             f"size={size} at least 1")
        self.src = np.asarray(src, dtype=np.int64)
        self.p_grad, self.t_stale, self.size = float(p_grad), int(t_stale), int(size)
        self.share = bool(share)  # a pair's embedding computed once per batch, shared by its slots
        self.device = torch.device(device)
        # pair key -> table row, -1: absent (int32 while the table fits: 8 bytes per event)
        self.id_map = np.full(2 * self.src.shape[0], -1, dtype=np.int32 if self.size < 2**31 else np.int64)
        self.table = torch.zeros(self.size, dim, device=self.device)
        self.row_key = np.full(self.size, -1, dtype=np.int64)  # the pair a row holds, -1: none
        self.row_iteration = np.zeros(self.size, dtype=np.int64)  # when it was admitted
        self.row_lo = np.zeros(self.size, dtype=np.int64)  # batch start of the iteration that computed it
        self.head = 0
        self.iteration = 0  # training iterations admitted so far
        self.stats = CacheStats()

    def keys(self, nbr: np.ndarray, eid: np.ndarray) -> np.ndarray:
        """Pair keys ``2 e + d`` of neighbours ``nbr`` reached through events ``eid`` (same shape)."""
        return 2 * eid + (nbr != self.src[eid])

    def __len__(self) -> int:
        """Pairs the id map holds (some may be too stale to serve)."""
        return int((self.id_map >= 0).sum())

    def lookup(self, hops: list, lo: int) -> CachedBatch:
        """What iteration ``self.iteration``, whose batch starts at event ``lo``, is served for the
        pairs of ``hops[0]`` (the sampled hop 1: ``nbr``, ``eid``, ``mask`` ``[num_roots, K1]``;
        ``hops[1].mask [num_roots * K1, K2]`` counts the hop-2 neighbours not attended over), and
        which slots layer 1 computes."""
        hop = hops[0]
        mask = hop.mask.reshape(-1)
        num_rows = mask.shape[0]
        valid = np.flatnonzero(mask)
        keys = self.keys(hop.nbr.reshape(-1)[valid], hop.eid.reshape(-1)[valid])
        uniq, pair_of_row, last = kernels.organize(keys)
        num_pairs = uniq.shape[0]
        row = self.id_map[uniq]
        present = np.flatnonzero(row >= 0)
        age = self.iteration - self.row_iteration[row[present]]
        stale = present[age > self.t_stale]
        self.id_map[uniq[stale]] = -1  # eviction by staleness (the ring recycles the row)
        self.row_key[row[stale]] = -1
        fresh = present[(age <= self.t_stale) & (self.row_lo[row[present]] <= lo)]
        hit = np.zeros(num_pairs, dtype=bool)
        hit[fresh] = True
        dev = self.device
        hit_values = self.table.index_select(0, upload(row[fresh], dev)).requires_grad_(True)
        row_hit = hit[pair_of_row]
        st = self.stats
        st.slots += num_rows
        st.rows += valid.shape[0]
        st.pairs += num_pairs
        st.hit_pairs += fresh.shape[0]
        st.hit_rows += int(row_hit.sum())
        st.evicted_stale += stale.shape[0]
        if len(hops) > 1:
            st.nbrs += int(hops[1].mask.sum())
            st.nbrs_avoided += int(hops[1].mask[valid[row_hit]].sum())

        def t(a):
            return upload(a, dev)

        miss = ~row_hit
        if self.share:  # one computed row per pair not served: its last slot
            compute = np.sort(valid[last[~hit]])
            grad_rows = compute
        elif fresh.shape[0]:  # every slot not served, empty ones included (as without a cache)
            served = np.zeros(num_rows, dtype=bool)
            served[valid[row_hit]] = True
            compute = np.flatnonzero(~served)
            grad_rows = valid[miss]
        else:  # nothing served: exactly the uncached computation
            st.computed += num_rows
            pos = valid[miss]
            return CachedBatch(self.iteration, lo, num_rows, valid, pair_of_row, uniq, hit, hit_values, None, None,
                               pos, pair_of_row[miss], valid[last])
        st.computed += compute.shape[0]
        grad_pos = np.searchsorted(compute, grad_rows)
        grad_pair = pair_of_row[miss] if not self.share else pair_of_row[np.searchsorted(valid, grad_rows)]
        value_pos = np.zeros(num_pairs, dtype=np.int64)
        value_pos[~hit] = np.searchsorted(compute, valid[last[~hit]])
        hit_index = np.full(num_pairs, -1, dtype=np.int64)
        hit_index[fresh] = np.arange(fresh.shape[0])
        source = np.full(num_rows, compute.shape[0] + fresh.shape[0], dtype=np.int64)  # the zero row
        if self.share:
            source[valid[miss]] = value_pos[pair_of_row[miss]]
        else:
            source[compute] = np.arange(compute.shape[0])
        source[valid[row_hit]] = compute.shape[0] + hit_index[pair_of_row[row_hit]]
        return CachedBatch(self.iteration, lo, num_rows, valid, pair_of_row, uniq, hit, hit_values, t(compute),
                           t(source), grad_pos, grad_pair, value_pos)

    @torch.no_grad()
    def admit(self, batch: CachedBatch) -> None:
        """Admission and eviction after the backward of ``batch`` (section 4.1), then the next
        iteration. Needs the gradients of ``batch.computed`` and ``batch.hit_values``."""
        num_pairs = batch.keys.shape[0]
        dev = self.device
        computed = batch.computed
        grad = torch.zeros(num_pairs, computed.shape[1], device=dev)
        if computed.grad is not None:
            grad.index_add_(0, upload(batch.grad_pair, dev),
                            computed.grad.index_select(0, upload(batch.grad_pos, dev)))
        hit_pairs = np.flatnonzero(batch.hit)
        if batch.hit_values.grad is not None and hit_pairs.shape[0]:
            grad[upload(hit_pairs, dev)] = batch.hit_values.grad
        order = torch.argsort(grad.norm(dim=1), stable=True).cpu().numpy()
        small, large = order[:int(self.p_grad * num_pairs)], order[int(self.p_grad * num_pairs):]

        # evict: the large-gradient pairs the id map holds (served or not)
        gone = large[self.id_map[batch.keys[large]] >= 0]
        self.row_key[self.id_map[batch.keys[gone]]] = -1
        self.id_map[batch.keys[gone]] = -1
        self.stats.evicted_gradient += int(batch.hit[gone].sum())
        # admit: the small-gradient pairs computed in this batch (served ones stay as they are)
        new = small[~batch.hit[small]][: self.size]
        if new.shape[0]:
            keys = batch.keys[new]
            old = self.id_map[keys]  # an older entry of the same pair (not served: later than lo)
            self.row_key[old[old >= 0]] = -1
            rows = (self.head + np.arange(new.shape[0])) % self.size
            prev = self.row_key[rows]
            live = prev[prev >= 0]
            self.stats.overwritten += live.shape[0]
            self.id_map[live] = -1
            value_rows = upload(batch.value_pos[new], dev)  # each pair's last slot
            self.table[upload(rows, dev)] = computed.detach().index_select(0, value_rows)
            self.id_map[keys] = rows
            self.row_key[rows] = keys
            self.row_iteration[rows] = self.iteration
            self.row_lo[rows] = batch.lo
            self.head = int((self.head + new.shape[0]) % self.size)
            self.stats.admitted += new.shape[0]
        self.iteration += 1
        self.stats.iterations += 1

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run serves and admits as the uninterrupted one
        does: the table, the id map, each row's pair, iteration and batch start, the ring head,
        the iteration count, and the statistics of the epoch so far (tensors: checkpoints are
        read with ``weights_only``)."""
        return {"table": self.table.detach().cpu().clone(), "id_map": torch.from_numpy(self.id_map.copy()),
                "row_key": torch.from_numpy(self.row_key.copy()),
                "row_iteration": torch.from_numpy(self.row_iteration.copy()),
                "row_lo": torch.from_numpy(self.row_lo.copy()), "head": self.head, "iteration": self.iteration,
                "stats": dict(vars(self.stats))}

    def load_state_dict(self, state: dict) -> None:
        """``state_dict``'s state, of a cache of the same size and dimension over the same events
        (the run's config and data are checked before this)."""
        if tuple(state["table"].shape) != tuple(self.table.shape) or state["id_map"].shape[0] != self.id_map.shape[0]:
            raise ValueError(f"embedding cache state of table {tuple(state['table'].shape)} and {state['id_map'].shape[0]} "
                             f"pair keys does not fit this cache ({tuple(self.table.shape)}, {self.id_map.shape[0]})")
        self.table.copy_(state["table"].to(self.device))
        self.id_map = state["id_map"].numpy().astype(self.id_map.dtype, copy=True)
        self.row_key = state["row_key"].numpy().copy()
        self.row_iteration = state["row_iteration"].numpy().copy()
        self.row_lo = state["row_lo"].numpy().copy()
        self.head, self.iteration = int(state["head"]), int(state["iteration"])
        self.stats = CacheStats(**state["stats"])

    def take_stats(self) -> dict:
        """The counters since the last call, and a fresh set."""
        out, self.stats = self.stats.as_dict(), CacheStats()
        out["entries"] = len(self)
        return out


def prune_nodes(ids: torch.Tensor, root_idx: torch.Tensor, hop_tables: list, compute_rows: torch.Tensor | None):
    """FreshGNN's pruning (section 5) before the memory read: a batch's unique nodes ``ids
    [num_unique]`` without those that only hop-2 rows outside ``compute_rows`` reach (rows of
    slots served from the cache or shared with another slot), so their memory is neither read nor
    updated. ``root_idx`` and both hops' ``HopTables`` index ``ids``; returns the kept ``ids``,
    ``root_idx`` and ``hop_tables`` indexing them (the kept nodes in their order; hop-2 rows outside
    ``compute_rows`` point at row 0, a root, and must not be attended over), or None when every node
    stays (``compute_rows`` None: every row is computed)."""
    if compute_rows is None:
        return None
    hop1, hop2 = hop_tables
    dev = ids.device
    rows = compute_rows.to(dev)
    keep = torch.zeros(ids.shape[0], dtype=torch.bool, device=dev)
    keep[root_idx] = True
    keep[hop1.nbr[hop1.mask]] = True
    keep[hop2.nbr.index_select(0, rows)[hop2.mask.index_select(0, rows)]] = True
    if bool(keep.all()):
        return None
    new = torch.cumsum(keep, 0) - 1  # old row -> kept row (row 0, the first root's node, is kept)
    nbr2 = torch.where(keep.index_select(0, hop2.nbr.reshape(-1)), new.index_select(0, hop2.nbr.reshape(-1)), 0)
    return (ids[keep], new.index_select(0, root_idx),
            [replace(hop1, nbr=new.index_select(0, hop1.nbr.reshape(-1)).view_as(hop1.nbr)),
             replace(hop2, nbr=nbr2.view_as(hop2.nbr))])


def cache_totals(stats: list[dict]) -> dict:
    """The sum of several ``take_stats`` results (a parallel run's trainers), the hit rate of the sum."""
    out = {k: sum(s[k] for s in stats) for k in stats[0] if k != "hit_rate"}
    out["hit_rate"] = out["hit_rows"] / out["rows"] if out["rows"] else 0.0
    return out


def default_size(p_grad: float, t_stale: int, rows_per_batch: int, num_events: int) -> int:
    """The most rows ``t_stale`` iterations can admit (``p_grad`` of ``rows_per_batch`` each), at
    most one per (node, event) pair: the ring then never overwrites an entry young enough to serve."""
    return max(1, min(2 * num_events, int(p_grad * rows_per_batch) * max(t_stale, 1)))
