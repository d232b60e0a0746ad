"""The numba CPU kernels against the torch ops they replace: values, gradients, and results that
do not depend on the number of threads."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from tgdist.kernels import cpu_ops
from tgdist.models.modules import (
    HopTables,
    TemporalAttentionLayer,
    TimeEncoder,
    use_cpu_kernels,
)


def exact_phases(enc, bias=True, seed=0):
    """Frequencies 2**-k and biases in steps of 1/16: with the gaps below, every phase w dt + b
    is exact in float32, so a float64 run computes the same function and its difference from a
    float32 run is float32 rounding alone."""
    dim = enc.w.shape[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        enc.w.copy_(2.0 ** -torch.linspace(0, 20, dim).round())
        enc.b.copy_((torch.randn(dim, generator=g) * 8).round() / 16 if bias else torch.zeros(dim))


def time_gaps(n, seed=0, large=False):
    """Integer gaps below 2**19 (with a bias, 24 significant bits at most); ``large``: gaps up to
    2**30 with 24 significant bits, whose phases take torch's slow cos path and the kernel's range
    reduction (use without a bias)."""
    g = torch.Generator().manual_seed(seed)
    if large:
        return torch.randint(0, 2**24, (n,), generator=g).float() * 2.0 ** torch.randint(0, 7, (n,), generator=g)
    return torch.randint(0, 2**19, (n,), generator=g).float()


def assert_as_accurate_as_torch(got, torch_float32, exact, slack=4.0):
    """Sums over thousands of terms of both signs (w's gradient sums g sin(w dt + b) dt) differ
    between two float32 summation orders by far more than 1e-5 relative: compare each result
    against a float64 run of the same function instead, and require the kernel's error to be of
    the size of torch's own."""
    for a, b, ref in zip(got, torch_float32, exact):
        if ref is None:
            assert a is None and b is None
            continue
        err_torch = float((b.double() - ref).abs().max())
        err_got = float((a.double() - ref).abs().max())
        floor = 1e-6 * max(1.0, float(ref.abs().max()))
        assert err_got <= slack * err_torch + floor, (err_got, err_torch, floor)


@pytest.mark.parametrize("large", [False, True])
def test_time_encoding_equals_torch_in_values_and_gradients(large):
    torch.manual_seed(0)
    enc = TimeEncoder(100)
    exact_phases(enc, bias=not large)
    dt = time_gaps(3000, large=large)
    weight = torch.randn(dt.shape[0], 100)

    def run(fused, dtype=torch.float32):
        e = copy.deepcopy(enc).to(dtype)
        e.fused = fused
        out = e(dt.to(dtype))
        (out * weight.to(dtype)).sum().backward()
        return [out.detach(), e.w.grad, e.b.grad]

    got, want, exact = run(True), run(False), run(False, torch.float64)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-7)
    torch.testing.assert_close(got[0].double(), exact[0], rtol=0, atol=2e-7)
    assert_as_accurate_as_torch(got, want, exact)


def test_time_encoding_keeps_shape_and_handles_small_inputs():
    enc = TimeEncoder(8)
    for shape in [(0,), (1,), (3, 5)]:
        dt = torch.rand(shape) * 100
        torch.testing.assert_close(enc(dt), torch.cos(torch.addcmul(enc.b, dt.unsqueeze(-1), enc.w)),
                                   rtol=0, atol=2e-7)


def test_time_encoding_keeps_the_quadrant_of_phases_past_two_to_the_31():
    """Gaps of decades in milliseconds give phases whose count of pi/2 steps overflows 32 bits;
    the quadrant must still come out right (compared with float64 cos/sin of the same float32
    phase, which is what torch's addcmul rounds to)."""
    enc = TimeEncoder(100)
    dt = torch.tensor([3e9, 7.5e10, 1e12, 1e15])
    got = enc(dt).double()
    phase = torch.addcmul(enc.b, dt.unsqueeze(-1), enc.w).double()
    torch.testing.assert_close(got, torch.cos(phase), rtol=0, atol=2e-7)


