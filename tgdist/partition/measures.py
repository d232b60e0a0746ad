"""Communication measures of a vertex -> trainer assignment (Sven 3.1.2, eqs. (2) and (5)).

Reading of the balance cost. Eq. (5) of the paper, as printed, sums ``w(t_j, v)`` over the vertices
*inside* W_j, i.e. trainer j's local accesses; minimising the largest of those would push every
vertex away from the trainers that use it, which contradicts the paper's own goal and its proofs.
Theorems 1 and 2 (NP-hard for M >= 4, O(log^2 N) by binary search on a load bound B and
bisection cuts around each terminal) are those of min-max multiway cut, where the cost of part
W_j is the weight of the edges that *cross its boundary*. We take that reading:

    zeta(W_j) = sum_{v not in V'_j} w(t_j, v)  +  sum_{v in V'_j} sum_{i != j} w(t_i, v)
              = recv_j (row j of C: what j fetches) + send_j (column j of C: what j serves),
    zeta(W)   = max_j zeta(W_j).

zeta(W_j) is the traffic through trainer j's link in the dispatch all-to-all; the all-to-all ends
when the busiest link is done, so it is the quantity to minimise for "the slowest link". The
largest single pair ``max_ij C[i, j]`` (``max_link``) and ``max(send)`` / ``max(recv)`` are
reported too. All costs are in units of one node memory (Sven normalises C the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tgdist.errors import ConfigError
from tgdist.partition import kernels
from tgdist.partition.access import AccessGraph, WEIGHTS


def check_assignment(owner: np.ndarray, num_nodes: int, num_parts: int) -> np.ndarray:
    """``owner`` as contiguous int64 ``[num_nodes]`` with values in ``[0, num_parts)``, or ConfigError."""
    o = np.ascontiguousarray(owner, dtype=np.int64)
    if o.shape != (num_nodes,):
        raise ConfigError(f"assignment has shape {o.shape}, expected ({num_nodes},)")
    if num_nodes and (o.min() < 0 or o.max() >= num_parts):
        raise ConfigError(f"assignment values must lie in [0, {num_parts}), found {o.min()}..{o.max()}")
    return o


def comm_matrix(weights: np.ndarray, owner: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(C, local)``: C int64 ``[M, M]``, ``C[i, j] = sum_{v: owner(v) = j} w(t_i, v)`` for i != j
    and 0 on the diagonal; ``local`` int64 ``[M]``: the accesses each trainer serves itself."""
    w = np.ascontiguousarray(weights, dtype=np.int64)
    full = kernels.owner_matrix(w, check_assignment(owner, w.shape[0], num_parts), num_parts)
    local = np.diag(full).copy()
    np.fill_diagonal(full, 0)
    return full, local


def loads(comm: np.ndarray) -> np.ndarray:
    """zeta(W_j) for every j: int64 ``[M]`` = row sum (fetched by j) + column sum (served by j)."""
    return comm.sum(axis=1) + comm.sum(axis=0)


def balance_cost(weights: np.ndarray, owner: np.ndarray, num_parts: int) -> int:
    """Sven eq. (5) in our reading: ``max_j [sum_{v not on j} w(t_j, v) + sum_{v on j, i != j} w(t_i, v)]``."""
    comm, _ = comm_matrix(weights, owner, num_parts)
    return int(loads(comm).max())


def residual(comm: np.ndarray) -> np.ndarray:
    """Sven eq. (2), ``R = J * C_max - C`` over the links i != j; the diagonal (no link) is 0."""
    r = comm.max() - comm
    np.fill_diagonal(r, 0)
    return r


