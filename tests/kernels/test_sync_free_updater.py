"""The memory updaters' formulation without reads of device values (issue 53.5) against the plain
one that asks the device which rows have a mail: values and gradients, rows without a mail, a
batch without any; and the training loss kept on the device sums as Python's floats did."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tgdist.memory.store import MemoryRead
from tgdist.models.modules import build_model, use_cpu_kernels, use_sync_free

aten = torch.ops.aten
# what waits for a GPU: a scalar read, and outputs whose shape depends on the data
READS = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.equal}


class Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in READS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def case(name, mails, seed=0):
    """An updater and a read of 300 nodes; ``mails``: "some" (every 5th without), "none", "all".
    APAN's mailbox has 4 slots, some of them empty in every row that has a mail."""
    torch.manual_seed(seed)
    n, d = 300, 16
    slots = 4 if name == "apan" else 1
    model = build_model(name, num_nodes=n, mem_dim=d, time_dim=8, edge_dim=3, mailbox_size=slots)
    mem = torch.randn(n, d)
    mail = torch.randn(n, slots, model.mail_dim)
    mem_ts = torch.rand(n, dtype=torch.float64) * 100
    mail_ts = mem_ts.unsqueeze(1) + torch.rand(n, slots, dtype=torch.float64) * 50
    if slots > 1:  # rows with 1 .. slots mails
        empty = torch.arange(slots) >= torch.randint(1, slots + 1, (n, 1))
        mail_ts[empty], mail[empty] = float("-inf"), 0.0
    if mails == "some":
        mail_ts[::5] = float("-inf")
        mail[::5] = 0.0  # as the store keeps an empty slot
    elif mails == "none":
        mail_ts[:] = float("-inf")
        mail[:] = 0.0
    return model.updater, mem, mem_ts, mail, mail_ts


def run(updater, mem, mem_ts, mail, mail_ts, sync_free, mem_grad, fused=False):
    upd = copy.deepcopy(updater)
    use_cpu_kernels(upd, fused)  # the plain formulation, as a GPU runs it (APAN's fused one runs on any device)
    use_sync_free(upd, sync_free)
    leaf = mem.clone().requires_grad_(mem_grad)
    reads = Reads()
    with reads:
        out = upd(MemoryRead(leaf, mem_ts, mail, mail_ts, empty=False))  # the store cannot say more
        weights = torch.linspace(-1, 1, out.mem.numel()).view_as(out.mem)
        if out.mem.requires_grad:  # (not where no row has a mail and the memory is a stored value)
            (out.mem * weights).sum().backward()
    grads = [p.grad for p in upd.parameters()] + ([leaf.grad] if mem_grad else [])
    return out, grads, reads.seen


@pytest.mark.parametrize("mem_grad", [False, True])
@pytest.mark.parametrize("mails", ["some", "all", "none"])
@pytest.mark.parametrize("name, fused", [("tgn", False), ("jodie", False), ("apan", False), ("apan", True)])
def test_the_sync_free_update_equals_the_plain_one_in_values_and_gradients(name, fused, mails, mem_grad):
    args = case(name, mails)
    (plain, g_plain, r_plain), (free, g_free, r_free) = (run(*args, sync_free=s, mem_grad=mem_grad, fused=fused)
                                                         for s in (False, True))
    assert r_free == []  # nothing waits for the device, forward and backward
    assert r_plain  # the plain formulation asks the device (the measure sees its reads)
    torch.testing.assert_close(free.mem, plain.mem, rtol=1e-6, atol=1e-6)
    assert torch.equal(free.mem_ts, plain.mem_ts) and torch.equal(free.updated, plain.updated)
    mem, has = args[1], torch.isfinite(args[4]).any(1)
    assert torch.equal(free.mem[~has], mem[~has])  # rows without a mail keep their memory exactly
    for a, b in zip(g_plain, g_free):
        assert b is not None and bool(torch.isfinite(b).all())  # no NaN from the rows without a mail
        if a is None:  # no mail at all: the plain path leaves the parameters without a gradient
            assert mails == "none" and not bool(b.any())
        else:  # float32 sums over the rows in another order: float rounding (gradients of order 10)
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * max(1.0, float(a.abs().max())))