def test_time_encoding_keeps_the_quadrant_where_numba_builds_without_fma():
    """The test above in a process whose numba builds for a generic CPU (no fused multiply-add):
    there the fast reduction is 0.05 off beyond ``_EXACT_PHASE``, so only the kernel's libm pass
    over those phases keeps it right. On this machine's CPU the fast path alone passes, so
    without this run nothing in the suite needs that pass. The child compiles only the
    time encoding's row kernel (four gaps: below the parallel size) and reads it from numba's
    cache after the first run (the cache keys an entry by the CPU it was built for)."""
    code = ("import numba; assert numba.config.CPU_NAME == 'generic', numba.config.CPU_NAME\n"
            "from tests.kernels.test_cpu_ops import test_time_encoding_keeps_the_quadrant_of_phases_past_two_to_the_31 "
            "as check\ncheck()\nprint('generic ok')")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and r.stdout.strip() == "generic ok", r.stderr[-3000:]


def test_dropout_masks_scale_and_backward():
    torch.manual_seed(0)
    x = torch.randn(500, 40, requires_grad=True)
    y = cpu_ops.dropout(x, 0.3, True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(y[kept], x[kept] / 0.7)
    y.sum().backward()
    # the gradient goes through exactly the kept entries, with the same scale
    torch.testing.assert_close(x.grad, kept.float() / 0.7)
    assert cpu_ops.dropout(x, 0.3, False) is x
    assert torch.equal(cpu_ops.dropout(x, 1.0, True), torch.zeros_like(x))


def test_dropout_mask_follows_torch_seed():
    x = torch.ones(100, 10)
    torch.manual_seed(5)
    a = cpu_ops.dropout(x, 0.5, True)
    b = cpu_ops.dropout(x, 0.5, True)
    torch.manual_seed(5)
    assert torch.equal(cpu_ops.dropout(x, 0.5, True), a)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("p, training", [(0.3, True), (0.3, False), (0.0, True), (1.0, True)])
def test_relu_dropout_layer_norm_equals_the_three_ops(p, training):
    """The attention layer's fused output step gives ``norm(relu(dropout(a)))`` of the separate
    CPU ops under the same torch seed (the same mask), in values and in the gradients of ``a`` and
    the norm's weight and bias, each as close to a float64 run (with that mask) as the ops are."""
    torch.manual_seed(0)
    a = torch.randn(700, 100) * 2
    norm = torch.nn.LayerNorm(100)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    weight = torch.randn(700, 100)

    def run(fn, dtype=torch.float32):
        n = copy.deepcopy(norm).to(dtype)
        x = a.to(dtype).clone().requires_grad_()
        torch.manual_seed(7)
        out = fn(x, n)
        (out * weight.to(dtype)).sum().backward()
        return [out.detach(), x.grad, n.weight.grad, n.bias.grad]

    torch.manual_seed(7)
    mask = cpu_ops.dropout(torch.ones(700, 100), p, training)  # the mask (times scale) both paths draw
    ops = run(lambda x, n: n(torch.relu(cpu_ops.dropout(x, p, training))))
    fused = run(lambda x, n: cpu_ops.relu_dropout_layer_norm(x, p, training, n))
    exact = run(lambda x, n: n(torch.relu(x * mask.double())), torch.float64)
    torch.testing.assert_close(fused[0], ops[0], rtol=1e-5, atol=1e-5)
    assert_as_accurate_as_torch(fused, ops, exact)
    if 0 < p < 1 and training:
        assert 0.25 < float((mask == 0).float().mean()) < 0.35


def attention_case(edge_dim, n=300, k=10, d=16, num_nodes=80, seed=0):
    torch.manual_seed(seed)
    layer = TemporalAttentionLayer(d, edge_dim, 12, d, num_heads=2, dropout=0.0)
    exact_phases(layer.time_enc, seed=seed)
    mask = torch.rand(n, k) > 0.2
    mask[:3] = False
    dt_values, dt_index = torch.unique(time_gaps(n * k, seed).view(n, k), return_inverse=True)
    hop = HopTables(torch.randint(0, num_nodes, (n, k)), mask, dt_index, dt_values,
                    torch.randint(0, 50, (n, k)) if edge_dim else None, torch.randn(50, edge_dim) if edge_dim else None)
    return layer, torch.randn(num_nodes, d, requires_grad=True), torch.randn(n, d, requires_grad=True), hop


def run_layer(layer, h_table, h_query, hop, dtype=torch.float32, edge_grad=False, index=None):
    layer = copy.deepcopy(layer).to(dtype)
    h_table = h_table.detach().to(dtype).requires_grad_()
    h_query = h_query.detach().to(dtype).requires_grad_()
    edge_feat = None if hop.edge_feat is None else hop.edge_feat.detach().to(dtype).requires_grad_(edge_grad)
    hop = HopTables(hop.nbr, hop.mask, hop.dt_index, hop.dt_values.to(dtype), hop.edge_index, edge_feat)
    out = layer(h_query, layer.kv_h(h_table), hop, index)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype)).sum().backward()
    extra = [edge_feat.grad] if edge_grad else []
    return [out.detach(), h_table.grad, h_query.grad, *extra, *[p.grad for p in layer.parameters()]]


