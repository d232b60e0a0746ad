"""Plain NumPy reference implementations of the kernels in ``kernels.py``.

Slow and obvious on purpose: the tests compare every kernel against these on random graphs.
"""

from __future__ import annotations

import numpy as np

from tgdist.kernels.graph import splitmix64


def tcsr(src, dst, num_nodes, both_directions=True):
    """Per-node lists of (neighbour, event id) in event order, as indptr / nbr / eid."""
    lists = [[] for _ in range(num_nodes)]
    for e, (u, v) in enumerate(zip(src.tolist(), dst.tolist())):
        lists[u].append((v, e))
        if both_directions and v != u:  # a self-loop is listed once
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


def common_neighbour_rows(src, dst, t, ids, rows, before, recent, top):
    """For each row v: rows of ``ids`` sharing neighbours with ``ids[v]`` (each node's ``recent``
    latest before ``before``, distinct), most shared first, ties by lower row, -1 padded to ``top``."""
    def neighbours(node):
        return {int(v) for v, _, _ in _history(src, dst, t, node, before, True)[-recent:]} if recent else set()

    out = np.full((len(rows), top), -1, dtype=np.int64)
    for i, v in enumerate(rows):
        node, shared = int(ids[v]), {}
        mine = neighbours(node)
        for r, u in enumerate(ids.tolist()):
            if u != node:
                c = sum(1 for w in mine if u in neighbours(w))
                if c:
                    shared[r] = c
        best = sorted(shared, key=lambda r: (-shared[r], r))[:top]
        out[i, :len(best)] = best
    return out


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


def _unit(key: int, e: int, k: int) -> float:
    return (splitmix64(key ^ (e * 8 + k)) >> 11) * (1.0 / 9007199254740992.0)


def _pick(cum, lo, hi, u):
    base = float(cum[lo - 1]) if lo > 0 else 0.0
    x = base + u * (float(cum[hi - 1]) - base)
    return min(lo + int(np.searchsorted(cum[lo:hi], x, side="right")), hi - 1)


def synth_events(num_events, key, src_cum, dst_nodes, dst_cum, comm_ptr, comm, p_in, p_repeat, bipartite, ring):
    """The synthetic stream's endpoints, one event at a time with lists as partner rings."""
    num_nodes = len(comm)
    recent = [[] for _ in range(num_nodes)]  # newest last, at most `ring`
    pos = [0] * num_nodes
    src, dst = [], []
    for e in range(num_events):
        u = _pick(src_cum, 0, len(src_cum), _unit(key, e, 0))
        if recent[u] and _unit(key, e, 1) < p_repeat:
            v = recent[u][min(int(_unit(key, e, 2) * len(recent[u])), len(recent[u]) - 1)]
        else:
            lo, hi = int(comm_ptr[comm[u]]), int(comm_ptr[comm[u] + 1])
            if hi > lo and _unit(key, e, 2) < p_in:
                v = int(dst_nodes[_pick(dst_cum, lo, hi, _unit(key, e, 3))])
            else:
                v = int(dst_nodes[_pick(dst_cum, 0, len(dst_nodes), _unit(key, e, 3))])
        if not bipartite and v == u:
            for k in range(4, 8):
                v = int(dst_nodes[_pick(dst_cum, 0, len(dst_nodes), _unit(key, e, k))])
                if v != u:
                    break
            if v == u:
                v = (u + 1) % num_nodes
        src.append(u)
        dst.append(v)
        for a, b in ((u, v),) if bipartite else ((u, v), (v, u)):
            # a ring of size `ring`: slot pos[a] is overwritten once the ring is full
            if len(recent[a]) < ring:
                recent[a].append(b)
            else:
                recent[a][pos[a]] = b
            pos[a] = (pos[a] + 1) % ring
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