def test_a_store_that_does_not_say_keeps_the_reads():
    """``MemoryRead.empty`` None (a store that does not track it): the reading path, as before."""
    updater, mem, mem_ts, mail, mail_ts = case("tgn", "none")
    upd = copy.deepcopy(updater)
    use_cpu_kernels(upd, False)
    use_sync_free(upd, True)
    reads = Reads()
    with reads:
        out = upd(MemoryRead(mem, mem_ts, mail, mail_ts))
    assert reads.seen and out.mem is mem
    with reads:  # known empty: the memory as it is, and no read
        reads.seen.clear()
        out = upd(MemoryRead(mem, mem_ts, mail, mail_ts, empty=True))
    assert reads.seen == [] and out.mem is mem and out.mem_ts is mem_ts and not bool(out.updated.any())


def test_local_memory_knows_its_mailbox_is_unwritten_until_a_write():
    from tgdist.memory.store import LocalMemory

    m = LocalMemory(10, 4, 6)
    ids = torch.tensor([1, 3])
    assert m.read(ids).empty is True
    m = m.to(torch.float64)  # new buffers, the same values
    assert m.read(ids).empty is True
    m.write_mail(ids, torch.ones(2, 6), torch.tensor([1.0, 2.0]))
    assert m.read(ids).empty is False
    m.reset_state()
    assert m.read(ids).empty is True
    m.mail_ts[5, 0] = 3.0  # any in-place write, whoever makes it
    assert m.read(ids).empty is False
    m.reset_state()
    m.deliver_mails(ids, torch.tensor([0, 1]), 1, torch.ones(2, 6), torch.tensor([1.0, 2.0]), torch.tensor([0, 1]))
    assert m.read(ids).empty is False
    m.reset_state()
    m.load_state_dict(LocalMemory(10, 4, 6).state_dict())  # a checkpoint's mails, whatever they are
    assert m.read(ids).empty is False
    m.reset_state()
    m.mail_ts = torch.full((10, 1), float("-inf"), dtype=torch.float64)  # a replaced buffer is not known
    assert m.read(ids).empty is False


def test_the_cpu_kernels_path_is_taken_first():
    """``sync_free`` changes nothing where the fused CPU kernels run (the CPU's default)."""
    updater, mem, mem_ts, mail, mail_ts = case("tgn", "some")
    outs = []
    for s in (False, True):
        upd = copy.deepcopy(updater)
        use_sync_free(upd, s)
        with torch.no_grad():
            outs.append(upd(MemoryRead(mem, mem_ts, mail, mail_ts, empty=False)).mem)
    assert torch.equal(outs[0], outs[1])


def test_a_float64_device_sum_of_float32_losses_equals_pythons_float_sum():
    """The trainer keeps a step's loss on the device in float64 and the run sums ``loss * events``
    there: the same bits as the Python floats it replaces (float64 operations in the same order)."""
    g = torch.Generator().manual_seed(5)
    losses = (torch.rand(2000, generator=g) * 3).float()
    events = torch.randint(1, 700, (2000,), generator=g).tolist()
    py_total, dev_total = 0.0, 0.0
    for l32, n in zip(losses, events):
        py_total += float(l32) * n
        dev_total += l32.double() * n
    assert isinstance(dev_total, torch.Tensor) and float(dev_total) == py_total
    assert float(dev_total) / 2000 == py_total / 2000
    parts = losses[:7] * 0.37  # micro-batches' weighted losses, float32
    py_sum, dev_sum = 0.0, None
    for q in parts:
        py_sum += float(q)
        dev_sum = q.double() if dev_sum is None else dev_sum + q.double()
    assert float(dev_sum) == py_sum
