"""M-TGNN building blocks. TGN, JODIE and APAN differ only by the modules they are given
(``zoo.py`` gives them; ``build_model`` builds the model registered under a name).

A ``TemporalModel`` holds an ``updater`` (memory update from pending mails, DistTGL eq. 3 / 8), an
``embedding`` (temporal attention for TGN, eq. 4-7; time projection for JODIE; identity for APAN),
optional static node memory (DistTGL section 3.1) and a link predictor. All node terms are computed
once per unique node of the batch: the memory update depends only on the node, and the linear maps
over concatenations ``W [h || e || phi(dt)]`` are split into ``W_h h + W_e e + W_t phi(dt)`` so the
``W_h h`` part is a per-node product gathered into the ``[num_roots, K]`` layout.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tgdist.kernels import cpu_ops
from tgdist.memory.store import MemoryRead
from tgdist.models.registry import model_class


class TimeEncoder(nn.Module):
    """phi(dt) = cos(w dt + b) with w initialised to 1 / 10^linspace(0, 9, dim) (TGAT / TGN).

    Trainable like TGN's; written as one fused multiply-add rather than ``Linear(1, dim)``, whose
    rank-1 matmul is slow on CPU. On CPU a numba kernel computes cos and the sin its backward needs
    in one pass (cpu_ops.py); ``fused = False`` or a GPU uses the torch ops.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.w = nn.Parameter(torch.empty(dim))
        self.b = nn.Parameter(torch.empty(dim))
        self.fused = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.copy_(1.0 / 10 ** torch.linspace(0, 9, self.dim))
            self.b.zero_()

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        """``dt [...]`` float32 -> ``[..., dim]``."""
        if self.fused and dt.device.type == "cpu" and self.w.dtype == torch.float32 and not dt.requires_grad:
            return cpu_ops.time_encode(dt, self.w, self.b)
        return torch.cos(torch.addcmul(self.b, dt.unsqueeze(-1), self.w))


class Dropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask with cpu_ops' counter-based hash on CPU (7x faster than
    torch's Bernoulli sampling there); seeded from torch's generator, so runs stay reproducible."""

    fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.device.type == "cpu" and x.dtype == torch.float32:
            return cpu_ops.dropout(x, self.p, self.training)
        return super().forward(x)


def use_cpu_kernels(module: nn.Module, enabled: bool) -> None:
    """Switch every part of ``module`` between its numba CPU kernels and the plain torch ops."""
    for m in module.modules():
        if hasattr(m, "fused"):
            m.fused = enabled


def use_sync_free(module: nn.Module, enabled: bool) -> None:
    """Let the memory updaters of ``module`` that have one run on the CPU as on a GPU, without
    reads of device values (``_CellUpdater.sync_free``; where ``fused`` is off)."""
    for m in module.modules():
        if hasattr(m, "sync_free"):
            m.sync_free = enabled


# ----------------------------------------------------------------------------------------------
# Memory updaters: (memory read of unique nodes) -> (updated memory, its time, updated mask)


@dataclass
class MemoryUpdate:
    """Updated memory of unique nodes: ``mem [n, mem_dim]``, ``mem_ts [n]`` float64 (time of the
    newest applied mail, or the old memory time when no mail was pending), ``updated [n]`` bool."""

    mem: torch.Tensor
    mem_ts: torch.Tensor
    updated: torch.Tensor


class _CellUpdater(nn.Module):
    """s' = CELL([mail || phi(mail_ts - mem_ts)], s) for nodes with a pending mail (one slot).

    The cell's input map is applied split, ``W_m mail + W_t phi``: mails and memory are stored
    (detached) values, so only the ``phi`` columns need an input gradient. ``cell`` holds the
    parameters with torch's names and initialisation (``weight_ih``, ``weight_hh``, ...).

    On CPU (``fused``) the cells run ``fused_step``. A TGN mail of node u is ``[s'_u || s'_v || e]``
    and is written in the same batch as u's memory ``s'_u``, so its first ``mem_dim`` columns equal
    the memory the cell updates; when they do (checked every batch), the two maps of that one
    vector are merged where the cell adds them, ``W_m,own s + W_hh s = (W_m,own + W_hh) s`` (all of
    a tanh RNN's input, the r and z gates of a GRU). ``step`` is the plain formulation (GPUs,
    ``cpu_kernels=false``); the tests check that both agree.

    A read known to hold no mail (``MemoryRead.empty``, e.g. the first batch after a reset)
    returns the memory as it is. Otherwise the CPU asks the device whether any row has a mail and
    which (``has.any()``, ``nonzero``): on a GPU two reads that wait for it every step. A GPU (or
    the CPU with ``sync_free``, ``use_sync_free``: as a GPU runs it) runs without them where the
    store says what it knows (``empty`` False; None keeps the reads): the cell runs on every row,
    the rows without a mail with a time gap of 0 (infinite otherwise, it would reach the backward
    pass through the selection as NaN), and ``torch.where`` keeps their old memory. Values and
    gradients equal the other path's to float rounding (a test compares them) but for one case: in
    a batch where no row has a mail and the store could not tell, the other path leaves the
    updater's parameters without a gradient (None), this one gives them zeros, which Adam does not
    skip (its moments and step count move on). The CPU kernels (``fused``) are taken first.
    """

    fused = True
    sync_free = False

    def __init__(self, cell: nn.Module, time_enc: TimeEncoder):
        super().__init__()
        self.cell = cell
        self.time_enc = time_enc

    def forward(self, read: MemoryRead) -> MemoryUpdate:
        mail, mail_ts = read.mail[:, -1], read.mail_ts[:, -1]  # S == 1: the one slot
        has = torch.isfinite(mail_ts)
        if read.empty:
            return MemoryUpdate(read.mem, read.mem_ts, has)
        cpu = read.mem.device.type == "cpu"
        if read.empty is not None and (not cpu or (self.sync_free and not self.fused)):
            dt = torch.where(has, mail_ts - read.mem_ts, 0.0).float()
            new = self.step(mail, self.time_enc(dt), read.mem)
            mem = torch.where(has.unsqueeze(1), new, read.mem)
            return MemoryUpdate(mem, torch.where(has, mail_ts, read.mem_ts), has)
        if not bool(has.any()):
            return MemoryUpdate(read.mem, read.mem_ts, has)
        idx = torch.nonzero(has).squeeze(1)
        # index_select, not x[idx]: advanced indexing is 3-4x slower for these row gathers on CPU
        dt = (mail_ts.index_select(0, idx) - read.mem_ts.index_select(0, idx)).float()
        mail, phi, h = mail.index_select(0, idx), self.time_enc(dt), read.mem.index_select(0, idx)
        if (self.fused and h.device.type == "cpu" and h.dtype == torch.float32
                and not (mail.requires_grad or h.requires_grad)):
            d = h.shape[1]
            own = torch.equal(mail[:, :d], h)
            new = self.fused_step(mail[:, d:] if own else mail, phi, h, own)
        else:
            new = self.step(mail, phi, h)
        mem = read.mem.index_copy(0, idx, new)
        return MemoryUpdate(mem, torch.where(has, mail_ts, read.mem_ts), has)

    def input_map(self, mail: torch.Tensor, phi: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """``W_ih [mail || phi] + b_ih`` without the concatenation; with ``skip``, ``mail`` lacks
        its first ``skip`` columns (and so do the weights applied to it)."""
        w, m = self.cell.weight_ih, skip + mail.shape[1]
        return torch.addmm(F.linear(phi, w[:, m:], self.cell.bias_ih), mail, w[:, skip:m].t())

    def step(self, mail: torch.Tensor, phi: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fused_step(self, mail: torch.Tensor, phi: torch.Tensor, h: torch.Tensor, own: bool) -> torch.Tensor:
        """``step`` on CPU; with ``own``, ``mail`` lacks its first ``d`` columns, which are ``h``."""
        raise NotImplementedError


class GRUUpdater(_CellUpdater):
    """TGN: a GRU cell (DistTGL eq. 3 with UPDT = GRU), gates as in ``torch.nn.GRUCell``."""

    def __init__(self, mem_dim: int, mail_dim: int, time_dim: int):
        te = TimeEncoder(time_dim)
        super().__init__(nn.GRUCell(mail_dim + time_dim, mem_dim), te)

    def step(self, mail, phi, h):
        i_r, i_z, i_n = self.input_map(mail, phi).chunk(3, dim=1)
        h_r, h_z, h_n = F.linear(h, self.cell.weight_hh, self.cell.bias_hh).chunk(3, dim=1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(torch.addcmul(i_n, r, h_n))
        return n + z * (h - n)  # (1 - z) n + z h

    def fused_step(self, mail, phi, h, own):
        return cpu_ops.gru_cell(mail, phi, h, self.cell, own)


class RNNUpdater(_CellUpdater):
    """JODIE: a vanilla tanh RNN cell (``torch.nn.RNNCell``)."""

    def __init__(self, mem_dim: int, mail_dim: int, time_dim: int):
        te = TimeEncoder(time_dim)
        super().__init__(nn.RNNCell(mail_dim + time_dim, mem_dim), te)

    def step(self, mail, phi, h):
        return torch.tanh(self.input_map(mail, phi) + F.linear(h, self.cell.weight_hh, self.cell.bias_hh))

    def fused_step(self, mail, phi, h, own):
        if not own:
            return self.step(mail, phi, h)
        d = h.shape[1]
        w = self.cell.weight_ih[:, :d] + self.cell.weight_hh
        return torch.tanh(torch.addmm(self.input_map(mail, phi, skip=d), h, w.t()) + self.cell.bias_hh)


class MailboxAttentionUpdater(nn.Module):
    """APAN: attention from the memory over the node's mailbox, s' = LN(s + W_o attn).

    Keys and values are ``[mail_j || phi(newest_ts - mail_ts_j)]``: the age of a mail relative to
    the newest one, so the update depends only on the node (not on the querying root).

    ``fused`` (the default, on any device): the key/value map is applied on the query side, as the
    TGN attention's time projection is (tgdist/kernels/attention.py). Per head,
    ``q . (W_k x_j + b_k) = (W_k^T q) . x_j + q . b_k``, whose last term is the same for every
    slot and cancels in the softmax, and ``sum_j p_j (W_v x_j + b_v) = W_v sum_j p_j x_j + b_v``
    (the weights sum to 1: only nodes with a mail are updated). So no mail is projected: two
    ``[n, D] x [D, mail_dim + time_dim]``-sized products replace the ``[n * S, mail_dim +
    time_dim] x [.., 2 D]`` one, about 8x fewer multiply-adds with 10 slots. ``fused = False``
    (``model.cpu_kernels=false``) is the plain formulation; the tests check both agree.

    Which rows have a mail: on the CPU it asks (``has.any()``, ``nonzero``) and updates those rows
    alone. A GPU (or the CPU with ``sync_free``) does not wait for those two reads where the store
    says what it knows (``MemoryRead.empty`` False; None keeps them), as the cell updaters do: the
    attention runs on every row, a row without a mail gets finite (uniform) weights rather than
    a softmax of -inf (NaN, which would reach the backward pass), and ``torch.where`` keeps its
    memory and time. The tests compare values and gradients with the reading path.
    """

    fused = True
    sync_free = False

    def __init__(self, mem_dim: int, mail_dim: int, time_dim: int, num_heads: int = 2):
        super().__init__()
        self.time_enc = TimeEncoder(time_dim)
        self.num_heads = num_heads
        self.q = nn.Linear(mem_dim, mem_dim)
        self.kv = nn.Linear(mail_dim + time_dim, 2 * mem_dim)
        self.out = nn.Linear(mem_dim, mem_dim)
        self.norm = nn.LayerNorm(mem_dim)

    def forward(self, read: MemoryRead) -> MemoryUpdate:
        valid = torch.isfinite(read.mail_ts)  # [n, S]
        has = valid.any(1)
        if read.empty:
            return MemoryUpdate(read.mem, read.mem_ts, has)
        if read.empty is not None and (read.mem.device.type != "cpu" or self.sync_free):
            new, newest = self._update(read.mem, read.mail, read.mail_ts, valid)
            return MemoryUpdate(torch.where(has.unsqueeze(1), new, read.mem), torch.where(has, newest, read.mem_ts), has)
        if not bool(has.any()):
            return MemoryUpdate(read.mem, read.mem_ts, has)
        idx = torch.nonzero(has).squeeze(1)
        new, newest = self._update(read.mem.index_select(0, idx), read.mail.index_select(0, idx),
                                   read.mail_ts.index_select(0, idx), valid.index_select(0, idx))
        return MemoryUpdate(read.mem.index_copy(0, idx, new), read.mem_ts.index_copy(0, idx, newest), has)

    def _update(self, mem: torch.Tensor, mail: torch.Tensor, mts: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new memory and its time of rows ``mem [n, D]`` with mailboxes ``mail [n, S, ..]``,
        ``mts [n, S]`` and valid slots ``v``; a row without one gets finite values (-inf time)."""
        newest = torch.where(v, mts, torch.full_like(mts, float("-inf"))).max(1).values
        age = torch.where(v, newest[:, None] - mts, torch.zeros_like(mts)).float()
        phi = self.time_enc(age)
        q = self.q(mem)
        if self.fused:
            attn = self._projected_attention(q, mail, phi, v)
        else:
            k, val = self.kv(torch.cat([mail, phi], dim=2)).chunk(2, dim=2)
            attn = _masked_attention(q, k, val, v, self.num_heads)
        return self.norm(mem + self.out(attn)), newest

    def _projected_attention(self, q: torch.Tensor, mail: torch.Tensor, phi: torch.Tensor,
                             valid: torch.Tensor) -> torch.Tensor:
        """``_masked_attention`` over ``kv([mail || phi])`` for rows that each have a valid slot:
        ``q [n, D]``, ``mail [n, S, mail_dim]``, ``phi [n, S, time_dim]``, ``valid [n, S]``."""
        n, d = q.shape
        heads, m = self.num_heads, mail.shape[2]
        dh = d // heads
        w = self.kv.weight.view(2, heads, dh, -1)  # keys, values; per head [dh, mail_dim + time_dim]
        u = torch.einsum("nhd,hdc->nhc", q.view(n, heads, dh), w[0])  # queries in input space
        scores = (torch.bmm(mail, u[:, :, :m].transpose(1, 2)) + torch.bmm(phi, u[:, :, m:].transpose(1, 2)))
        scores = (scores / math.sqrt(dh)).masked_fill(~valid.unsqueeze(-1), float("-inf"))  # [n, S, H]
        scores = scores.masked_fill(~valid.any(1).view(n, 1, 1), 0.0)  # a row without a mail: uniform, not NaN
        p = torch.softmax(scores, dim=1).transpose(1, 2)  # [n, H, S]; masked slots get exactly 0
        agg_m, agg_t = torch.bmm(p, mail), torch.bmm(p, phi)  # weighted inputs per head
        out = torch.einsum("nhc,hdc->nhd", agg_m, w[1, :, :, :m]) + torch.einsum("nhc,hdc->nhd", agg_t, w[1, :, :, m:])
        return (out + self.kv.bias[d:].view(heads, dh)).reshape(n, d)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
    """Multi-head attention of one query per row over K keys.

    ``q [n, d]``, ``k, v [n, K, d]``, ``mask [n, K]`` -> ``[n, d]``; rows with no valid key give 0.
    """
    n, kk, d = k.shape
    dh = d // num_heads
    scores = torch.einsum("nhd,nkhd->nkh", q.view(n, num_heads, dh), k.view(n, kk, num_heads, dh)) / math.sqrt(dh)
    scores = scores.masked_fill(~mask.unsqueeze(-1), float("-inf"))
    # rows without any neighbour: uniform weights over zeros instead of NaN from softmax(-inf)
    scores = scores.masked_fill(~mask.any(1).view(n, 1, 1), 0.0)
    w = torch.softmax(scores, dim=1).masked_fill(~mask.unsqueeze(-1), 0.0)
    return torch.einsum("nkh,nkhd->nhd", w, v.view(n, kk, num_heads, dh)).reshape(n, d)


