"""Exact semantics of one training iteration on tiny hand-built graphs (DESIGN.md steps 1-7)."""

import numpy as np
import pytest
import torch

from tgdist.data.graph import TemporalGraph, chronological_split
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.memory.store import LocalMemory, mail_rounds
from tgdist.models.modules import HopTables, TemporalAttentionLayer, build_model, use_cpu_kernels
from tgdist.runtime.trainer import Trainer, memory_for


def graph(src, dst, t, edge_feat=None, num_nodes=None):
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    n = num_nodes or int(max(src.max(), dst.max()) + 1)
    ef = None if edge_feat is None else np.asarray(edge_feat, np.float32).reshape(len(src), -1)
    return TemporalGraph(src=src, dst=dst, t=np.asarray(t, np.int64), num_nodes=n, node_map=np.arange(n), edge_feat=ef)


def make_trainer(g, name="tgn", batch_size=2, fanout=2, mem_dim=4, **kw):
    torch.manual_seed(0)
    m = build_model(name, num_nodes=g.num_nodes, mem_dim=mem_dim, time_dim=4, edge_dim=g.edge_dim, num_heads=2,
                    dropout=0.0, **kw)
    split = chronological_split(g, 0.0, 0.0)
    sampler = TemporalSampler(TCSR.build(g), [fanout]) if m.num_hops else None
    return Trainer(g, split, m, memory_for(m, g.num_nodes), sampler, NegativeSampler(g, 0), batch_size=batch_size,
                   progress=False)


def gru_by_hand(cell, x, h):
    w_ir, w_iz, w_in = cell.weight_ih.chunk(3)
    w_hr, w_hz, w_hn = cell.weight_hh.chunk(3)
    b_ir, b_iz, b_in = cell.bias_ih.chunk(3)
    b_hr, b_hz, b_hn = cell.bias_hh.chunk(3)
    r = torch.sigmoid(x @ w_ir.T + b_ir + h @ w_hr.T + b_hr)
    z = torch.sigmoid(x @ w_iz.T + b_iz + h @ w_hz.T + b_hz)
    n = torch.tanh(x @ w_in.T + b_in + r * (h @ w_hn.T + b_hn))
    return (1 - z) * n + z * h


def time_enc_by_hand(enc, dt):
    return torch.cos(dt * enc.w + enc.b)


