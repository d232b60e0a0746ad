"""Fused temporal attention on CPU: numba kernels and the autograd Function around them.

A pair (root r, neighbour j) has key/value rows ``kv_h(h_a) + kv_t(phi(dt)) + kv_e(e)`` (node a,
time gap dt, event e). The torch formulation projects every distinct gap and event through
``kv_t`` / ``kv_e`` and gathers per-pair rows ``[num_roots, K, 2 * dim]``. Both projections are
linear without bias, so per head h

    q_h . (W_t,h phi)  = (W_t,h^T q_h) . phi         (score term: one small product per root)
    sum_j p_j W_t,h phi_j = W_t,h (sum_j p_j phi_j)  (value term: one small product per root)

and the kernels work on the raw ``phi`` and edge-feature rows instead: the per-gap product
``[num_gaps, time_dim] x [time_dim, 2 * dim]`` (the largest matmul of a TGN step on CPU, with
about 10,000 distinct gaps per 600 events) is replaced by two ``[num_roots, dim] x [dim, time_dim]``
products. Pair rows are read on the fly and never materialised.

Forward runs in parallel over roots. Backward runs in two passes: per-root gradients in parallel
over roots, then the accumulation into the tables in parallel over ranges of table rows (disjoint,
so no atomics; every element is summed in pair order, so results do not depend on the number of
threads). ``TemporalAttentionLayer`` uses this on CPU and the torch formulation on
GPUs; the tests check that both give the same values and gradients.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

from tgdist.kernels.graph import torch_threads_kept

# Reassociation lets LLVM vectorise the dot products; no NaN/inf assumptions are made. Rows are
# handled as 1-d slices through the small helpers below: indexing 3-d arrays element by element in
# the inner loops kept LLVM from vectorising them (2.7x slower forward).
FASTMATH = {"reassoc", "contract"}


@njit(fastmath=FASTMATH, inline="always")
def _dot(a, b):
    s = np.float32(0.0)
    for c in range(a.shape[0]):
        s += a[c] * b[c]
    return s


@njit(fastmath=FASTMATH, inline="always")
def _axpy(x, a, out):
    """out += x * a"""
    for c in range(a.shape[0]):
        out[c] += x * a[c]


# The time-space rows (phi, ut, gt: time_dim = 100 floats) carry most of the per-pair work; heads
# are taken two at a time over them, so each phi row is read once per pair of heads.


@njit(fastmath=FASTMATH, inline="always")
def _dot2(a0, a1, b):
    """(a0 . b, a1 . b)"""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    for c in range(b.shape[0]):
        s0 += a0[c] * b[c]
        s1 += a1[c] * b[c]
    return s0, s1


@njit(fastmath=FASTMATH, inline="always")
def _axpy_to2(x0, x1, a, out0, out1):
    """out0 += x0 * a; out1 += x1 * a"""
    for c in range(a.shape[0]):
        out0[c] += x0 * a[c]
        out1[c] += x1 * a[c]


@njit(fastmath=FASTMATH, inline="always")
def _dots_per_head(u, r, ph, out):
    """``out[h] = u[h, r] . ph`` for every head, two heads per pass over ``ph``."""
    num_heads = u.shape[0]
    for h in range(0, num_heads - 1, 2):
        out[h], out[h + 1] = _dot2(u[h, r], u[h + 1, r], ph)
    if num_heads % 2:
        out[num_heads - 1] = _dot(u[num_heads - 1, r], ph)


@njit(fastmath=FASTMATH, inline="always")
def _axpys_per_head(x, ph, acc, r):
    """``acc[h, r] += x[h] * ph`` for every head, two heads per pass over ``ph``."""
    num_heads = acc.shape[0]
    for h in range(0, num_heads - 1, 2):
        _axpy_to2(x[h], x[h + 1], ph, acc[h, r], acc[h + 1, r])
    if num_heads % 2:
        _axpy(x[num_heads - 1], ph, acc[num_heads - 1, r])


@njit(fastmath=FASTMATH, inline="always")
def _axpy4(x0, a0, x1, a1, x2, a2, x3, a3, out):
    """out += x0 a0 + x1 a1 + x2 a2 + x3 a3 (one pass over ``out``)"""
    for c in range(out.shape[0]):
        out[c] += x0 * a0[c] + x1 * a1[c] + x2 * a2[c] + x3 * a3[c]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def attention_forward(q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, num_heads, scale, out, aggt, agge, w):
    """Scores ``scale * (q_h . kn_a,h + ut_h . phi_b + ue_h . ef_e)``, softmax over valid pairs.

    ``q [n, D]``; ``kvn [U, 2D]`` node keys (first D columns) and values (last D); ``ut [H, n, Tt]``
    and ``ue [H, n, Te]`` the queries projected into time and edge-feature space; ``phi [T, Tt]``,
    ``ef [E, Te]`` (0 rows without edge features); ``nbr, dti, ei, mask [n, K]``.
    Writes ``out [n, D]`` (node values), ``aggt [H, n, Tt]`` and ``agge [H, n, Te]`` (weighted sums
    of phi and edge rows) and the weights ``w [n, K, H]`` (0 where masked)."""
    n, k = nbr.shape
    d = q.shape[1]
    dh = d // num_heads
    has_edge = ef.shape[0] > 0
    for r in prange(n):
        qr, wr = q[r], w[r]
        best = np.full(num_heads, -np.inf, dtype=np.float32)
        for j in range(k):
            if not mask[r, j]:
                wr[j] = 0.0
                continue
            kv, ph = kvn[nbr[r, j]], phi[dti[r, j]]
            _dots_per_head(ut, r, ph, wr[j])
            for h in range(num_heads):
                s = wr[j, h] + _dot(qr[h * dh:(h + 1) * dh], kv[h * dh:(h + 1) * dh])
                if has_edge:
                    s += _dot(ue[h, r], ef[ei[r, j]])
                s *= scale
                wr[j, h] = s
                best[h] = max(best[h], s)
        total = np.zeros(num_heads, dtype=np.float32)
        for j in range(k):
            if mask[r, j]:
                for h in range(num_heads):
                    x = np.float32(math.exp(wr[j, h] - best[h]))
                    wr[j, h] = x
                    total[h] += x
        out[r] = 0.0
        aggt[:, r] = 0.0
        agge[:, r] = 0.0
        for j in range(k):
            if not mask[r, j]:
                continue
            kv, ph = kvn[nbr[r, j]], phi[dti[r, j]]
            for h in range(num_heads):
                p = wr[j, h] / total[h]
                wr[j, h] = p
                _axpy(p, kv[d + h * dh:d + (h + 1) * dh], out[r, h * dh:(h + 1) * dh])
                if has_edge:
                    _axpy(p, ef[ei[r, j]], agge[h, r])
            _axpys_per_head(wr[j], ph, aggt, r)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def attention_backward_roots(g, gt, ge, q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, w, num_heads, scale,
                             ds, dq, dut, due):
    """Per-root pass: ``ds [n, K, H]`` (score gradients, scale included), ``dq [n, D]``,
    ``dut [H, n, Tt]``, ``due [H, n, Te]`` from the output gradients ``g [n, D]``,
    ``gt [H, n, Tt]``, ``ge [H, n, Te]``. Softmax backward: ds_j = p_j (dp_j - sum_i p_i dp_i)."""
    n, k = nbr.shape
    d = q.shape[1]
    dh = d // num_heads
    has_edge = ef.shape[0] > 0
    for r in prange(n):
        gr, wr, dsr = g[r], w[r], ds[r]
        acc = np.zeros(num_heads, dtype=np.float32)
        for j in range(k):
            if not mask[r, j]:
                dsr[j] = 0.0
                continue
            kv, ph = kvn[nbr[r, j]], phi[dti[r, j]]
            _dots_per_head(gt, r, ph, dsr[j])
            for h in range(num_heads):
                s = dsr[j, h] + _dot(gr[h * dh:(h + 1) * dh], kv[d + h * dh:d + (h + 1) * dh])
                if has_edge:
                    s += _dot(ge[h, r], ef[ei[r, j]])
                dsr[j, h] = s  # dp_j for now
                acc[h] += wr[j, h] * s
        dq[r] = 0.0
        dut[:, r] = 0.0
        due[:, r] = 0.0
        for j in range(k):
            if not mask[r, j]:
                continue
            kv, ph = kvn[nbr[r, j]], phi[dti[r, j]]
            for h in range(num_heads):
                x = wr[j, h] * (dsr[j, h] - acc[h]) * scale
                dsr[j, h] = x
                _axpy(x, kv[h * dh:(h + 1) * dh], dq[r, h * dh:(h + 1) * dh])
                if has_edge:
                    _axpy(x, ef[ei[r, j]], due[h, r])
            _axpys_per_head(dsr[j], ph, dut, r)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def attention_backward_tables(g, gt, ge, q, ut, ue, nbr, dti, ei, mask, w, ds, num_heads, num_jobs,
                              dkvn, dphi, def_):
    """Table pass: write ``dkvn [U, 2D]``, ``dphi [T, Tt]``, ``def_ [E, Te]`` (0 rows for ``def_``
    skips it). Node keys get ``ds_h q_h``, node values ``p_h g_h``, time and
    edge rows ``sum_h ds_h u_h + p_h g_h``.

    Each job owns a range of table rows and walks every pair in order: no two jobs write the same
    row, and every element is summed in pair order whatever the number of jobs or threads."""
    n, k = nbr.shape
    d = q.shape[1]
    dh = d // num_heads
    has_edge = def_.shape[0] > 0
    for job in prange(num_jobs):
        lo_n, hi_n = job * dkvn.shape[0] // num_jobs, (job + 1) * dkvn.shape[0] // num_jobs
        lo_t, hi_t = job * dphi.shape[0] // num_jobs, (job + 1) * dphi.shape[0] // num_jobs
        lo_e, hi_e = job * def_.shape[0] // num_jobs, (job + 1) * def_.shape[0] // num_jobs
        dkvn[lo_n:hi_n] = 0.0  # each job clears its own rows (no serial zeroing pass)
        dphi[lo_t:hi_t] = 0.0
        def_[lo_e:hi_e] = 0.0
        for r in range(n):
            qr, gr, wr, dsr = q[r], g[r], w[r], ds[r]
            for j in range(k):
                if not mask[r, j]:
                    continue
                a, b = nbr[r, j], dti[r, j]
                if lo_n <= a < hi_n:
                    row = dkvn[a]
                    for h in range(num_heads):
                        _axpy(dsr[j, h], qr[h * dh:(h + 1) * dh], row[h * dh:(h + 1) * dh])
                        _axpy(wr[j, h], gr[h * dh:(h + 1) * dh], row[d + h * dh:d + (h + 1) * dh])
                if lo_t <= b < hi_t:
                    row = dphi[b]
                    for h in range(0, num_heads - 1, 2):
                        _axpy4(dsr[j, h], ut[h, r], dsr[j, h + 1], ut[h + 1, r],
                               wr[j, h], gt[h, r], wr[j, h + 1], gt[h + 1, r], row)
                    if num_heads % 2:
                        h = num_heads - 1
                        _axpy(dsr[j, h], ut[h, r], row)
                        _axpy(wr[j, h], gt[h, r], row)
                if has_edge:
                    e = ei[r, j]
                    if lo_e <= e < hi_e:
                        row = def_[e]
                        for h in range(num_heads):
                            _axpy(dsr[j, h], ue[h, r], row)
                            _axpy(wr[j, h], ge[h, r], row)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


class FusedAttention(torch.autograd.Function):
    """``(out [n, D], aggt [H, n, Tt], agge [H, n, Te])``: node values, and phi and edge rows,
    averaged with the attention weights of ``attention_forward``."""

    @staticmethod
    def forward(ctx, q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, num_heads):
        arrays = [_np(t) for t in (q, kvn, ut, phi, ue, ef)]
        idx = [_np(x) for x in (nbr, dti, ei, mask)]
        n, kk = nbr.shape
        out = np.empty_like(arrays[0])
        aggt, agge = np.empty_like(arrays[2]), np.empty_like(arrays[4])
        w = np.empty((n, kk, num_heads), dtype=np.float32)
        scale = np.float32(1.0 / math.sqrt(q.shape[1] // num_heads))
        with torch_threads_kept():
            attention_forward(*arrays, *idx, num_heads, scale, out, aggt, agge, w)
        ctx.save_for_backward(q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, torch.from_numpy(w))
        ctx.num_heads, ctx.scale = num_heads, scale
        return torch.from_numpy(out), torch.from_numpy(aggt), torch.from_numpy(agge)

    @staticmethod
    def backward(ctx, g, gt, ge):
        q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, w = ctx.saved_tensors
        qa, kvna, uta, phia, uea, efa = (_np(t) for t in (q, kvn, ut, phi, ue, ef))
        idx = [_np(x) for x in (nbr, dti, ei, mask)]
        grads = [_np(x) for x in (g, gt, ge)]
        wa = w.numpy()
        ds = np.empty_like(wa)
        dq, dut, due = np.empty_like(qa), np.empty_like(uta), np.empty_like(uea)
        dkvn, dphi = np.empty_like(kvna), np.empty_like(phia)
        edge_grad = ctx.needs_input_grad[5]  # raw edge features usually need none: skip their rows
        def_ = np.empty_like(efa) if edge_grad else np.empty((0, efa.shape[1]), dtype=efa.dtype)
        with torch_threads_kept():
            attention_backward_roots(*grads, qa, kvna, uta, phia, uea, efa, *idx, wa, ctx.num_heads, ctx.scale,
                                     ds, dq, dut, due)
            attention_backward_tables(*grads, qa, uta, uea, *idx, wa, ds, ctx.num_heads, numba.get_num_threads(),
                                      dkvn, dphi, def_)
        grads = [torch.from_numpy(x) for x in (dq, dkvn, dut, dphi, due)]
        return (*grads, torch.from_numpy(def_) if edge_grad else None, None, None, None, None, None)


def fused_attention(q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, num_heads: int):
    return FusedAttention.apply(q, kvn, ut, phi, ue, ef, nbr, dti, ei, mask, num_heads)