# ----------------------------------------------------------------------------------------------
# Embeddings


@dataclass
class HopTables:
    """One hop of the batch, indexed into per-batch unique tables (so per-node, per-time-gap and
    per-event terms are computed once each and gathered).

    ``nbr [n, K]``: row of the neighbour in the node table (0 where masked); ``mask [n, K]``;
    ``dt_index [n, K]`` into ``dt_values [num_dt]`` (float32 root_t - event time; masked slots
    point at any entry); ``edge_index [n, K]`` into ``edge_feat [num_events_u, edge_dim]`` or None.
    """

    nbr: torch.Tensor
    mask: torch.Tensor
    dt_index: torch.Tensor
    dt_values: torch.Tensor
    edge_index: torch.Tensor | None = None
    edge_feat: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "HopTables":
        """The hop restricted to ``rows``, its time-gap and event tables cut to the entries those
        rows use (the time encoding runs once per table entry, forward and backward)."""
        dt_used, dt_index = _used(self.dt_index.index_select(0, rows), self.dt_values.shape[0])
        edge_index = edge_feat = None
        if self.edge_index is not None:
            ev_used, edge_index = _used(self.edge_index.index_select(0, rows), self.edge_feat.shape[0])
            edge_feat = self.edge_feat.index_select(0, ev_used)
        return HopTables(self.nbr.index_select(0, rows), self.mask.index_select(0, rows), dt_index,
                         self.dt_values.index_select(0, dt_used), edge_index, edge_feat)


