"""Numba kernels over plain arrays. Each has a NumPy reference in ``reference.py`` for the tests.

Conventions: node and event ids are int64; times are int64 or float64 (numba compiles one
specialisation per dtype); outputs have fixed shapes with a boolean mask for empty slots.
"""

from __future__ import annotations

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
    """
    n = src.shape[0]
    deg = np.zeros(num_nodes + 1, dtype=np.int64)
    for e in range(n):
        deg[src[e] + 1] += 1
        if both_directions:
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
        if both_directions:
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


@njit(inline="always")
def _splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15))
    z = x
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(parallel=True, cache=True)
def sample_recent(indptr, nbr, eid, etime, roots, root_t, k, out_nbr, out_eid, out_t, out_mask):
    """The ``k`` latest neighbours of each root strictly before its time, newest first.

    Outputs are ``[num_roots, k]``; empty slots have mask False, nbr/eid -1 and time 0.
    A root with id < 0 (a padded slot of the previous hop) gets an empty row.
    """
    for r in prange(roots.shape[0]):
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


@njit(parallel=True, cache=True)
def sample_uniform(indptr, nbr, eid, etime, roots, root_t, k, seed, out_nbr, out_eid, out_t, out_mask):
    """``k`` uniform draws (with replacement) among each root's neighbours strictly before its time.

    Draw j of root r uses splitmix64(seed, r, j), so results do not depend on the thread count.
    """
    for r in prange(roots.shape[0]):
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


# ------------------------------------------------------------------------------------------
# Redundancy-free organisation (Sven, Algorithm 2), in O(n) expected time


@njit(cache=True)
def organize(ids):
    """Unique ids in first-appearance order, the restore index Psi and the latest index Phi.

    ``unique[psi[i]] == ids[i]`` for every i (Psi restores the full vector after dispatch);
    ``phi[u]`` is the position of the last occurrence of ``unique[u]`` in ``ids`` (the event whose
    value survives aggregation). Sven's Algorithm 2 searches the unique list for each id,
    O(n n'); an open-addressing hash table makes it O(n).
    """
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size <<= 1
    mask = size - 1
    keys = np.full(size, -1, dtype=np.int64)
    slot_of = np.empty(size, dtype=np.int64)
    unique = np.empty(n, dtype=np.int64)
    psi = np.empty(n, dtype=np.int64)
    phi = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        v = ids[i]
        h = np.int64(_splitmix64(np.uint64(v)) & np.uint64(mask))
        while keys[h] != -1 and keys[h] != v:
            h = (h + 1) & mask
        if keys[h] == -1:
            keys[h] = v
            slot_of[h] = m
            unique[m] = v
            m += 1
        u = slot_of[h]
        psi[i] = u
        phi[u] = i
    return unique[:m].copy(), psi, phi[:m].copy()


def set_threads(num_threads: int) -> int:
    """Set the numba thread count (0 = all available); returns the count in use."""
    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if num_threads <= 0 else min(num_threads, limit)
    numba.set_num_threads(n)
    return n
