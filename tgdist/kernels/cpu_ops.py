"""CPU versions of parts of every step: the time encoding, dropout (alone, and with the ReLU and
LayerNorm around it in the attention layer's output), the GRU cell and a per-head row gather.

Time encoding ``cos(w dt + b)``: torch computes ``cos`` in one pass and, in backward, ``sin`` in
another, and its vectorised ``cos`` falls back to a slow path for large arguments (gaps of days in
seconds, times w = 1). Here one pass computes both (``sin`` is kept for backward) with the argument
reduced in float64 and short polynomials on [-pi/4, pi/4]; results agree with torch to float32
rounding. Dropout: torch draws a Bernoulli per element through a Mersenne twister; here a
counter-based hash of (seed, position) is used, with the seed drawn from torch's generator, so runs
stay reproducible and checkpoints (which hold torch's RNG state) resume identically. GRU cell:
``nn.GRUCell``'s products in torch, its gates (sigmoid, tanh and the blend) and their backward in
one numba pass each, with a hand-written backward (see ``GRUCell``).

The modules in models.py use these on CPU and the plain torch ops on GPUs; tests compare both.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from tgdist.kernels.graph import torch_threads_kept

_TWO_OVER_PI = 2.0 / math.pi
_PI_OVER_2_HI = 1.5707963267341256  # pi/2 in two parts: k * hi is exact for |k| < 2**27
_PI_OVER_2_LO = 6.077100506506192e-11
# Beyond this |x|, k * hi is no longer exact, and the reduction below is accurate only where the
# CPU fuses the multiply-add (numba built for a generic CPU, or one without FMA, was 0.05 off at
# x ~ 1e15): such phases take libm's reduction instead (rare: gaps of decades in milliseconds).
_EXACT_PHASE = 2.0 ** 26
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
    LLVM vectorises the loop; phases beyond ``_EXACT_PHASE`` are then taken again, one by one,
    with libm's float64 cos and sin, so the result does not depend on the CPU's FMA."""
    w_max = b_max = 0.0  # a bound on |x| per row: only rows that may pass _EXACT_PHASE take the second loop
    for c in range(w.shape[0]):
        w_max = max(w_max, abs(np.float64(w[c])))
        b_max = max(b_max, abs(np.float64(b[c])))
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
        if abs(t) * w_max + b_max < 0.5 * _EXACT_PHASE:  # (margin for the rounding of the bound)
            continue
        for c in range(w.shape[0]):
            x = np.float64(np.float32(t * np.float64(w[c]) + np.float64(b[c])))
            if abs(x) >= _EXACT_PHASE:
                cos_out[i, c] = np.float32(np.cos(x))
                sin_out[i, c] = np.float32(np.sin(x))


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