def _used(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of a table of ``size`` rows that ``index`` uses, ascending, and ``index`` into
    them: ``torch.unique(index, return_inverse=True)``. On CPU by marking the used entries in NumPy
    instead of sorting (2-4x faster for a hop's 10^4 entries of a 6 x 10^4 table)."""
    if index.device.type != "cpu":
        return torch.unique(index, return_inverse=True)
    flat = index.reshape(-1).numpy()
    used = np.zeros(size, dtype=bool)
    used[flat] = True
    new = np.cumsum(used) - 1
    return torch.from_numpy(np.flatnonzero(used)), torch.from_numpy(new[flat]).view_as(index)


@dataclass
class EmbedInput:
    """What an embedding module sees for one batch.

    ``h [num_unique, dim]``: node representation (updated memory + static memory + node features)
    of the batch's unique nodes; ``mem_ts [num_unique]`` their (updated) memory times;
    ``root [num_roots]`` indices into the unique nodes; ``root_t [num_roots]`` float64 times;
    ``hops``: one ``HopTables`` per hop; hop l+1's rows are hop l's flattened neighbours.
    ``inner``: a historical embedding cache's view of the batch (``tgdist.runtime.cache.CachedBatch``)
    or None: layer 1 computes the hop-1 slots ``inner.compute_rows`` only (None: all), the others'
    hop-2 rows are not expanded, and ``inner.distinct(computed)`` gives the distinct inner embeddings
    and each slot's row in them.
    """

    h: torch.Tensor
    mem_ts: torch.Tensor
    root: torch.Tensor
    root_t: torch.Tensor
    hops: list
    inner: object | None = None


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x[index]`` (``x`` itself when ``index`` is None)."""
    return x if index is None else x.index_select(0, index)


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an index of any shape, via index_select (whose backward is index_add)."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, table.shape[-1])


class TemporalAttentionLayer(nn.Module):
    """One temporal attention layer (DistTGL eq. 4-7, TGAT), with the W [h || e || phi] split."""

    def __init__(self, in_dim: int, edge_dim: int, time_dim: int, out_dim: int, num_heads: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.num_heads = num_heads
        self.time_enc = TimeEncoder(time_dim)
        self.q_h = nn.Linear(in_dim, out_dim)  # bias holds W_q phi(0) + b_q after training
        self.q_t = nn.Linear(time_dim, out_dim, bias=False)
        self.kv_h = nn.Linear(in_dim, 2 * out_dim)
        self.kv_e = nn.Linear(edge_dim, 2 * out_dim, bias=False) if edge_dim else None
        self.kv_t = nn.Linear(time_dim, 2 * out_dim, bias=False)
        self.out = nn.Linear(out_dim + in_dim, out_dim)
        self.norm = nn.LayerNorm(out_dim)
        self.dropout = Dropout(dropout)
        # CPU (float32): numba kernels that never materialise per-pair rows and never project each
        # distinct time gap (tgdist/kernels/attention.py), and ReLU, dropout and LayerNorm in one pass
        # (cpu_ops.py); GPU and fused=False: the torch formulation below. Both give the same
        # values and gradients (tests/kernels/test_cpu_ops.py).
        self.fused = True

    def forward(self, h_query: torch.Tensor, kv_node: torch.Tensor, hop: HopTables,
                index: torch.Tensor | None = None) -> torch.Tensor:
        """Queries are the rows ``h_query[index]`` (all of ``h_query`` when ``index`` is None);
        ``kv_node [m, 2*out]``: per-node key/value terms ``kv_h(h)`` of the table ``hop.nbr`` points
        into. Returns ``[len(index), out]``.

        The query and the ``h`` half of the output map depend on the node only, so with an
        ``index`` they are computed once per table row up to ``index.max()`` and gathered: a batch
        of 600 events has 1,800 roots but about 700 distinct root nodes, and the trainer's unique
        table lists root nodes first. (On GPUs the whole table is used: reading ``index.max()``
        would wait for the device.)"""
        if index is not None and index.device.type == "cpu":
            h_query = h_query[: int(index.max()) + 1] if index.numel() else h_query[:0]
        zero = self.time_enc(torch.zeros(1, device=h_query.device))
        q = self.q_h(h_query) + self.q_t(zero)  # per table row
        edge = self.kv_e is not None and hop.edge_feat is not None
        if self.fused and q.device.type == "cpu" and q.dtype == torch.float32:
            attn = self._fused(q, kv_node, hop, edge, index)
        else:
            kv = _gather(kv_node, hop.nbr) + _gather(self.kv_t(self.time_enc(hop.dt_values)), hop.dt_index)
            if edge:
                kv = kv + _gather(self.kv_e(hop.edge_feat), hop.edge_index)
            k, v = kv.chunk(2, dim=2)
            attn = _masked_attention(_rows(q, index), k, v, hop.mask, self.num_heads)
        attn = self.dropout(attn)
        d = attn.shape[1]  # out([attn || h]) = W_a attn + (W_h h + b), the second term per node
        node_term = _rows(F.linear(h_query, self.out.weight[:, d:], self.out.bias), index)
        z = torch.addmm(node_term, attn, self.out.weight[:, :d].t())
        if self.fused and z.device.type == "cpu" and z.dtype == torch.float32:
            return cpu_ops.relu_dropout_layer_norm(z, self.dropout.p, self.training, self.norm)
        return self.norm(F.relu(self.dropout(z)))

    def _fused(self, q, kv_node, hop: HopTables, edge: bool, index) -> torch.Tensor:
        """The same attention with the time and edge projections moved to the root side
        (tgdist/kernels/attention.py): ``q_h . W_h x = (W_h^T q_h) . x`` for the scores and
        ``sum_j p_j W_h x_j = W_h sum_j p_j x_j`` for the values, both linear maps without bias.
        ``q`` is per table row; its projections are too, gathered to the roots by ``index``."""
        from tgdist.kernels.attention import fused_attention

        heads, dh = self.num_heads, q.shape[1] // self.num_heads
        qh = q.view(q.shape[0], heads, dh).transpose(0, 1)  # [H, rows, dh]

        def split(linear):  # W [2D, in] -> key and value maps per head, [H, dh, in] each
            wk, wv = linear.weight.chunk(2, dim=0)
            return wk.reshape(heads, dh, -1), wv.reshape(heads, dh, -1)

        n, d = hop.nbr.shape[0], q.shape[1]
        wk_t, wv_t = split(self.kv_t)
        ut = cpu_ops.gather_head_rows(torch.bmm(qh, wk_t), index)  # [H, rows, time_dim] -> [H, n, time_dim]
        phi = self.time_enc(hop.dt_values)
        if edge:
            wk_e, wv_e = split(self.kv_e)
            ue, ef, ei = cpu_ops.gather_head_rows(torch.bmm(qh, wk_e), index), hop.edge_feat, hop.edge_index
        else:
            ue, ef, ei = q.new_zeros(heads, n, 0), q.new_zeros(0, 0), hop.dt_index  # ei unused
        out, aggt, agge = fused_attention(_rows(q, index), kv_node, ut, phi, ue, ef, hop.nbr, hop.dt_index, ei,
                                          hop.mask, heads)
        values = torch.bmm(aggt, wv_t.transpose(1, 2))  # [H, n, dh]
        if edge:
            values = values + torch.bmm(agge, wv_e.transpose(1, 2))
        return out + values.transpose(0, 1).reshape(n, d)


class AttentionEmbedding(nn.Module):
    """TGN's embedding: ``num_layers`` temporal attention layers over sampled neighbours.

    With one layer the per-node key/value products run once per unique node. With two (TGAT),
    layer 1 embeds the roots and their hop-1 neighbours, and layer 2 attends from the roots' layer-1
    embedding over the neighbours' layer-1 embeddings.
    """

    def __init__(self, dim: int, edge_dim: int, time_dim: int, num_layers: int = 1, num_heads: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(TemporalAttentionLayer(dim, edge_dim, time_dim, dim, num_heads, dropout)
                                    for _ in range(num_layers))
        self.num_layers = num_layers

    @property
    def num_hops(self) -> int:
        return self.num_layers

    def forward(self, x: EmbedInput) -> torch.Tensor:
        if self.num_layers == 1:
            layer = self.layers[0]
            return layer(x.h, layer.kv_h(x.h), x.hops[0], x.root)
        # Two layers (TGAT): layer 1 on roots (over hop 1) and on hop-1 neighbours (over hop 2).
        hop1, hop2 = x.hops[0], x.hops[1]
        l1, l2 = self.layers
        kv1 = l1.kv_h(x.h)
        z_root = l1(x.h, kv1, hop1, x.root)
        query = hop1.nbr.reshape(-1)
        if x.inner is None or x.inner.compute_rows is None:
            z_nbr = l1(x.h, kv1, hop2, query)  # [n * K1, dim]
        else:  # FreshGNN: the hop-2 rows of slots served from the cache are pruned (section 5)
            rows = x.inner.compute_rows
            z_nbr = (l1(x.h, kv1, hop2.select(rows), query.index_select(0, rows)) if rows.numel()
                     else z_root[:0])  # every slot served
        source = None
        if x.inner is not None:  # the distinct rows [computed | served | zero] and each slot's row in them
            z_nbr, source = x.inner.distinct(z_nbr)
        if source is None:
            source = torch.arange(hop1.nbr.numel(), device=hop1.nbr.device)
        # layer 2's key and value terms once per distinct row (a slot served or shared reuses its row's)
        hop1_rows = HopTables(source.view_as(hop1.nbr), hop1.mask, hop1.dt_index, hop1.dt_values, hop1.edge_index,
                              hop1.edge_feat)
        return l2(z_root, l2.kv_h(z_nbr), hop1_rows)


class TimeProjectionEmbedding(nn.Module):
    """JODIE: h(t) = s' * (1 + w * (t - mem_ts) / time_scale); no neighbours."""

    num_hops = 0

    def __init__(self, dim: int, time_scale: float = 1.0):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))
        self.time_scale = float(time_scale)

    def forward(self, x: EmbedInput) -> torch.Tensor:
        dt = ((x.root_t - x.mem_ts[x.root]) / self.time_scale).float().unsqueeze(1)
        return _rows(x.h, x.root) * (1 + dt * self.w)