@torch.no_grad()
def test_memory_and_mail_after_each_batch():
    # e0 (0->1, t=10), e1 (0->2, t=20) in batch A; e2 (1->2, t=30) in batch B. Edge feature = 1, 2, 3.
    g = graph([0, 0, 1], [1, 2, 2], [10, 20, 30], edge_feat=[1.0, 2.0, 3.0])
    tr = make_trainer(g)
    mem, d = tr.memory, 4
    tr.step(0, 2, np.array([[2], [1]]), train=False)
    # No node had a mail yet: memory stays zero, mem_ts stays 0 (nothing applied).
    assert torch.equal(mem.mem, torch.zeros(3, d))
    assert torch.equal(mem.mem_ts, torch.zeros(3, dtype=torch.float64))
    # COMB = latest: node 0 keeps the mail of e1 (feature 2), at e1's time (relative to t0 = 10).
    assert mem.mail[0, 0, -1].item() == 2.0 and mem.mail_ts[0, 0].item() == 10.0
    assert mem.mail[1, 0, -1].item() == 1.0 and mem.mail_ts[1, 0].item() == 0.0
    assert mem.mail[2, 0, -1].item() == 2.0 and mem.mail_ts[2, 0].item() == 10.0
    mail_before = mem.mail.clone()

    tr.step(2, 3, np.array([[1]]), train=False)
    cell, enc = tr.model.updater.cell, tr.model.updater.time_enc
    # Node 1 applies its pending mail (ts 0) and node 2 its own (ts 10): s' = GRU([mail || phi(mail_ts - mem_ts)], 0).
    s1 = gru_by_hand(cell, torch.cat([mail_before[1, 0], time_enc_by_hand(enc, torch.tensor(0.0))]).unsqueeze(0), torch.zeros(1, d))
    s2 = gru_by_hand(cell, torch.cat([mail_before[2, 0], time_enc_by_hand(enc, torch.tensor(10.0))]).unsqueeze(0), torch.zeros(1, d))
    torch.testing.assert_close(mem.mem[1], s1[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(mem.mem[2], s2[0], rtol=0, atol=1e-6)
    assert mem.mem_ts.tolist() == [0.0, 0.0, 10.0]
    # New mails [s'_u || s'_v || e] at e2's time (20).
    torch.testing.assert_close(mem.mail[1, 0], torch.cat([s1[0], s2[0], torch.tensor([3.0])]), rtol=0, atol=1e-6)
    torch.testing.assert_close(mem.mail[2, 0], torch.cat([s2[0], s1[0], torch.tensor([3.0])]), rtol=0, atol=1e-6)
    assert mem.mail_ts[1, 0].item() == 20.0 and mem.mail_ts[2, 0].item() == 20.0
    # Node 0 was only a sampled neighbour in batch B: read and updated in-batch, never written.
    assert torch.equal(mem.mem[0], torch.zeros(d))
    assert torch.equal(mem.mail[0], mail_before[0]) and mem.mail_ts[0, 0].item() == 10.0


@torch.no_grad()
def test_mail_of_a_batch_is_not_used_by_the_same_batch():
    """One-batch delay: the embedding of an event never sees that event's own mail."""
    g = graph([0, 0], [1, 1], [1, 2], edge_feat=[5.0, 7.0])
    a = make_trainer(g, batch_size=2)
    b = make_trainer(g, batch_size=2)
    # b's first event carries a different feature; a batch holding both events must score the
    # same, since neither event's mail can reach an embedding in its own batch.
    b.edge_feat = b.edge_feat.clone()
    b.edge_feat[0] = 100.0
    b.edge_feat[1] = 100.0
    out_a = a.step(0, 2, np.array([[1], [1]]), train=False)
    out_b = b.step(0, 2, np.array([[1], [1]]), train=False)
    # edge features of event 0 do reach event 1 through the sampled neighbour (it is in the past)
    # but event 0's own score depends on nothing from the batch
    assert out_a.pos[0].item() == out_b.pos[0].item()


@torch.no_grad()
def test_mails_at_tied_timestamps_are_applied():
    """Two events of node 0 at the same time in consecutive batches: the first mail is applied
    (a mail_ts > mem_ts test would drop it, since both are 0)."""
    g = graph([0, 0], [1, 1], [5, 5], edge_feat=[1.0, 1.0])
    tr = make_trainer(g, batch_size=1)
    tr.step(0, 1, np.array([[1]]), train=False)
    assert torch.equal(tr.memory.mem, torch.zeros(2, 4))
    tr.step(1, 2, np.array([[1]]), train=False)
    assert tr.memory.mem[0].abs().sum() > 0 and tr.memory.mem[1].abs().sum() > 0


@pytest.mark.parametrize("own_memory_in_mail", [False, True])
def test_gru_and_rnn_updaters_equal_hand_computation(own_memory_in_mail, monkeypatch):
    """Both cell paths: any mail (general products) and TGN's mails, whose first half is the
    memory being updated (merged own-memory products, models._CellUpdater)."""
    from tgdist.memory.store import MemoryRead
    from tgdist.models.modules import GRUUpdater, RNNUpdater

    merged = []
    for cls in (GRUUpdater, RNNUpdater):
        def counted(self, mail, phi, h, own, original=cls.fused_step):
            merged.append((type(self).__name__, own))
            return original(self, mail, phi, h, own)
        monkeypatch.setattr(cls, "fused_step", counted)
    torch.manual_seed(1)
    for name in ("tgn", "jodie"):
        m = build_model(name, num_nodes=3, mem_dim=4, time_dim=4)
        mail = torch.randn(3, 1, m.mail_dim)
        mem = torch.randn(3, 4)
        if own_memory_in_mail:
            mail[:, 0, :4] = mem
        read = MemoryRead(mem, torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), mail,
                          torch.tensor([[3.0], [float("-inf")], [2.0]], dtype=torch.float64))
        upd = m.updater(read)
        cell, enc = m.updater.cell, m.updater.time_enc
        for i, dt in ((0, 3.0), (2, 0.0)):
            x = torch.cat([mail[i, 0], time_enc_by_hand(enc, torch.tensor(dt))]).unsqueeze(0)
            h = read.mem[i:i + 1]
            want = gru_by_hand(cell, x, h) if name == "tgn" else torch.tanh(
                x @ cell.weight_ih.T + cell.bias_ih + h @ cell.weight_hh.T + cell.bias_hh)
            torch.testing.assert_close(upd.mem[i], want[0], rtol=0, atol=1e-6)
        # node 1 has no mail: memory and time unchanged
        assert torch.equal(upd.mem[1], read.mem[1]) and upd.mem_ts.tolist() == [3.0, 1.0, 2.0]
        assert upd.updated.tolist() == [True, False, True]
    assert merged == [("GRUUpdater", own_memory_in_mail), ("RNNUpdater", own_memory_in_mail)]


def test_mailbox_ring_order_and_rounds():
    mem = LocalMemory(num_nodes=2, mem_dim=1, mail_dim=1, mailbox_size=3)
    for v in range(1, 6):  # five mails to node 0, one at a time
        mem.write_mail(torch.tensor([0]), torch.tensor([[float(v)]]), torch.tensor([float(v)], dtype=torch.float64))
    assert mem.mail[0, :, 0].tolist() == [4.0, 5.0, 3.0]  # ring: slot = count mod 3
    assert mem.head[0].item() == 2
    # Deliveries in one batch: node 0 gets 4 mails (keeps the newest 3, oldest first), node 1 one.
    ids = torch.tensor([0, 1, 0, 0, 0])
    rounds = mail_rounds(ids, torch.arange(5, dtype=torch.float64), keep=3)
    assert [r.tolist() for r in rounds] == [[2, 1], [3], [4]]
    mem.reset_state()
    for r in rounds:
        mem.write_mail(ids[r], r.float().unsqueeze(1) * 10, r.to(torch.float64))
    assert mem.mail[0, :, 0].tolist() == [20.0, 30.0, 40.0]
    assert mem.mail[1, 0, 0].item() == 10.0 and mem.mail_ts[1, 1:].isinf().all()


@pytest.mark.parametrize("keep", [4, 2])
def test_mail_delivery_in_one_write_equals_rounds_of_ring_appends(keep):
    """``LocalMemory.deliver_mails`` writes every kept delivery at once; it leaves the rings, their
    times and heads exactly as ``keep`` rounds of ``write_mail`` do, over batches that wrap the
    rings, give some recipients more mails than a ring keeps, and order deliveries by time. Given
    the recipients and their order as host arrays (the trainer's way: the kept deliveries are
    found on the host, no read of the device), both write the same."""
    from tgdist.memory.store import MemoryStore

    gen = torch.Generator().manual_seed(0)
    one, rounds, host, host_rounds = (LocalMemory(num_nodes=30, mem_dim=1, mail_dim=3, mailbox_size=4)
                                      for _ in range(4))
    for batch in range(6):
        n = 80
        ids = torch.randint(0, 30, (n,), generator=gen)
        order = torch.randperm(n, generator=gen).to(torch.float64)
        table = torch.randn(n + 5, 3, generator=gen)  # rows picked by index, as the trainer's mails
        ts = torch.arange(n + 5, dtype=torch.float64) + 100 * batch
        index = torch.randperm(n + 5, generator=gen)[:n]
        one.deliver_mails(ids, order, keep, table, ts, index)
        MemoryStore.deliver_mails(rounds, ids, order, keep, table, ts, index)
        host.deliver_mails(ids.numpy(), order.numpy(), keep, table, ts, index)
        MemoryStore.deliver_mails(host_rounds, ids.numpy(), order.numpy(), keep, table, ts, index)
        for name in ("mail", "mail_ts", "head"):
            for other in (rounds, host, host_rounds):
                assert torch.equal(getattr(one, name), getattr(other, name)), (batch, name)
    assert int(torch.bincount(ids, minlength=30).max()) > keep  # some recipient dropped its oldest


@torch.no_grad()
def test_apan_delivers_mails_to_sampled_neighbours():
    # e0: 0-1 at t=1; e1: 2-1 at t=2. In batch 2, root 1's sampled neighbour is node 0.
    g = graph([0, 2], [1, 1], [1, 2], edge_feat=[1.0, 2.0])
    tr = make_trainer(g, name="apan", batch_size=1, mailbox_size=3)
    tr.step(0, 1, np.array([[2]]), train=False)
    tr.step(1, 2, np.array([[0]]), train=False)
    ts0 = tr.memory.mail_ts[0]
    assert sorted(ts0[torch.isfinite(ts0)].tolist()) == [0.0, 1.0]  # its own mail (e0), then 1's mail from e1
    assert tr.memory.mail[0, 1, -1].item() == 2.0  # the delivered mail carries e1's feature


def test_static_memory_gradients_only_for_batch_nodes():
    g = graph([0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], num_nodes=8)
    tr = make_trainer(g, batch_size=4, static_memory=True)
    tr.step(0, 4, np.array([[5], [5], [5], [5]]), train=True)
    grad = tr.model.static.weight.grad
    touched = grad.abs().sum(1) > 0
    assert touched[[0, 1, 2, 3, 4, 5]].all()  # roots (src, dst, negative 5); their neighbours are among them
    assert not touched[[6, 7]].any()


def test_split_attention_equals_concatenated_per_pair_computation():
    """W [h || e || phi(dt)] computed per (root, neighbour) pair equals the split, deduplicated form."""
    torch.manual_seed(0)
    n, k, d, de, dtm = 5, 3, 4, 2, 6
    layer = TemporalAttentionLayer(d, de, dtm, d, num_heads=2, dropout=0.0)
    h_table = torch.randn(7, d)
    nbr = torch.randint(0, 7, (n, k))
    mask = torch.rand(n, k) > 0.3
    mask[0] = False  # a root without neighbours
    dt = torch.randint(0, 4, (n, k)).float()  # repeated gaps, so dedup matters
    ef = torch.randn(n, k, de)
    h_query = torch.randn(n, d)
    dt_values, dt_index = torch.unique(dt, return_inverse=True)
    hop = HopTables(nbr, mask, dt_index, dt_values, torch.arange(n * k).view(n, k), ef.view(n * k, de))
    got = layer(h_query, layer.kv_h(h_table), hop)

    # naive: one concatenated linear map per pair, then masked softmax attention per head
    w = torch.cat([layer.kv_h.weight, layer.kv_e.weight, layer.kv_t.weight], dim=1)
    x = torch.cat([h_table[nbr], ef, layer.time_enc(dt)], dim=2)
    kv = x @ w.T + layer.kv_h.bias
    kk, vv = kv.chunk(2, dim=2)
    q = h_query @ layer.q_h.weight.T + layer.q_h.bias + layer.time_enc(torch.zeros(1)) @ layer.q_t.weight.T
    out = torch.zeros(n, d)
    for r in range(n):
        for hd in range(2):
            sl = slice(hd * 2, hd * 2 + 2)
            idx = torch.nonzero(mask[r]).squeeze(1)
            if idx.numel() == 0:
                continue
            s = (kk[r, idx, sl] @ q[r, sl]) / np.sqrt(2)
            out[r, sl] = torch.softmax(s, 0) @ vv[r, idx, sl]
    want = layer.norm(torch.relu(layer.out(torch.cat([out, h_query], dim=1))))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tgn", "jodie", "apan"])
def test_each_model_trains_a_step_and_writes_memory(name):
    g = graph([0, 1, 2, 0, 1, 2], [1, 2, 0, 2, 0, 1], [1, 2, 3, 4, 5, 6], edge_feat=np.arange(6.0))
    tr = make_trainer(g, name=name, batch_size=3)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.step(0, 3, np.array([[2], [0], [1]]), train=True)
    out = tr.step(3, 6, np.array([[0], [1], [2]]), train=True)
    assert np.isfinite(out.loss)
    assert tr.memory.mem.abs().sum() > 0
    changed = sum(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    assert changed > 0


@pytest.mark.parametrize("edge_dim", [0, 3])
def test_fused_cpu_attention_equals_torch_formulation(edge_dim):
    """The numba kernel (CPU default) and the torch gather formulation (GPU path): same outputs
    and same gradients for every input and parameter."""
    torch.manual_seed(0)
    n, k, d = 50, 7, 8
    layer = TemporalAttentionLayer(d, edge_dim, 6, d, num_heads=2, dropout=0.0)
    h_table = torch.randn(20, d, requires_grad=True)
    h_query = torch.randn(n, d, requires_grad=True)
    mask = torch.rand(n, k) > 0.3
    mask[0] = False
    dt_values, dt_index = torch.unique(torch.randint(0, 5, (n, k)).float(), return_inverse=True)
    hop = HopTables(torch.randint(0, 20, (n, k)), mask, dt_index, dt_values,
                    torch.randint(0, 9, (n, k)) if edge_dim else None, torch.randn(9, edge_dim) if edge_dim else None)
    weight = torch.randn(n, d)
    results = []
    for fused in (False, True):
        use_cpu_kernels(layer, fused)
        for t in [h_table, h_query, *layer.parameters()]:
            t.grad = None
        out = layer(h_query, layer.kv_h(h_table), hop)
        (out * weight).sum().backward()
        results.append([out.detach(), h_table.grad, h_query.grad, *[p.grad for p in layer.parameters()]])
    for a, b in zip(*results):
        if a is None:
            assert b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