@njit(inline="always")
def _mask(z, threshold, scale):
    """``scale`` if the splitmix64 hash of ``z`` keeps the element (its top 24 bits >=
    ``threshold``), else 0."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return scale * np.float32((z >> np.uint64(40)) >= threshold)


def _dropout_params(p: float, training: bool) -> tuple[int, int, np.float32]:
    """(seed, threshold, scale) of a dropout call; a seed is drawn from torch's generator only
    when elements are dropped at random (0 < p < 1 in training), as ``dropout`` does."""
    if not training or p == 0.0:
        return 0, 0, np.float32(1.0)
    if p >= 1.0:
        return 0, 1 << 24, np.float32(0.0)
    return int(torch.randint(0, 2**62, (1,))), round(p * (1 << 24)), np.float32(1.0 / (1.0 - p))


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
            os[c] = xs[c] * _mask(base + np.uint64(c) * _GOLDEN, th, scale)


class Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        ctx.params = _dropout_params(p, True)
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
# ReLU, dropout and LayerNorm in one pass (the attention layer's output)


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def _relu_dropout_norm(a, seed, threshold, scale, w, b, eps, x, mean, rstd, y, chunk):
    """``x = dropout(relu(a))``, with ``_dropout``'s mask of the flattened ``a``, and
    ``y = (x - mean) rstd w + b`` per row (biased variance, as ``nn.LayerNorm``)."""
    n, d = a.shape
    s, th = np.uint64(seed), np.uint64(threshold)
    zero = np.float32(0.0)
    for p in prange((n + chunk - 1) // chunk):
        for i in range(p * chunk, min(n, (p + 1) * chunk)):
            ai, xi, yi = a[i], x[i], y[i]
            base = s + np.uint64(i * d) * _GOLDEN
            total = zero
            for c in range(d):
                v = max(ai[c], zero) * _mask(base + np.uint64(c) * _GOLDEN, th, scale)
                xi[c] = v
                total += v
            mu = total / np.float32(d)
            sq = zero
            for c in range(d):
                t = xi[c] - mu
                sq += t * t
            r = _ONE / np.sqrt(sq / np.float32(d) + eps)
            mean[i], rstd[i] = mu, r
            for c in range(d):
                yi[c] = (xi[c] - mu) * r * w[c] + b[c]


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def _relu_dropout_norm_backward(gy, x, mean, rstd, w, scale, da, parts):
    """``da`` from ``gy``, and the weight and bias gradients as partial sums over fixed row blocks
    ``parts [num_blocks, 2, d]`` (added in order by the caller: no dependence on the thread count).
    LayerNorm: ``dx = rstd (g - mean(g) - xhat mean(g xhat))`` with ``g = gy w``; dropout and ReLU
    pass ``dx scale`` where ``x > 0`` (kept and positive) and 0 elsewhere."""
    n, d = gy.shape
    num_blocks = parts.shape[0]
    zero = np.float32(0.0)
    for p in prange(num_blocks):
        dw, db = parts[p, 0], parts[p, 1]
        dw[:] = 0.0
        db[:] = 0.0
        for i in range(p * n // num_blocks, (p + 1) * n // num_blocks):
            gi, xi, di = gy[i], x[i], da[i]
            mu, r = mean[i], rstd[i]
            m1 = zero
            m2 = zero
            for c in range(d):
                xh = (xi[c] - mu) * r
                g = gi[c] * w[c]
                m1 += g
                m2 += g * xh
                db[c] += gi[c]
                dw[c] += gi[c] * xh
            m1 /= np.float32(d)
            m2 /= np.float32(d)
            for c in range(d):
                v = r * (gi[c] * w[c] - m1 - (xi[c] - mu) * r * m2)
                di[c] = v * scale if xi[c] > zero else zero


class ReluDropoutNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, b, p, training, eps):
        seed, threshold, scale = _dropout_params(p, training)
        an = a.detach().contiguous().numpy()
        n = an.shape[0]
        x, y = np.empty_like(an), np.empty_like(an)
        mean, rstd = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
        with torch_threads_kept():
            _relu_dropout_norm(an, seed, threshold, scale, w.detach().numpy(), b.detach().numpy(), np.float32(eps),
                               x, mean, rstd, y, 64)
        ctx.save_for_backward(torch.from_numpy(x), torch.from_numpy(mean), torch.from_numpy(rstd), w)
        ctx.scale = scale
        return torch.from_numpy(y)

    @staticmethod
    def backward(ctx, gy):
        x, mean, rstd, w = ctx.saved_tensors
        da = torch.empty_like(x)
        parts = np.empty((_BACKWARD_BLOCKS, 2, x.shape[1]), dtype=np.float32)
        with torch_threads_kept():
            _relu_dropout_norm_backward(gy.contiguous().numpy(), x.numpy(), mean.numpy(), rstd.numpy(),
                                        w.detach().numpy(), ctx.scale, da.numpy(), parts)
        dw, db = torch.from_numpy(parts).sum(0)  # sequential over blocks
        return da, dw, db, None, None, None


def relu_dropout_layer_norm(a: torch.Tensor, p: float, training: bool, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """``norm(relu(dropout(a)))`` for float32 CPU ``a [n, d]`` and an affine ``norm`` over the last
    dimension, with ``dropout``'s mask (the same seed draw, so runs match the unfused ops)."""
    return ReluDropoutNorm.apply(a, norm.weight, norm.bias, float(p), bool(training), float(norm.eps))


# ----------------------------------------------------------------------------------------------
# GRU cell