class IdentityEmbedding(nn.Module):
    """APAN: the (updated) node representation is the embedding; neighbours only receive mails."""

    num_hops = 0

    def forward(self, x: EmbedInput) -> torch.Tensor:
        return _rows(x.h, x.root)


# ----------------------------------------------------------------------------------------------
# Heads


class EdgePredictor(nn.Module):
    """score(u, v) = W_o relu(W_s h_u + W_d h_v) (TGL / TGN link predictor)."""

    def __init__(self, dim: int):
        super().__init__()
        self.src = nn.Linear(dim, dim)
        self.dst = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, h_src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """``h_src [n, dim]``, ``h_dst [n, m, dim]`` -> logits ``[n, m]``."""
        return self.out(F.relu(self.src(h_src).unsqueeze(1) + self.dst(h_dst))).squeeze(-1)


class MLPClassifier(nn.Module):
    """Decoder for node / edge classification: ``[n, in_dim] -> [n, num_classes]`` logits."""

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 100, dropout: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# ----------------------------------------------------------------------------------------------
# The model


class TemporalModel(nn.Module):
    """An M-TGNN assembled from injected parts (STYLE.md 5).

    ``mail_dim = 2 * mem_dim + edge_dim``: the mail of an event (u, v) at u is
    ``[s'_u || s'_v || e_uv]`` (DESIGN.md step 7); the time encoding is added at update time.
    """

    def __init__(self, num_nodes: int, mem_dim: int, edge_dim: int, node_dim: int, updater: nn.Module,
                 embedding: nn.Module, mailbox_size: int = 1, static_memory: bool = False,
                 deliver_to_neighbors: bool = False):
        super().__init__()
        self.num_nodes, self.mem_dim, self.edge_dim = num_nodes, mem_dim, edge_dim
        self.mail_dim = 2 * mem_dim + edge_dim
        self.mailbox_size = mailbox_size
        self.deliver_to_neighbors = deliver_to_neighbors
        self.updater = updater
        self.embedding = embedding
        self.node_proj = nn.Linear(node_dim, mem_dim) if node_dim else None
        self.static = nn.Embedding(num_nodes, mem_dim) if static_memory else None
        if self.static is not None:
            nn.init.normal_(self.static.weight, std=0.1)
        self.predictor = EdgePredictor(mem_dim)

    @property
    def num_hops(self) -> int:
        return max(getattr(self.embedding, "num_hops", 0), 1 if self.deliver_to_neighbors else 0)

    def node_repr(self, nodes: torch.Tensor, upd: MemoryUpdate, node_feat: torch.Tensor | None) -> torch.Tensor:
        """``h = s' + static[v] + W x_v`` for the unique nodes ``nodes [n]``."""
        h = upd.mem
        if self.static is not None:
            h = h + self.static(nodes)
        if self.node_proj is not None and node_feat is not None:
            h = h + self.node_proj(node_feat)
        return h


def build_model(name: str, *, num_nodes: int, mem_dim: int = 100, time_dim: int = 100, edge_dim: int = 0,
                node_dim: int = 0, num_layers: int = 1, num_heads: int = 2, dropout: float = 0.1,
                mailbox_size: int = 10, static_memory: bool = False, time_scale: float = 1.0) -> TemporalModel:
    """The model registered as ``name`` (``tgdist.models.registry``; the config's ``model.name``),
    which assembles itself from parts: the loop never asks which it is. An unknown name is a
    ``ConfigError`` naming the registered ones."""
    spec = model_class(name)
    with warnings.catch_warnings():  # time_dim=0 (no time encoding, an ablation): empty maps, which torch warns of
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        return spec.build(num_nodes=num_nodes, mem_dim=mem_dim, time_dim=time_dim, edge_dim=edge_dim,
                          node_dim=node_dim, num_layers=num_layers, num_heads=num_heads, dropout=dropout,
                          mailbox_size=mailbox_size, static_memory=static_memory, time_scale=time_scale)
