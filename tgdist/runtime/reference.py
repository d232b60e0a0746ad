"""Plain NumPy reference implementations of the kernels in ``kernels.py``.

Slow and obvious on purpose: the tests compare every kernel against these on random graphs.
"""

from __future__ import annotations

import numpy as np


def tcsr(src, dst, num_nodes, both_directions=True):
    """Per-node lists of (neighbour, event id) in event order, as indptr / nbr / eid."""
    lists = [[] for _ in range(num_nodes)]
    for e, (u, v) in enumerate(zip(src.tolist(), dst.tolist())):
        lists[u].append((v, e))
        if both_directions:
            lists[v].append((u, e))
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(x) for x in lists])
    flat = [p for x in lists for p in x]
    nbr = np.array([p[0] for p in flat], dtype=np.int64)
    eid = np.array([p[1] for p in flat], dtype=np.int64)
    return indptr, nbr, eid


def _history(src, dst, t, node, before, both_directions):
    """Events touching ``node`` strictly before ``before``, as (neighbour, eid, time), in event order."""
    out = []
    for e in range(len(src)):
        if t[e] >= before:
            continue
        if src[e] == node:
            out.append((dst[e], e, t[e]))
        elif both_directions and dst[e] == node:
            out.append((src[e], e, t[e]))
    return out


def sample_recent(src, dst, t, roots, root_t, k, both_directions=True):
    """The k most recent neighbours strictly before each root's time, newest first."""
    n = len(roots)
    nbr = np.full((n, k), -1, dtype=np.int64)
    eid = np.full((n, k), -1, dtype=np.int64)
    tt = np.zeros((n, k), dtype=t.dtype)
    mask = np.zeros((n, k), dtype=bool)
    for r in range(n):
        if roots[r] < 0:
            continue
        hist = _history(src, dst, t, roots[r], root_t[r], both_directions)[::-1][:k]
        for j, (v, e, te) in enumerate(hist):
            nbr[r, j], eid[r, j], tt[r, j], mask[r, j] = v, e, te, True
    return nbr, eid, tt, mask


def candidate_sets(src, dst, t, roots, root_t, both_directions=True):
    """For uniform sampling: the set of eligible event ids of each root."""
    return [set(e for _, e, _ in _history(src, dst, t, u, rt, both_directions)) if u >= 0 else set()
            for u, rt in zip(roots, root_t)]


def organize(ids):
    """Sven Algorithm 2 read literally (O(n n')): unique in first-appearance order, Psi, Phi."""
    unique, psi, phi = [], [], []
    for i, v in enumerate(ids.tolist()):
        if v in unique:
            u = unique.index(v)
            phi[u] = i
        else:
            unique.append(v)
            phi.append(i)
            u = len(unique) - 1
        psi.append(u)
    return np.array(unique, dtype=np.int64), np.array(psi, dtype=np.int64), np.array(phi, dtype=np.int64)