def lower_bound(weights: np.ndarray, num_parts: int, cap: int | None = None) -> int:
    """A lower bound on the balance cost of any assignment (with at most ``cap`` vertices a trainer).

    (a) every remote access is counted twice (once in the fetcher's load, once in the owner's) and
    at best v lives on the trainer that needs it most: ``2 sum_v (s_v - max_t w(t, v)) / M``;
    (b) trainer j's load is at least A_j plus the ``cap`` most negative per-vertex changes
    ``s_v - 2 w(t_j, v)`` (the vertices it could take to itself).
    """
    w = np.asarray(weights, dtype=np.int64)
    n, m = w.shape
    total = w.sum(axis=1)
    bound = -(-2 * int((total - w.max(axis=1, initial=0)).sum()) // m)
    cap = n if cap is None else int(cap)
    for j in range(m):
        c = total - 2 * w[:, j]
        neg = np.sort(c[c < 0])[:cap]
        bound = max(bound, int(w[:, j].sum() + neg.sum()))
    return bound


@dataclass
class Measures:
    """Communication of one assignment under one kind of weights (``raw`` or ``dedup``).

    ``comm`` int64 ``[M, M]`` (C, diagonal 0); ``residual`` ``[M, M]`` (eq. (2));
    ``local``, ``send``, ``recv``, ``load`` int64 ``[M]`` (load = send + recv = zeta(W_j)).
    """

    weights: str
    comm: np.ndarray
    residual: np.ndarray
    local: np.ndarray
    send: np.ndarray
    recv: np.ndarray
    load: np.ndarray

    @property
    def balance_cost(self) -> int:
        return int(self.load.max())

    @property
    def max_link(self) -> int:
        return int(self.comm.max())

    @property
    def total_volume(self) -> int:
        return int(self.comm.sum())

    @property
    def local_fraction(self) -> float:
        total = int(self.local.sum()) + self.total_volume
        return float(self.local.sum() / total) if total else 0.0

    def to_json(self) -> dict:
        return {"weights": self.weights, "balance_cost": self.balance_cost, "max_link": self.max_link,
                "total_volume": self.total_volume, "max_send": int(self.send.max()), "max_recv": int(self.recv.max()),
                "mean_load": float(self.load.mean()), "local_fraction": round(self.local_fraction, 6),
                "load": self.load.tolist(), "send": self.send.tolist(), "recv": self.recv.tolist(),
                "local": self.local.tolist(), "comm": self.comm.tolist(), "residual": self.residual.tolist()}


def measure(weights: np.ndarray, owner: np.ndarray, num_parts: int, kind: str = "dedup") -> Measures:
    comm, local = comm_matrix(weights, owner, num_parts)
    return Measures(weights=kind, comm=comm, residual=residual(comm), local=local, send=comm.sum(axis=0),
                    recv=comm.sum(axis=1), load=loads(comm))


def batch_costs(access: AccessGraph, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per global batch, deduplicated: int64 ``(balance cost, max link, volume)``, each ``[num_batches]``.

    Each iteration runs its own all-to-all, so the per-batch balance cost is what an iteration
    waits for; Sven's Fig. 13 shows its distribution as box plots. Needs an access graph built with
    ``per_batch=True``.
    """
    if access.batch_ptr is None:
        raise ConfigError("per-batch measures need an access graph built with per_batch=True")
    owner = check_assignment(owner, access.num_nodes, access.num_parts)
    return kernels.batch_costs(access.batch_ptr, access.batch_ids, owner, access.num_parts, access.num_batches)


def summary(x: np.ndarray) -> dict:
    """Box-plot statistics of a per-batch series (Sven Fig. 13 shows the upper quartile)."""
    if x.size == 0:
        return {"mean": 0.0, "p25": 0.0, "median": 0.0, "p75": 0.0, "max": 0, "sum": 0}
    q = np.percentile(x, [25, 50, 75])
    return {"mean": round(float(x.mean()), 3), "p25": float(q[0]), "median": float(q[1]), "p75": float(q[2]),
            "max": int(x.max()), "sum": int(x.sum())}


def evaluate(access: AccessGraph, owner: np.ndarray) -> dict:
    """Measures under both kinds of weights plus the partition sizes, ready for JSON.

    ``{"sizes": [M], "dedup": {...}, "raw": {...}, "per_batch": {...}}``: dedup = after
    redundancy-free deduplication (a trainer fetches a remote node once per batch), raw = every
    sampled occurrence, per_batch = statistics of the per-batch deduplicated all-to-all (when the
    access graph kept its batches).
    """
    m = access.num_parts
    owner = check_assignment(owner, access.num_nodes, m)
    out = {"sizes": np.bincount(owner, minlength=m).tolist()}
    for kind in WEIGHTS:
        out[kind] = measure(access.weights(kind), owner, m, kind).to_json()
    if access.batch_ptr is not None:
        cost, link, volume = batch_costs(access, owner)
        out["per_batch"] = {"num_batches": int(cost.size), "balance_cost": summary(cost), "max_link": summary(link),
                            "volume": summary(volume)}
    return out
