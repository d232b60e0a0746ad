"""Fused temporal attention on CPU: numba kernels and the autograd Function around them.

The torch formulation gathers per-pair key/value rows ``[num_roots, K, 2 * dim]`` from three
tables (per node, per distinct time gap, per distinct event), adds them, and scatters their
gradients back. Here each pair's rows are read on the fly and never materialised; the backward
pass accumulates straight into the tables. Forward runs in parallel over roots; backward in
parallel over heads, whose table columns are disjoint, so the accumulation needs no atomics.
``TemporalAttentionLayer`` uses this on CPU and the torch formulation on GPUs; the tests check
that both give the same values and gradients.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from tgdist.runtime.kernels import torch_threads_kept


@njit(parallel=True, cache=True, fastmath=False)
def attention_forward(q, kvn, kvt, kve, nbr, dti, ei, mask, num_heads, scale, out, w):
    """``q [n, D]``; tables ``kvn [U, 2D]``, ``kvt [T, 2D]``, ``kve [E, 2D]`` (keys in the first D
    columns, values in the last D); ``nbr, dti, ei, mask [n, K]``; writes ``out [n, D]`` and the
    attention weights ``w [n, K, H]`` (0 where masked). ``kve`` has 0 rows when there are no edge
    features."""
    n, k = nbr.shape
    d = q.shape[1]
    dh = d // num_heads
    has_edge = kve.shape[0] > 0
    for r in prange(n):
        for h in range(num_heads):
            c0 = h * dh
            best = -np.inf
            for j in range(k):
                if not mask[r, j]:
                    w[r, j, h] = 0.0
                    continue
                a, b, e = nbr[r, j], dti[r, j], ei[r, j]
                s = 0.0
                for c in range(c0, c0 + dh):
                    kv = kvn[a, c] + kvt[b, c]
                    if has_edge:
                        kv += kve[e, c]
                    s += q[r, c] * kv
                s *= scale
                w[r, j, h] = s
                if s > best:
                    best = s
            total = 0.0
            for j in range(k):
                if mask[r, j]:
                    x = math.exp(w[r, j, h] - best)
                    w[r, j, h] = x
                    total += x
            for c in range(c0, c0 + dh):
                out[r, c] = 0.0
            if total > 0.0:
                for j in range(k):
                    if not mask[r, j]:
                        continue
                    p = w[r, j, h] / total
                    w[r, j, h] = p
                    a, b, e = nbr[r, j], dti[r, j], ei[r, j]
                    for c in range(c0, c0 + dh):
                        v = kvn[a, d + c] + kvt[b, d + c]
                        if has_edge:
                            v += kve[e, d + c]
                        out[r, c] += p * v


@njit(parallel=True, cache=True, fastmath=False)
def attention_backward(g, q, kvn, kvt, kve, nbr, dti, ei, mask, w, num_heads, scale, dq, dkvn, dkvt, dkve):
    """Gradients of ``attention_forward`` given ``g = dL/dout [n, D]``; ``dq`` is written,
    ``dkvn, dkvt, dkve`` (zero-initialised, table shapes) are accumulated into."""
    n, k = nbr.shape
    d = q.shape[1]
    dh = d // num_heads
    has_edge = kve.shape[0] > 0
    for h in prange(num_heads):
        c0 = h * dh
        dw = np.empty(k, dtype=np.float32)
        for r in range(n):
            for c in range(c0, c0 + dh):
                dq[r, c] = 0.0
            # dL/dw_j = g . v_j ; softmax backward: ds_j = w_j (dw_j - sum_i w_i dw_i)
            acc = 0.0
            for j in range(k):
                dw[j] = 0.0
                if not mask[r, j]:
                    continue
                a, b, e = nbr[r, j], dti[r, j], ei[r, j]
                s = 0.0
                for c in range(c0, c0 + dh):
                    v = kvn[a, d + c] + kvt[b, d + c]
                    if has_edge:
                        v += kve[e, d + c]
                    s += g[r, c] * v
                dw[j] = s
                acc += w[r, j, h] * s
            for j in range(k):
                if not mask[r, j]:
                    continue
                p = w[r, j, h]
                ds = p * (dw[j] - acc) * scale
                a, b, e = nbr[r, j], dti[r, j], ei[r, j]
                for c in range(c0, c0 + dh):
                    kk = kvn[a, c] + kvt[b, c]
                    if has_edge:
                        kk += kve[e, c]
                    dq[r, c] += ds * kk
                    gk = ds * q[r, c]
                    gv = p * g[r, c]
                    dkvn[a, c] += gk
                    dkvt[b, c] += gk
                    dkvn[a, d + c] += gv
                    dkvt[b, d + c] += gv
                    if has_edge:
                        dkve[e, c] += gk
                        dkve[e, d + c] += gv


class FusedAttention(torch.autograd.Function):
    """out [n, D] = multi-head attention of ``q`` over pairs whose key/value rows are
    ``kvn[nbr] + kvt[dti] (+ kve[ei])`` (see ``attention_forward``)."""

    @staticmethod
    def forward(ctx, q, kvn, kvt, kve, nbr, dti, ei, mask, num_heads):
        qn = q.detach().contiguous().numpy()
        tabs = [t.detach().contiguous().numpy() for t in (kvn, kvt, kve)]
        idx = [x.contiguous().numpy() for x in (nbr, dti, ei, mask)]
        n, kk = nbr.shape
        out = np.empty_like(qn)
        w = np.empty((n, kk, num_heads), dtype=np.float32)
        scale = np.float32(1.0 / math.sqrt(q.shape[1] // num_heads))
        with torch_threads_kept():
            attention_forward(qn, *tabs, *idx, num_heads, scale, out, w)
        ctx.save_for_backward(q, kvn, kvt, kve, nbr, dti, ei, mask, torch.from_numpy(w))
        ctx.num_heads, ctx.scale = num_heads, scale
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, g):
        q, kvn, kvt, kve, nbr, dti, ei, mask, w = ctx.saved_tensors
        arrays = [t.detach().contiguous().numpy() for t in (q, kvn, kvt, kve)]
        dq = np.empty_like(arrays[0])
        dtabs = [np.zeros_like(a) for a in arrays[1:]]
        with torch_threads_kept():
            attention_backward(g.contiguous().numpy(), *arrays, nbr.numpy(), dti.numpy(), ei.numpy(),
                               mask.numpy(), w.numpy(), ctx.num_heads, ctx.scale, dq, *dtabs)
        return (torch.from_numpy(dq), *(torch.from_numpy(t) for t in dtabs), None, None, None, None, None)


def fused_attention(q, kvn, kvt, kve, nbr, dti, ei, mask, num_heads: int) -> torch.Tensor:
    return FusedAttention.apply(q, kvn, kvt, kve, nbr, dti, ei, mask, num_heads)
