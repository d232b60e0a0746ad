"""Slow, obvious NumPy / Python twins of ``tgdist/partition/kernels.py``; the tests compare them.

Each takes the same inputs as its kernel but returns fresh outputs instead of writing in place.
"""

from __future__ import annotations

import numpy as np


def access_counts(rows, group, trainer, num_nodes, num_parts):
    """``(raw, dedup, records)`` of one chunk: records are ``(vertex, group)`` first sightings in order."""
    raw = np.zeros((num_nodes, num_parts), dtype=np.int64)
    dedup = np.zeros((num_nodes, num_parts), dtype=np.int64)
    records = []
    seen = set()
    for e in range(rows.shape[0]):
        for v in rows[e]:
            if v < 0:
                continue
            raw[v, trainer[e]] += 1
            if (int(v), int(group[e])) not in seen:
                seen.add((int(v), int(group[e])))
                dedup[v, trainer[e]] += 1
                records.append((int(v), int(group[e])))
    return raw, dedup, records


def owner_matrix(weights, owner, num_parts):
    out = np.zeros((num_parts, num_parts), dtype=np.int64)
    for j in range(num_parts):
        out[:, j] = weights[owner == j].sum(axis=0)
    return out


def batch_costs(groups, owner, num_parts, num_batches):
    """``groups[b][t]``: the vertex ids trainer t needs in batch b (duplicates allowed)."""
    cost, link, volume = [], [], []
    for b in range(num_batches):
        comm = np.zeros((num_parts, num_parts), dtype=np.int64)
        for t in range(num_parts):
            for v in np.unique(np.asarray(groups[b][t], dtype=np.int64)):
                if owner[v] != t:
                    comm[t, owner[v]] += 1
        cost.append(int((comm.sum(0) + comm.sum(1)).max()))
        link.append(int(comm.max()))
        volume.append(int(comm.sum()))
    return np.array(cost), np.array(link), np.array(volume)


def _reassign(i, w, total, order, cap, owner, load, size):
    moves = 0
    for v in order[i]:
        if size[i] >= cap:
            break
        j = owner[v]
        if j < 0 or j == i:
            continue
        new_i = load[i] + total[v] - 2 * w[v, i]
        new_j = load[j] - (total[v] - 2 * w[v, j])
        if max(new_i, new_j) < max(load[i], load[j]):
            owner[v], load[i], load[j] = i, new_i, new_j
            size[i] += 1
            size[j] -= 1
            moves += 1
    return moves


def flexbicut_run(w, total, order, seq, cap, budget, max_rounds, owner, load, size):
    """Same contract as the kernel, on copies: returns ``(owner, load, size, unlabeled, rounds)``."""
    owner, load, size = owner.copy(), load.copy(), size.copy()
    n, m = w.shape
    rounds = 0
    while (owner < 0).any() and rounds < max_rounds:
        changed = 0
        for q in range(m):
            i = seq[(q + rounds) % m]
            for v in order[i]:
                if size[i] >= cap:
                    break
                if owner[v] >= 0:
                    continue
                c = total[v] - 2 * w[v, i]
                if c > 0 and load[i] + c > budget:
                    continue
                owner[v] = i
                load[i] += c
                size[i] += 1
                changed += 1
            changed += _reassign(i, w, total, order, cap, owner, load, size)
        rounds += 1
        if changed == 0:
            break
    return owner, load, size, int((owner < 0).sum()), rounds


def relocate(w, total, cap, max_passes, owner, load, size):
    owner, load, size = owner.copy(), load.copy(), size.copy()
    n, m = w.shape
    c = total[:, None] - 2 * w
    moves = passes = 0
    while passes < max_passes:
        moved = 0
        for v in range(n):
            j = owner[v]
            new = [max(load[i] + c[v, i], load[j] - c[v, j]) for i in range(m)]
            options = [(new[i], i) for i in range(m)
                       if i != j and size[i] < cap and new[i] < max(load[i], load[j])]
            if options:
                _, i = min(options)
                owner[v] = i
                load[i] += c[v, i]
                load[j] -= c[v, j]
                size[i] += 1
                size[j] -= 1
                moved += 1
        moves += moved
        passes += 1
        if moved == 0:
            break
    return owner, load, size, moves, passes


def swap_descent(w, total, cap, k, max_steps, owner, load, size):
    """Same rule as the kernel; candidate lists by a stable sort (ties: lower vertex id first)."""
    owner, load, size = owner.copy(), load.copy(), size.copy()
    n, m = w.shape
    c = total[:, None] - 2 * w  # c[v, j]: change of load_j when v joins j
    steps = 0
    while steps < max_steps:
        mx = int(np.argmax(load))
        mine = np.flatnonzero(owner == mx)
        us = mine[np.argsort(-c[mine, mx], kind="stable")][:k]
        best, move = load[mx], None
        for j in range(m):
            if j == mx:
                continue
            theirs = np.flatnonzero(owner == j)
            vs = theirs[np.argsort(c[theirs, mx], kind="stable")][:k]
            for u in us:
                if size[j] < cap:
                    val = max(load[mx] - c[u, mx], load[j] + c[u, j])
                    if val < best:
                        best, move = val, (u, -1, j)
                for v in vs:
                    val = max(load[mx] - c[u, mx] + c[v, mx], load[j] + c[u, j] - c[v, j])
                    if val < best:
                        best, move = val, (u, v, j)
        if move is None:
            break
        u, v, j = move
        owner[u] = j
        load[mx] -= c[u, mx]
        load[j] += c[u, j]
        if v >= 0:
            owner[v] = mx
            load[j] -= c[v, j]
            load[mx] += c[v, mx]
        else:
            size[mx] -= 1
            size[j] += 1
        steps += 1
    return owner, load, size, steps


def greedy_assign(w, total, order, cap):
    n, m = w.shape
    owner = np.full(n, -1, dtype=np.int64)
    load = w.sum(axis=0)
    size = np.zeros(m, dtype=np.int64)
    for v in order:
        options = [(load[j] + total[v] - 2 * w[v, j], -w[v, j], j) for j in range(m) if size[j] < cap]
        new, _, j = min(options)
        owner[v], load[j] = j, new
        size[j] += 1
    return owner, load, size