@pytest.mark.parametrize("edge_dim, edge_grad", [(0, False), (5, False), (5, True)])
def test_cpu_attention_layer_equals_torch_at_scale(edge_dim, edge_grad):
    """Many roots, ten neighbours, masked rows and gaps of every size: the numba layer (kernels,
    time encoding) gives the torch formulation's outputs and gradients (edge features included,
    for inputs that carry a gradient)."""
    layer, h_table, h_query, hop = attention_case(edge_dim)
    use_cpu_kernels(layer, False)
    want = run_layer(layer, h_table, h_query, hop, edge_grad=edge_grad)
    exact = run_layer(layer, h_table, h_query, hop, torch.float64, edge_grad=edge_grad)
    use_cpu_kernels(layer, True)
    got = run_layer(layer, h_table, h_query, hop, edge_grad=edge_grad)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert_as_accurate_as_torch(got, want, exact)


@pytest.mark.parametrize("kernels", [True, False])
def test_queries_by_index_equal_queries_by_row(kernels):
    """Query terms computed once per table row and gathered by ``index`` (the trainer's path:
    1,800 roots, ~700 distinct root nodes) give the outputs and gradients of the same queries
    passed row by row."""
    layer, h_table, _, hop = attention_case(5)
    use_cpu_kernels(layer, kernels)
    n = hop.nbr.shape[0]
    index = torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(1))
    queries = torch.randn(50, h_table.shape[1])  # rows 40.. are never asked for
    by_row = run_layer(layer, h_table, queries[index], hop, edge_grad=True)
    by_index = run_layer(layer, h_table, queries, hop, edge_grad=True, index=index)
    exact = run_layer(layer, h_table, queries, hop, torch.float64, edge_grad=True, index=index)
    assert by_index[2].shape == queries.shape and not by_index[2][40:].any()
    by_row[2] = torch.zeros_like(queries).index_add_(0, index, by_row[2])  # per-row grads summed per node
    torch.testing.assert_close(by_index[0], by_row[0], rtol=1e-5, atol=1e-6)
    assert_as_accurate_as_torch(by_index, by_row, exact)


def test_cpu_kernels_do_not_depend_on_the_thread_count():
    layer, h_table, h_query, hop = attention_case(5)
    use_cpu_kernels(layer, True)
    before = numba.get_num_threads()
    results = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            results.append(run_layer(layer, h_table, h_query, hop, edge_grad=True))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


