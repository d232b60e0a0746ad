"""Numba kernels over plain arrays. Each has a NumPy reference in ``reference.py`` for the tests.

Conventions: node and event ids are int64; times are int64 or float64 (numba compiles one
specialisation per dtype); outputs have fixed shapes with a boolean mask for empty slots.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numba
import numpy as np
from numba import njit, prange

# ------------------------------------------------------------------------------------------
# T-CSR


@njit(cache=True)
def tcsr_fill(src, dst, num_nodes, both_directions):
    """Per-node neighbour lists in time order (the input events are sorted by time).

    Returns ``indptr [num_nodes + 1]``, ``nbr``, ``eid`` (event ids, ``[num_entries]``). A
    counting sort: O(num_events + num_nodes), stable, so each list keeps event order.
    A self-loop (u, u) is listed once, not twice, so it cannot fill two of a root's K slots.
    """
    n = src.shape[0]
    deg = np.zeros(num_nodes + 1, dtype=np.int64)
    for e in range(n):
        deg[src[e] + 1] += 1
        if both_directions and dst[e] != src[e]:
            deg[dst[e] + 1] += 1
    indptr = np.cumsum(deg)
    total = indptr[num_nodes]
    nbr = np.empty(total, dtype=np.int64)
    eid = np.empty(total, dtype=np.int64)
    cursor = indptr[:num_nodes].copy()
    for e in range(n):
        u = src[e]
        v = dst[e]
        p = cursor[u]
        nbr[p] = v
        eid[p] = e
        cursor[u] = p + 1
        if both_directions and v != u:
            p = cursor[v]
            nbr[p] = u
            eid[p] = e
            cursor[v] = p + 1
    return indptr, nbr, eid


# ------------------------------------------------------------------------------------------
# Temporal neighbour sampling


@njit(inline="always")
def _lower_bound(times, lo, hi, t):
    """First index in ``times[lo:hi]`` whose value is >= t (so [lo, result) is strictly before t)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if times[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    return lo


_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser on Python ints: ``_splitmix64`` (the kernels' hash) for keys and
    seeds hashed outside the kernels (negative streams, the generator's seed)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@njit(inline="always")
def _splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15))
    z = x
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def _recent_row(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask, r):
    u = roots[r]
    filled = 0
    if u >= 0:
        lo = indptr[u]
        hi = _lower_bound(etime, lo, indptr[u + 1], root_t[r])
        p = hi - 1
        while p >= lo and filled < k:
            out_nbr[r, filled] = nbr[p]
            out_eid[r, filled] = eid[p]
            out_t[r, filled] = etime[p]
            out_mask[r, filled] = True
            filled += 1
            p -= 1
    for j in range(filled, k):
        out_nbr[r, j] = -1
        out_eid[r, j] = -1
        out_t[r, j] = 0
        out_mask[r, j] = False


@njit(parallel=True, cache=True, nogil=True)
def sample_recent(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask):
    """The ``k`` latest neighbours of each root strictly before its time, newest first.

    Outputs are ``[num_roots, k]``; empty slots have mask False, nbr/eid -1 and time 0.
    A root with id < 0 (a padded slot of the previous hop) gets an empty row.
    """
    for r in prange(roots.shape[0]):
        _recent_row(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask, r)


@njit(cache=True, nogil=True)
def sample_recent_serial(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask):
    """``sample_recent`` on the calling thread only: for small hops, where waking the thread pool
    costs more than it saves (and, on a loaded machine, a descheduled worker stalls the join)."""
    for r in range(roots.shape[0]):
        _recent_row(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask, r)


@njit(inline="always")
def _uniform_row(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask, r):
    u = roots[r]
    lo = 0
    hi = 0
    if u >= 0:
        lo = indptr[u]
        hi = _lower_bound(etime, lo, indptr[u + 1], root_t[r])
    n = hi - lo
    for j in range(k):
        if n > 0:
            h = _splitmix64(np.uint64(seed) ^ (np.uint64(r) * np.uint64(0x100000001B3) + np.uint64(j)))
            p = lo + np.int64(h % np.uint64(n))
            out_nbr[r, j] = nbr[p]
            out_eid[r, j] = eid[p]
            out_t[r, j] = etime[p]
            out_mask[r, j] = True
        else:
            out_nbr[r, j] = -1
            out_eid[r, j] = -1
            out_t[r, j] = 0
            out_mask[r, j] = False


@njit(parallel=True, cache=True, nogil=True)
def sample_uniform(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask):
    """``k`` uniform draws (with replacement) among each root's neighbours strictly before its time.

    Draw j of root r uses splitmix64(seed, r, j), so results do not depend on the thread count.
    """
    for r in prange(roots.shape[0]):
        _uniform_row(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask, r)


@njit(cache=True, nogil=True)
def sample_uniform_serial(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask):
    """``sample_uniform`` on the calling thread only (same draws)."""
    for r in range(roots.shape[0]):
        _uniform_row(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask, r)


# ------------------------------------------------------------------------------------------
# Redundancy-free organisation (Sven, Algorithm 2), in O(n) expected time


@njit(cache=True, nogil=True)
def organize(ids):
    """Unique ids in first-appearance order, the restore index Psi and the latest index Phi.

    Sven (section 3.1.1, Algorithm 2): ``unique[psi[i]] == ids[i]`` for every i (Psi restores the
    full vector after dispatch); ``phi[u]`` is the position of the last occurrence of
    ``unique[u]`` in ``ids`` (the one whose value survives aggregation). For a flattened
    ``[src_0, dst_0, src_1, dst_1, ...]`` vector, Algorithm 2's interaction index is ``phi // 2``.
    The paper searches the unique list for each id, O(n n'); an open-addressing hash table makes
    it O(n) expected. Any int64 is a valid id, including negative padding values.
    """
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size <<= 1
    mask = size - 1
    keys = np.empty(size, dtype=np.int64)
    slot_of = np.full(size, -1, dtype=np.int64)  # -1: empty table slot (keys may hold any value)
    unique = np.empty(n, dtype=np.int64)
    psi = np.empty(n, dtype=np.int64)
    phi = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        v = ids[i]
        h = np.int64(_splitmix64(np.uint64(v)) & np.uint64(mask))
        while slot_of[h] != -1 and keys[h] != v:
            h = (h + 1) & mask
        if slot_of[h] == -1:
            keys[h] = v
            slot_of[h] = m
            unique[m] = v
            m += 1
        u = slot_of[h]
        psi[i] = u
        phi[u] = i
    return unique[:m].copy(), psi, phi[:m].copy()


# ------------------------------------------------------------------------------------------
# MSPipe-S: similar nodes by common neighbours (tgdist.runtime.mspipe)


@njit(cache=True)
def _recent_unique(indptr, nbr, etime, node, before, recent):
    """The distinct nodes among ``node``'s ``recent`` latest neighbours strictly before ``before``."""
    lo, hi = indptr[node], indptr[node + 1]
    end = _lower_bound(etime, lo, hi, before)
    return np.unique(nbr[max(lo, end - recent):end])


@njit(cache=True)
def common_neighbour_rows(indptr, nbr, etime, ids, rows, before, recent, top):
    """For each row v of ``rows``: the rows of ``ids`` (distinct nodes) whose nodes share a
    neighbour with node ``ids[v]``, most shared neighbours first (ties: lower row), at most ``top``
    of them; ``[len(rows), top]``, -1 where fewer. A node's neighbours are its ``recent`` latest
    ones strictly before ``before``, counted once each."""
    n = ids.shape[0]
    order = np.argsort(ids)
    sorted_ids = ids[order]
    counts = np.zeros(n, dtype=np.int64)
    touched = np.empty(n, dtype=np.int64)
    out = np.full((rows.shape[0], top), -1, dtype=np.int64)
    for i in range(rows.shape[0]):
        node = ids[rows[i]]
        m = 0
        for w in _recent_unique(indptr, nbr, etime, node, before, recent):
            for u in _recent_unique(indptr, nbr, etime, w, before, recent):
                if u == node:
                    continue
                k = np.searchsorted(sorted_ids, u)
                if k < n and sorted_ids[k] == u:
                    r = order[k]
                    if counts[r] == 0:
                        touched[m] = r
                        m += 1
                    counts[r] += 1
        cand = touched[:m]
        key = np.empty(m, dtype=np.int64)
        for j in range(m):
            key[j] = -counts[cand[j]] * (n + 1) + cand[j]  # most shared first, then the lower row
        best = cand[np.argsort(key)]
        for j in range(min(top, m)):
            out[i, j] = best[j]
        for j in range(m):
            counts[cand[j]] = 0
    return out


# ------------------------------------------------------------------------------------------
# Synthetic event streams (tgdist.data.synthetic)


@njit(inline="always")
def _unit(key, e, k):
    """Uniform double in [0, 1) for draw k of event e: counter-based, so chunking never changes it."""
    h = _splitmix64(key ^ np.uint64(e * 8 + k))
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(inline="always")
def _pick(cum, lo, hi, u):
    """Index in [lo, hi) drawn with probability proportional to the weights whose running sum is ``cum``."""
    base = cum[lo - 1] if lo > 0 else 0.0
    x = base + u * (cum[hi - 1] - base)
    a = lo
    b = hi - 1
    while a < b:  # first index with cum > x
        mid = (a + b) >> 1
        if cum[mid] > x:
            b = mid
        else:
            a = mid + 1
    return a


@njit(cache=True)
def synth_events(start, stop, key, src_cum, dst_nodes, dst_cum, comm_ptr, comm, p_in, p_repeat, bipartite,
                 recent, recent_count, recent_pos, out_src, out_dst):
    """Endpoints of events ``[start, stop)`` of a synthetic stream, in order (the sequential part).

    The source is drawn by activity (``src_cum``: running sum over source-side nodes 0..S-1).
    With probability ``p_repeat`` the destination is one of the source's last R partners
    (``recent [num_nodes, R]``, a ring per node, updated here), which memory-based models can learn;
    otherwise, with probability ``p_in`` it comes from the source's community, else from the whole
    destination side, by activity (``dst_nodes`` sorted by community, ``dst_cum`` their running
    activity sum, community c owning ``[comm_ptr[c], comm_ptr[c+1])``). Self-loops are redrawn.
    Outputs are written to ``out_src[e - start]``, ``out_dst[e - start]``.
    """
    num_nodes = comm.shape[0]
    num_src = src_cum.shape[0]
    num_dst = dst_nodes.shape[0]
    ring = recent.shape[1]
    for e in range(start, stop):
        u = _pick(src_cum, 0, num_src, _unit(key, e, 0))
        v = -1
        cnt = recent_count[u]
        if cnt > 0 and _unit(key, e, 1) < p_repeat:
            slot = min(np.int64(_unit(key, e, 2) * cnt), cnt - 1)
            v = recent[u, slot]
        else:
            c = comm[u]
            lo = comm_ptr[c]
            hi = comm_ptr[c + 1]
            if hi > lo and _unit(key, e, 2) < p_in:
                v = dst_nodes[_pick(dst_cum, lo, hi, _unit(key, e, 3))]
            else:
                v = dst_nodes[_pick(dst_cum, 0, num_dst, _unit(key, e, 3))]
        if not bipartite and v == u:
            for k in range(4, 8):
                v = dst_nodes[_pick(dst_cum, 0, num_dst, _unit(key, e, k))]
                if v != u:
                    break
            if v == u:
                v = (u + 1) % num_nodes
        out_src[e - start] = u
        out_dst[e - start] = v
        p = recent_pos[u]
        recent[u, p] = v
        recent_pos[u] = (p + 1) % ring
        recent_count[u] = min(recent_count[u] + 1, ring)
        if not bipartite:
            p = recent_pos[v]
            recent[v, p] = u
            recent_pos[v] = (p + 1) % ring
            recent_count[v] = min(recent_count[v] + 1, ring)


@contextmanager
def torch_threads_kept():
    """Run numba parallel kernels without changing torch's thread count.

    numba's OpenMP layer shares libgomp with torch, and a parallel launch resets the thread count
    torch reads: without this, ``train.num_threads`` would be silently ignored after the first
    launch, and results (which depend on the reduction order) would change between reruns.
    """
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def cpu_mask() -> tuple[int, ...]:
    """The CPUs this process may run on: its affinity mask (``taskset``, SLURM's
    ``--cpus-per-task``, MPI binding), not the machine's ``os.cpu_count()``. (numba sizes its
    thread pool the same way when it is imported, and cannot grow it later.)"""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform (macOS): every CPU
        return tuple(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """How many CPUs this process may run on (``cpu_mask``)."""
    return len(cpu_mask())


def set_threads(num_threads: int) -> int:
    """Set the numba thread count (0 = every CPU this process may use); returns the count in use."""
    limit = numba.config.NUMBA_NUM_THREADS
    if num_threads > limit:
        logging.getLogger(__name__).warning(
            "sampler.num_threads=%d: numba can run only %d in this process (NUMBA_NUM_THREADS, or the CPUs when "
            "numba started); using %d", num_threads, limit, limit)
    n = min(num_threads if num_threads > 0 else available_cpus(), limit)
    numba.set_num_threads(n)
    return n