# sigmoid and tanh from exp(u), u <= 0, written so LLVM vectorises them (no SVML here: numba's
# math.exp and math.tanh are scalar libm calls, 8-15x slower). u = k ln2 + r, |r| <= ln2 / 2,
# with ln 2 split in two (k * _LN2_HI is exact for |k| < 2**15); exp(r) - 1 from its Taylor
# series to r**7 (truncation below 6e-9); 2**k from the bits of -k, so no bit casts are needed.
_HALF, _TWO = np.float32(0.5), np.float32(2.0)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.1219444005469057e-4)
_E3, _E4, _E5, _E6, _E7 = (np.float32(1.0 / math.factorial(i)) for i in range(3, 8))
_P1, _P2, _P4, _P8, _P16, _P32, _P64 = (np.float32(2.0 ** -(1 << i)) for i in range(7))  # 2**-1, 2**-2, ...


@njit(fastmath={"contract"}, error_model="numpy", inline="always")
def _exp_parts(u):
    """``(s, q)`` with ``exp(u) = s (1 + q)`` for -87 <= u <= 0: ``s = 2**k`` exactly and
    ``|q| <= 0.42``, so ``exp(u) - 1 = s q + (s - 1)`` keeps full precision near u = 0."""
    k = np.floor(u * _LOG2E + _HALF)
    r = (u - k * _LN2_HI) - k * _LN2_LO
    q = r + r * r * (_HALF + r * (_E3 + r * (_E4 + r * (_E5 + r * (_E6 + r * _E7)))))
    m = np.int32(-k)
    s = _P1 if m & 1 else _ONE
    s *= _P2 if m & 2 else _ONE
    s *= _P4 if m & 4 else _ONE
    s *= _P8 if m & 8 else _ONE
    s *= _P16 if m & 16 else _ONE
    s *= _P32 if m & 32 else _ONE
    s *= _P64 if m & 64 else _ONE
    return s, q


@njit(fastmath={"contract"}, error_model="numpy", inline="always")
def _sigmoid(x):
    """1 / (1 + exp(-x)) via e = exp(-|x|), so neither side overflows (within 3 ulp)."""
    s, q = _exp_parts(-min(abs(x), np.float32(87.0)))
    e = s + s * q
    y = _ONE / (_ONE + e)
    return y if x >= 0 else e * y


@njit(fastmath={"contract"}, error_model="numpy", inline="always")
def _tanh(x):
    """tanh|x| = -m / (2 + m), m = exp(-2|x|) - 1; tanh(10) rounds to 1 (within 3 ulp)."""
    s, q = _exp_parts(-_TWO * min(abs(x), np.float32(10.0)))
    m = s * q + (s - _ONE)
    t = -m / (_TWO + m)
    return t if x >= 0 else -t