def test_gru_gate_sigmoid_and_tanh_are_within_a_few_ulp():
    """The GRU kernel's own sigmoid and tanh (vectorised, no libm calls) against float64, over
    saturation, |x| near 0 (where tanh must keep its relative precision) and signed zeros."""
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-8, 87.5, -87.5, 1e4, -1e4, 5e-5, 0.34657, 0.34658])
    x = torch.cat([special, torch.linspace(-100, 100, 40_001), torch.randn(20_000) * 1e-3, torch.randn(20_000) * 4])
    d = 16
    x = torch.cat([x, torch.zeros(-x.numel() % d)]).view(-1, d)
    gx = torch.cat([x, x, x], 1)  # r, z and n columns all x; zero hidden map and memory
    gh, h = torch.zeros_like(gx), torch.zeros_like(x)
    rz, n, out = torch.empty(x.shape[0], 2 * d), torch.empty_like(x), torch.empty_like(x)
    cpu_ops._gru_gates(gx.numpy(), gh.numpy(), h.numpy(), False, rz.numpy(), n.numpy(), out.numpy(), 64)
    xd = x.double()
    for got, want in ((rz[:, :d], torch.sigmoid(xd)), (rz[:, d:], torch.sigmoid(xd)), (n, torch.tanh(xd))):
        ulp = torch.from_numpy(np.spacing(want.float().abs().numpy())).double()
        err = (got.double() - want).abs()
        assert bool((err <= 4 * ulp + 1e-37).all()), float((err / ulp).max())
    head = n.view(-1)[:4]
    assert head[:2].tolist() == [0.0, 0.0] and head[2] > 0 and head[3] < 0  # tanh keeps tiny signs
    torch.testing.assert_close(out, n * (1 - rz[:, d:]), rtol=1e-6, atol=1e-7)  # out = n + z (h - n), h = 0


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("name, edge_dim", [("tgn", 0), ("tgn", 3), ("jodie", 0)])
def test_cpu_cell_equals_the_torch_cell(name, edge_dim, own):
    """The CPU cells (GRU: hand-written backward) give the torch formulation's updated memory and
    parameter gradients (float64 run as the accuracy yardstick), for any mail and for TGN's mails,
    which start with the memory they update (``own``: merged products)."""
    from tgdist.memory.store import MemoryRead
    from tgdist.models.modules import build_model

    torch.manual_seed(3)
    n, d = 500, 16
    model = build_model(name, num_nodes=n, mem_dim=d, time_dim=8, edge_dim=edge_dim)
    exact_phases(model.updater.time_enc)
    mem = torch.randn(n, d)
    mail = torch.cat([mem if own else torch.randn(n, d), torch.randn(n, model.mail_dim - d)], 1).unsqueeze(1)
    mem_ts = torch.rand(n, dtype=torch.float64) * 100
    mail_ts = (mem_ts + time_gaps(n).double()).unsqueeze(1)
    mail_ts[::7] = float("-inf")  # some nodes have no pending mail

    def run(fused, dtype=torch.float32):
        upd = copy.deepcopy(model.updater).to(dtype)
        use_cpu_kernels(upd, fused)
        read = MemoryRead(mem.to(dtype), mem_ts, mail.to(dtype), mail_ts)
        out = upd(read).mem
        (out * torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype)).sum().backward()
        return [out.detach(), *[p.grad for p in upd.parameters()]]

    general, merged, exact = run(False), run(True), run(False, torch.float64)
    torch.testing.assert_close(merged[0], general[0], rtol=1e-5, atol=1e-6)
    assert_as_accurate_as_torch(merged, general, exact)


def test_apan_projected_mailbox_attention_equals_the_plain_formulation():
    """APAN's mailbox attention with the key/value map on the query side gives the plain
    formulation's updated memory and parameter gradients (float64 run as the yardstick), with
    partly filled mailboxes and nodes without mail. The key bias is left out (it cancels in the
    softmax): its gradient is exactly 0, where the plain formulation's is rounding noise."""
    from tgdist.memory.store import MemoryRead
    from tgdist.models.modules import build_model

    torch.manual_seed(5)
    n, d, slots = 400, 16, 4
    model = build_model("apan", num_nodes=n, mem_dim=d, time_dim=8, edge_dim=3, mailbox_size=slots)
    exact_phases(model.updater.time_enc)
    with torch.no_grad():
        model.updater.kv.bias.normal_()  # a key bias that would matter if it did not cancel
    mem, mail = torch.randn(n, d), torch.randn(n, slots, model.mail_dim)
    mem_ts = torch.rand(n, dtype=torch.float64) * 100
    mail_ts = mem_ts[:, None] + time_gaps(n * slots).double().view(n, slots)
    mail_ts[torch.rand(n, slots) < 0.4] = float("-inf")  # partly filled mailboxes
    mail_ts[::9] = float("-inf")  # and nodes with no mail at all
    assert 0 < int(torch.isfinite(mail_ts).any(1).sum()) < n

    def run(projected, dtype=torch.float32):
        upd = copy.deepcopy(model.updater).to(dtype)
        upd.fused = projected
        out = upd(MemoryRead(mem.to(dtype), mem_ts, mail.to(dtype), mail_ts)).mem
        (out * torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype)).sum().backward()
        return [out.detach(), *[p.grad for p in upd.parameters()]]

    plain, projected, exact = run(False), run(True), run(False, torch.float64)
    torch.testing.assert_close(projected[0], plain[0], rtol=1e-5, atol=1e-5)
    assert_as_accurate_as_torch(projected, plain, exact)
    names = [name for name, _ in model.updater.named_parameters()]
    key_bias = projected[1 + names.index("kv.bias")][:d]
    assert torch.equal(key_bias, torch.zeros(d)) and float(plain[1 + names.index("kv.bias")][:d].abs().max()) > 0
