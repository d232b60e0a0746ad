"""Numba kernels of the partitioner, over plain arrays.

Each kernel has a slow, obvious twin in ``tgdist/partition/reference.py`` that the tests compare
against. Conventions: vertex ids and trainer ids are int64; access weights are int64
``[num_nodes, num_parts]`` (``W[v, t]`` = how often trainer t needs vertex v); an assignment is an
int64 ``owner[num_nodes]`` with values in ``[0, num_parts)`` (or -1 while a vertex is unlabeled).

The balance-cost arithmetic used by Re-FlexBiCut and the greedy baseline relies on one identity of
the trainer-vertex access graph (it has no vertex-vertex edges): the load of trainer j (the weight
of the edges that cross the boundary of ``W_j = {t_j} + V'_j``, Sven eq. (5) as read in
``tgdist.partition.measures``) is

    load_j = A_j + sum_{v in V'_j} (s_v - 2 W[v, j]),   A_j = sum_v W[v, j],  s_v = sum_t W[v, t],

i.e. it starts with everything j needs fetched remotely (A_j) and each vertex placed on j adds the
fetches of the others (s_v - W[v, j], now served by j) and removes j's own (W[v, j], now local).
So placing v on j changes load_j by ``c[v, j] = s_v - 2 W[v, j]`` and no other load.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# ------------------------------------------------------------------------------------------
# Access graph (pre-sampling)


@njit(cache=True)
def access_counts(rows, group, trainer, raw, dedup, stamp, rec_ids, rec_group):
    """Accumulate one chunk of pre-sampled accesses into the trainer-vertex weights.

    ``rows`` int64 ``[num_events, ids_per_event]``: every vertex id an event's roots and their
    sampled neighbours touch (-1 = empty sampler slot, skipped); ``group`` int64
    ``[num_events]``: the (batch, trainer) group of each event, ``batch * num_parts + trainer``,
    non-decreasing along the events; ``trainer`` int64 ``[num_events]``.
    ``raw[v, t] += 1`` per occurrence; ``dedup[v, t] += 1`` once per group that touches v (the
    redundancy-free fetch of Sven Algorithm 2: a trainer fetches a unique node once per batch).
    ``stamp`` int64 ``[num_nodes]`` (initialised to -1 and carried across chunks) holds the last
    group that counted each vertex: as groups are contiguous, dedup needs no hash set.
    When ``rec_ids`` is non-empty (capacity ``rows.size``), each first sighting of a vertex in a
    group is also recorded as ``(rec_ids[r], rec_group[r])``, in order; returns the record count.
    """
    num_events, width = rows.shape
    record = rec_ids.shape[0] > 0
    r = 0
    for e in range(num_events):
        g = group[e]
        t = trainer[e]
        for k in range(width):
            v = rows[e, k]
            if v < 0:
                continue
            raw[v, t] += 1
            if stamp[v] != g:
                stamp[v] = g
                dedup[v, t] += 1
                if record:
                    rec_ids[r] = v
                    rec_group[r] = g
                    r += 1
    return r


# ------------------------------------------------------------------------------------------
# Measures


@njit(cache=True)
def owner_matrix(weights, owner, num_parts):
    """``out[i, j] = sum of weights[v, i] over v with owner[v] == j``; int64 ``[num_parts, num_parts]``.

    The off-diagonal part is the communication matrix C (trainer i fetches from trainer j); the
    diagonal counts trainer i's local accesses.
    """
    out = np.zeros((num_parts, num_parts), dtype=np.int64)
    n, m = weights.shape
    for v in range(n):
        j = owner[v]
        for i in range(m):
            out[i, j] += weights[v, i]
    return out


@njit(cache=True)
def batch_costs(indptr, ids, owner, num_parts, num_batches):
    """Per-batch communication: the all-to-all of each global batch on its own.

    ``indptr`` int64 ``[num_batches * num_parts + 1]`` and ``ids`` ``[nnz]``: the unique vertices
    of group ``b * num_parts + t`` (trainer t in batch b) are ``ids[indptr[g]:indptr[g + 1]]``.
    Returns int64 ``(balance cost [num_batches], max link [num_batches], volume [num_batches])``:
    per batch, C_b[t, j] counts t's unique vertices owned by j != t; the balance cost is
    ``max_j (row_j + column_j)`` of C_b, the max link ``max C_b``, the volume ``sum C_b``.
    """
    m = num_parts
    cost = np.zeros(num_batches, dtype=np.int64)
    link = np.zeros(num_batches, dtype=np.int64)
    volume = np.zeros(num_batches, dtype=np.int64)
    comm = np.zeros((m, m), dtype=np.int64)
    for b in range(num_batches):
        comm[:, :] = 0
        for t in range(m):
            g = b * m + t
            for p in range(indptr[g], indptr[g + 1]):
                j = owner[ids[p]]
                if j != t:
                    comm[t, j] += 1
        best = 0
        top = 0
        tot = 0
        for j in range(m):
            load = 0
            for k in range(m):
                load += comm[j, k] + comm[k, j]
                top = max(top, comm[j, k])
                tot += comm[j, k]
            best = max(best, load)
        cost[b] = best
        link[b] = top
        volume[b] = tot
    return cost, link, volume


# ------------------------------------------------------------------------------------------
# Re-FlexBiCut (Sven 3.1.2, Algorithm 3)


@njit(cache=True)
def _reassign(i, weights, total, order, cap, owner, load, size):
    """Flexible reassignment for trainer i (Algorithm 3, lines 8-12), one vertex at a time.

    Walks the vertices in t_i's bisection order (those on t_i's side of the cut first) and moves a
    vertex v from its owner j to i when that strictly lowers max(load_i, load_j), which never raises
    the balance cost max_k load_k and strictly lowers the sorted load vector (so the search ends).
    Returns the number of moves.
    """
    n = order.shape[1]
    moves = 0
    for p in range(n):
        if size[i] >= cap:
            break
        v = order[i, p]
        j = owner[v]
        if j < 0 or j == i:
            continue
        ci = total[v] - 2 * weights[v, i]
        cj = total[v] - 2 * weights[v, j]
        new_i = load[i] + ci
        new_j = load[j] - cj
        old = max(load[i], load[j])
        if max(new_i, new_j) < old:
            owner[v] = i
            load[i] = new_i
            load[j] = new_j
            size[i] += 1
            size[j] -= 1
            moves += 1
    return moves


@njit(cache=True)
def flexbicut_run(weights, total, order, seq, cap, budget, max_rounds, owner, load, size):
    """Algorithm 3 for one load bound ``budget`` (the guess B of Theorem 2's binary search).

    ``weights`` ``[N, M]``; ``total[v] = sum_t weights[v, t]``; ``order`` int64 ``[M, N]``: each
    trainer's bisection order (``methods.bisection_order``); ``seq`` int64 ``[M]``: the trainer
    visiting order (rotated every round); ``cap``: the most vertices one trainer may own.
    In/out: ``owner`` ``[N]`` (-1 = unlabeled), ``load`` ``[M]`` (start: A_j), ``size`` ``[M]``.

    Each round visits every trainer i: (1) bisection (lines 5-7): walking ``order[i]``, t_i takes
    every unlabeled vertex that keeps load_i <= budget (a vertex with c <= 0 never raises it) until
    it owns ``cap`` vertices; (2) flexible reassignment (lines 8-12, ``_reassign``). Rounds repeat
    while vertices are unlabeled and the previous round changed something.
    Returns ``(number of unlabeled vertices left, rounds run)``.
    """
    n, m = weights.shape
    unlabeled = 0
    for v in range(n):
        if owner[v] < 0:
            unlabeled += 1
    rounds = 0
    while unlabeled > 0 and rounds < max_rounds:
        changed = 0
        for q in range(m):
            i = seq[(q + rounds) % m]
            for p in range(n):
                if size[i] >= cap:
                    break
                v = order[i, p]
                if owner[v] >= 0:
                    continue
                c = total[v] - 2 * weights[v, i]
                if c > 0 and load[i] + c > budget:
                    continue
                owner[v] = i
                load[i] += c
                size[i] += 1
                unlabeled -= 1
                changed += 1
            changed += _reassign(i, weights, total, order, cap, owner, load, size)
        rounds += 1
        if changed == 0:
            break
    return unlabeled, rounds


@njit(cache=True)
def relocate(weights, total, cap, max_passes, owner, load, size):
    """Single-vertex moves to a fixpoint: the local-optimality phase after Algorithm 3.

    Pass after pass over the vertices in id order, each vertex v (owner j) moves to the trainer i
    that gives the smallest ``max(load_i + c_i(v), load_j - c_j(v))``, if that is strictly below
    ``max(load_i, load_j)`` and i owns fewer than ``cap`` vertices: the same acceptance rule as the
    flexible reassignment, vertex-major so that each pass reads ``weights`` row by row (O(N M),
    cache-friendly). Returns ``(moves, passes)``.
    """
    n, m = weights.shape
    moves = 0
    passes = 0
    while passes < max_passes:
        moved = 0
        for v in range(n):
            j = owner[v]
            cj = total[v] - 2 * weights[v, j]
            best_i = -1
            best = 0
            for i in range(m):
                if i == j or size[i] >= cap:
                    continue
                new = max(load[i] + total[v] - 2 * weights[v, i], load[j] - cj)
                if new < max(load[i], load[j]) and (best_i < 0 or new < best):
                    best_i = i
                    best = new
            if best_i >= 0:
                i = best_i
                owner[v] = i
                load[i] += total[v] - 2 * weights[v, i]
                load[j] -= cj
                size[i] += 1
                size[j] -= 1
                moved += 1
        moves += moved
        passes += 1
        if moved == 0:
            break
    return moves, passes


@njit(inline="always")
def _keep_smallest(keys, ids, count, k, key, v):
    """Insert (key, v) into the ascending top-k list ``keys[:count]``; returns the new count."""
    if count == k and key >= keys[k - 1]:
        return count
    p = count if count < k else k - 1
    while p > 0 and keys[p - 1] > key:
        keys[p] = keys[p - 1]
        ids[p] = ids[p - 1]
        p -= 1
    keys[p] = key
    ids[p] = v
    return count + 1 if count < k else count


@njit(cache=True)
def swap_descent(weights, total, cap, k, max_steps, owner, load, size):
    """Exchanges for the busiest trainer, for when capacity blocks single moves.

    Repeatedly takes the trainer mx with the largest load and, over every other trainer j, the
    best of: moving one of mx's ``k`` costliest vertices (largest c_mx) to j, or exchanging it with
    one of j's ``k`` vertices cheapest to host on mx; applies the best if it strictly lowers
    max(load_mx, load_j) (so the balance cost never rises and the search ends). Sizes change only
    by moves within ``cap``. Returns the number of moves and exchanges applied.
    """
    n, m = weights.shape
    u_keys = np.empty(k, dtype=np.int64)
    u_ids = np.empty(k, dtype=np.int64)
    v_keys = np.empty((m, k), dtype=np.int64)
    v_ids = np.empty((m, k), dtype=np.int64)
    v_cnt = np.zeros(m, dtype=np.int64)
    steps = 0
    while steps < max_steps:
        mx = 0
        for j in range(1, m):
            if load[j] > load[mx]:
                mx = j
        u_cnt = 0
        v_cnt[:] = 0
        for v in range(n):
            j = owner[v]
            c_mx = total[v] - 2 * weights[v, mx]
            if j == mx:
                u_cnt = _keep_smallest(u_keys, u_ids, u_cnt, k, -c_mx, v)
            else:
                v_cnt[j] = _keep_smallest(v_keys[j], v_ids[j], v_cnt[j], k, c_mx, v)
        best = load[mx]
        best_u = -1
        best_v = -1
        best_j = -1
        for j in range(m):
            if j == mx:
                continue
            for a in range(u_cnt):
                u = u_ids[a]
                cu_mx = total[u] - 2 * weights[u, mx]
                cu_j = total[u] - 2 * weights[u, j]
                if size[j] < cap:
                    val = max(load[mx] - cu_mx, load[j] + cu_j)
                    if val < best:
                        best, best_u, best_v, best_j = val, u, -1, j
                for b in range(v_cnt[j]):
                    v = v_ids[j, b]
                    val = max(load[mx] - cu_mx + (total[v] - 2 * weights[v, mx]),
                              load[j] + cu_j - (total[v] - 2 * weights[v, j]))
                    if val < best:
                        best, best_u, best_v, best_j = val, u, v, j
        if best_u < 0:
            break
        j = best_j
        owner[best_u] = j
        load[mx] -= total[best_u] - 2 * weights[best_u, mx]
        load[j] += total[best_u] - 2 * weights[best_u, j]
        if best_v >= 0:
            owner[best_v] = mx
            load[j] -= total[best_v] - 2 * weights[best_v, j]
            load[mx] += total[best_v] - 2 * weights[best_v, mx]
        else:
            size[mx] -= 1
            size[j] += 1
        steps += 1
    return steps


# ------------------------------------------------------------------------------------------
# Greedy baseline


@njit(cache=True)
def greedy_assign(weights, total, order, cap, owner, load, size):
    """LPT-style greedy: vertices in ``order`` (hottest first) each go to the trainer whose load
    after taking it is smallest (ties: the trainer that needs it most, then the lowest id), among
    trainers below ``cap``. In/out like ``flexbicut_run``; ``load`` starts at A_j.
    """
    n, m = weights.shape
    for p in range(order.shape[0]):
        v = order[p]
        best = -1
        best_load = 0
        for j in range(m):
            if size[j] >= cap:
                continue
            new = load[j] + total[v] - 2 * weights[v, j]
            if best < 0 or new < best_load or (new == best_load and weights[v, j] > weights[v, best]):
                best = j
                best_load = new
        owner[v] = best
        load[best] = best_load
        size[best] += 1