@njit(parallel=True, cache=True, fastmath={"contract"}, error_model="numpy")
def _gru_gates(gx, gh, h, own, rz, n, out, chunk):
    """GRU gates from the input map ``gx [N, 3d]`` (r, z, n columns) and the hidden map ``gh``:
    ``[N, 3d]`` (r, z, n) or, with ``own``, ``[N, 4d]`` (r, z, the input map's n of ``h``, the
    hidden map's n). Writes ``rz [N, 2d]``, ``n [N, d]`` and ``out = n + z (h - n)``."""
    num, d = h.shape
    nh0 = 3 * d if own else 2 * d
    for p in prange((num + chunk - 1) // chunk):
        for i in range(p * chunk, min(num, (p + 1) * chunk)):
            gxi, ghi, hi, rzi, ni, oi = gx[i], gh[i], h[i], rz[i], n[i], out[i]
            for c in range(2 * d):
                rzi[c] = _sigmoid(gxi[c] + ghi[c])
            r, z, nh, pre = rzi[:d], rzi[d:], ghi[nh0:nh0 + d], gxi[2 * d:]
            if own:
                own_n = ghi[2 * d:3 * d]
                for c in range(d):
                    ni[c] = pre[c] + own_n[c] + r[c] * nh[c]
            else:
                for c in range(d):
                    ni[c] = pre[c] + r[c] * nh[c]
            for c in range(d):
                v = _tanh(ni[c])
                ni[c] = v
                oi[c] = v + z[c] * (hi[c] - v)


@njit(parallel=True, cache=True, fastmath={"contract"})
def _gru_gate_grads(g, rz, n, gh, h, own, grads, chunk):
    """Pre-activation gradients ``grads [N, 4d]``: r, z, n of the input map, n of the hidden map
    (before the product with r), from the output gradient ``g [N, d]``."""
    num, d = h.shape
    nh0 = 3 * d if own else 2 * d
    for p in prange((num + chunk - 1) // chunk):
        for i in range(p * chunk, min(num, (p + 1) * chunk)):
            gi, hi, ni, rzi, out = g[i], h[i], n[i], rz[i], grads[i]
            r, z, nh = rzi[:d], rzi[d:], gh[i, nh0:nh0 + d]
            dr, dz, dn, dnh = out[:d], out[d:2 * d], out[2 * d:3 * d], out[3 * d:]
            for c in range(d):
                zc, nc, rc = z[c], ni[c], r[c]
                dpn = gi[c] * (_ONE - zc) * (_ONE - nc * nc)
                dz[c] = gi[c] * (hi[c] - nc) * (zc * (_ONE - zc))
                dn[c] = dpn
                dnh[c] = dpn * rc
                dr[c] = dpn * nh[c] * (rc * (_ONE - rc))


_GRU_CHUNK = 64  # rows per parallel task


class GRUCell(torch.autograd.Function):
    """``torch.nn.GRUCell`` on ``[mail || phi]`` with a hand-written backward: one buffer per
    gradient instead of autograd's chunk/slice/cat graph (whose slice backward zero-fills a full
    ``[n, 4 d]`` tensor per slice), and gradients for ``phi`` and the parameters only. The products
    are torch's; the gates (``_gru_gates``) and their gradients (``_gru_gate_grads``) are one numba
    pass each.

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
        else:
            gh = torch.addmm(b_hh, h, w_hh.t())
        h = h.contiguous()
        rz, n, out = torch.empty(h.shape[0], 2 * d), torch.empty_like(h), torch.empty_like(h)
        with torch_threads_kept():
            _gru_gates(gx.numpy(), gh.numpy(), h.detach().numpy(), own, rz.numpy(), n.numpy(), out.numpy(),
                       _GRU_CHUNK)
        ctx.save_for_backward(mail, phi, h, w_ih, rz, n, gh)
        ctx.own = own
        return out

    @staticmethod
    def backward(ctx, g):
        mail, phi, h, w_ih, rz, n, gh = ctx.saved_tensors
        d, mf = h.shape[1], w_ih.shape[1] - phi.shape[1]
        grads = torch.empty(h.shape[0], 4 * d, dtype=g.dtype)  # pre-activation: [r | z | n_in | n_hidden]
        with torch_threads_kept():
            _gru_gate_grads(g.contiguous().numpy(), rz.numpy(), n.numpy(), gh.numpy(), h.detach().numpy(), ctx.own,
                            grads.numpy(), _GRU_CHUNK)
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


# ----------------------------------------------------------------------------------------------
# Row gathers


@njit(parallel=True, cache=True)
def _index_add_head_rows(g, index, out):
    """``out[a] = 0``, then ``out[a, index[i]] += g[a, i]`` for i in order, one task per leading
    index a: no two tasks write the same row, and the sums do not depend on the thread count."""
    for a in prange(g.shape[0]):
        out[a] = 0.0
        for i in range(g.shape[1]):
            src, dst = g[a, i], out[a, index[i]]
            for c in range(src.shape[0]):
                dst[c] += src[c]


class GatherHeadRows(torch.autograd.Function):
    """``x[:, index]`` for ``x [H, rows, C]``. Backward sums the rows back per head in parallel;
    torch's ``index_add_`` along dim 1 runs on one thread (0.20 vs 0.05 ms for the attention's
    ``[2, 1800, 100]`` query projections, 2 threads)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[1]
        return x.index_select(1, index)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        out = torch.empty(g.shape[0], ctx.rows, g.shape[2], dtype=g.dtype)
        with torch_threads_kept():
            _index_add_head_rows(g.contiguous().numpy(), index.contiguous().numpy(), out.numpy())
        return out, None


def gather_head_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x[:, index]`` (``x`` itself when ``index`` is None) for float32 CPU ``x [H, rows, C]``."""
    return x if index is None else GatherHeadRows.apply(x, index)
