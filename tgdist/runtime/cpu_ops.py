"""CPU versions of three layers of every step: the time encoding, dropout and the GRU cell.

Time encoding ``cos(w dt + b)``: torch computes ``cos`` in one pass and, in backward, ``sin`` in
another, and its vectorised ``cos`` falls back to a slow path for large arguments (gaps of days in
seconds, times w = 1). Here one pass computes both (``sin`` is kept for backward) with the argument
reduced in float64 and short polynomials on [-pi/4, pi/4]; results agree with torch to float32
rounding. Dropout: torch draws a Bernoulli per element through a Mersenne twister; here a
counter-based hash of (seed, position) is used, with the seed drawn from torch's generator, so runs
stay reproducible and checkpoints (which hold torch's RNG state) resume identically. GRU cell: the
same torch ops as ``nn.GRUCell`` with a hand-written backward (see ``GRUCell``).

The modules in models.py use these on CPU and the plain torch ops on GPUs; tests compare both.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from tgdist.runtime.kernels import torch_threads_kept

_TWO_OVER_PI = 2.0 / math.pi
_PI_OVER_2_HI = 1.5707963267341256  # pi/2 in two parts: k * hi is exact for |k| < 2**27
_PI_OVER_2_LO = 6.077100506506192e-11
# Taylor coefficients of sin and cos as float32 constants (numba would otherwise widen to float64)
_ONE = np.float32(1.0)
_S3, _S5, _S7, _S9 = (np.float32(x) for x in (-1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880))
_C2, _C4, _C6, _C8, _C10 = (np.float32(x) for x in (-0.5, 1.0 / 24, -1.0 / 720, 1.0 / 40320, -1.0 / 3628800))
_MIN_PARALLEL = 1 << 15  # elements; below this a parallel launch costs more than it saves
_BACKWARD_BLOCKS = 8


@njit(cache=True, fastmath={"contract"})
def _time_encode_rows(dt, w, b, cos_out, sin_out, lo, hi):
    """cos and sin of ``x = w dt + b`` for rows ``lo:hi``. ``x`` is rounded to float32 once, as
    torch's fused ``addcmul`` does, then reduced by k pi/2 in float64 (exact for |x| < 2**27 and
    accurate far beyond), and the quadrant's sin/cos taken from Taylor polynomials on
    [-pi/4, pi/4] (truncation below 2e-9) evaluated in float32: twice the SIMD lanes of float64
    (2.1x faster), within 7e-8 of the exact values (torch's own cos: 4e-8). Written branch-free so
    LLVM vectorises the loop."""
    for i in range(lo, hi):
        t = np.float64(dt[i])
        for c in range(w.shape[0]):
            x = np.float64(np.float32(t * np.float64(w[c]) + np.float64(b[c])))
            k = np.floor(x * _TWO_OVER_PI + 0.5)
            r = np.float32((x - k * _PI_OVER_2_HI) - k * _PI_OVER_2_LO)
            r2 = r * r
            s = r + r * r2 * (_S3 + r2 * (_S5 + r2 * (_S7 + r2 * _S9)))
            co = _ONE + r2 * (_C2 + r2 * (_C4 + r2 * (_C6 + r2 * (_C8 + r2 * _C10))))
            q = np.int64(k)
            odd = (q & 1) != 0
            sv = co if odd else s  # quadrant q: sin = s, c, -s, -c ; cos = c, -s, -c, s
            cv = s if odd else co
            if (q & 2) != 0:
                sv = -sv
            if ((q + 1) & 2) != 0:
                cv = -cv
            cos_out[i, c] = cv
            sin_out[i, c] = sv


@njit(parallel=True, cache=True)
def _time_encode_parallel(dt, w, b, cos_out, sin_out, chunk):
    n = dt.shape[0]
    for p in prange((n + chunk - 1) // chunk):
        _time_encode_rows(dt, w, b, cos_out, sin_out, p * chunk, min(n, (p + 1) * chunk))


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _time_encode_backward(g, sin, dt, parts):
    """Partial sums of d/dw and d/db of sum(g * cos(w dt + b)), i.e. -sum_i g sin dt_i and
    -sum_i g sin, over fixed row blocks: ``parts [num_blocks, 2, dim]``. The caller adds the
    blocks in order, so the result does not depend on the number of threads."""
    n, dim = g.shape
    nb = parts.shape[0]
    for p in prange(nb):
        dw, db = parts[p, 0], parts[p, 1]
        dw[:] = 0.0
        db[:] = 0.0
        for i in range(p * n // nb, (p + 1) * n // nb):
            t = np.float32(dt[i])
            for c in range(dim):
                x = -g[i, c] * sin[i, c]
                db[c] += x
                dw[c] += x * t


class TimeEncoding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, w, b):
        d = dt.detach().reshape(-1).contiguous().numpy()
        wn, bn = w.detach().contiguous().numpy(), b.detach().contiguous().numpy()
        cos = np.empty((d.shape[0], wn.shape[0]), dtype=np.float32)
        sin = np.empty_like(cos)
        if cos.size >= _MIN_PARALLEL:
            with torch_threads_kept():
                _time_encode_parallel(d, wn, bn, cos, sin, 256)
        else:
            _time_encode_rows(d, wn, bn, cos, sin, 0, d.shape[0])
        ctx.save_for_backward(dt, torch.from_numpy(sin))
        ctx.shape = (*dt.shape, wn.shape[0])
        return torch.from_numpy(cos).view(ctx.shape)

    @staticmethod
    def backward(ctx, g):
        dt, sin = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            raise NotImplementedError("time gaps are data: no gradient flows into them")
        gn = g.reshape(sin.shape).contiguous().numpy()
        parts = np.empty((_BACKWARD_BLOCKS, 2, sin.shape[1]), dtype=np.float32)
        with torch_threads_kept():
            _time_encode_backward(gn, sin.numpy(), dt.detach().reshape(-1).contiguous().numpy(), parts)
        dw, db = torch.from_numpy(parts).sum(0)  # sequential over blocks
        return None, dw, db


def time_encode(dt: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cos(w * dt[..., None] + b)`` for float32 CPU tensors."""
    return TimeEncoding.apply(dt, w, b)


# ----------------------------------------------------------------------------------------------
# Dropout


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(parallel=True, cache=True)
def _dropout(x, seed, threshold, scale, out, chunk):
    """``out[i] = x[i] * scale`` where the splitmix64 hash of ``seed + i * golden`` keeps element
    i (its top 24 bits >= ``threshold``), else 0. Each chunk works on slices with a branch-free
    body, which LLVM vectorises (indexing the whole arrays inside ``prange`` kept it scalar, 3.6x
    slower)."""
    n = x.shape[0]
    s, th = np.uint64(seed), np.uint64(threshold)
    for p in prange((n + chunk - 1) // chunk):
        lo = p * chunk
        m = min(n, lo + chunk) - lo
        xs, os = x[lo:lo + m], out[lo:lo + m]
        base = s + np.uint64(lo) * _GOLDEN
        for c in range(m):
            z = base + np.uint64(c) * _GOLDEN
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            os[c] = xs[c] * (scale * np.float32((z >> np.uint64(40)) >= th))


class Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        seed = int(torch.randint(0, 2**62, (1,)))
        threshold = round(p * (1 << 24))
        scale = np.float32(1.0 / (1.0 - p))
        ctx.params = (seed, threshold, scale)
        return _apply(x, *ctx.params)

    @staticmethod
    def backward(ctx, g):
        return _apply(g, *ctx.params), None


def _apply(x: torch.Tensor, seed: int, threshold: int, scale) -> torch.Tensor:
    xn = x.detach().contiguous().numpy()
    out = np.empty_like(xn)
    with torch_threads_kept():
        _dropout(xn.reshape(-1), seed, threshold, scale, out.reshape(-1), 1 << 14)
    return torch.from_numpy(out)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout with a counter-based mask (float32 CPU tensors)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    return Dropout.apply(x, float(p))


# ----------------------------------------------------------------------------------------------
# GRU cell


class GRUCell(torch.autograd.Function):
    """``torch.nn.GRUCell`` on ``[mail || phi]`` with a hand-written backward: one buffer per
    gradient instead of autograd's chunk/slice/cat graph (whose slice backward zero-fills a full
    ``[n, 4 d]`` tensor per slice), and gradients for ``phi`` and the parameters only.

    ``own=True``: ``mail`` lacks its first ``d`` columns, which equal ``h`` (TGN's mails, see
    models._CellUpdater); the input and hidden maps of ``h`` are merged where the GRU adds them,
    the r and z gates, and their weight gradients, which are equal, are computed once."""

    @staticmethod
    def forward(ctx, mail, phi, h, w_ih, w_hh, b_ih, b_hh, own):
        d, mf = h.shape[1], w_ih.shape[1] - phi.shape[1]
        skip = d if own else 0
        gx = torch.addmm(b_ih, mail, w_ih[:, skip:mf].t()).addmm_(phi, w_ih[:, mf:].t())  # [n, 3d]
        if own:  # h's columns: [r, z] of both maps summed, the input map's n, the hidden map's n
            w_own = w_ih[:, :d]
            w = torch.cat([w_own[:2 * d] + w_hh[:2 * d], w_own[2 * d:], w_hh[2 * d:]])
            gh = torch.addmm(torch.cat([b_hh[:2 * d], b_hh.new_zeros(d), b_hh[2 * d:]]), h, w.t())
            gx += gh[:, :3 * d]
            nh = gh[:, 3 * d:]
        else:
            gh = torch.addmm(b_hh, h, w_hh.t())
            gx[:, :2 * d] += gh[:, :2 * d]
            nh = gh[:, 2 * d:]
        rz = torch.sigmoid(gx[:, :2 * d])
        n = torch.tanh(torch.addcmul(gx[:, 2 * d:], rz[:, :d], nh))
        ctx.save_for_backward(mail, phi, h, w_ih, rz, n, nh)
        ctx.own = own
        return torch.addcmul(n, rz[:, d:], h - n)  # (1 - z) n + z h

    @staticmethod
    def backward(ctx, g):
        mail, phi, h, w_ih, rz, n, nh = ctx.saved_tensors
        d, mf = h.shape[1], w_ih.shape[1] - phi.shape[1]
        r, z = rz[:, :d], rz[:, d:]
        grads = torch.empty(h.shape[0], 4 * d, dtype=g.dtype)  # pre-activation: [r | z | n_in | n_hidden]
        dpr, dpz, dpn, dnh = grads.split(d, dim=1)
        torch.mul(g * (1 - z), 1 - n * n, out=dpn)
        torch.mul(g * (h - n), z * (1 - z), out=dpz)
        torch.mul(dpn * nh, r * (1 - r), out=dpr)
        torch.mul(dpn, r, out=dnh)
        dgx = grads[:, :3 * d]
        by_h = grads.t().mm(h)  # [4d, d]: rows r, z (both maps), n of the input map, n of the hidden map
        d_ih = [dgx.t().mm(mail), dgx.t().mm(phi)]
        if ctx.own:
            d_ih.insert(0, by_h[:3 * d])
        d_hh = torch.cat([by_h[:2 * d], by_h[3 * d:]])
        sums = grads.sum(0)
        d_bih, d_bhh = sums[:3 * d], torch.cat([sums[:2 * d], sums[3 * d:]])
        d_phi = dgx.mm(w_ih[:, mf:]) if ctx.needs_input_grad[1] else None
        return None, d_phi, None, torch.cat(d_ih, 1), d_hh, d_bih, d_bhh, None


def gru_cell(mail: torch.Tensor, phi: torch.Tensor, h: torch.Tensor, cell: torch.nn.GRUCell, own: bool) -> torch.Tensor:
    """``cell([mail || phi], h)`` for float32 CPU tensors with no gradient into ``mail`` or ``h``
    (``own``: ``mail`` without its first ``d`` columns, which are ``h``)."""
    return GRUCell.apply(mail, phi, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh, own)
