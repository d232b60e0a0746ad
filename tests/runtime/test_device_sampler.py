"""The recent sampler on the trainer's device and evaluation read back once (issue 53).

``DeviceSampler`` must write what ``kernels.sample_recent`` writes, slot for slot; a trainer that
uses it (``sampler.on_device=true``; a GPU's default where it applies) has a node table without
dedup, which must give the scores the host's tables give: bit for bit in evaluation from the same
state, and training steps within float rounding (a node used twice is updated in two rows, so the
parameters' gradients are summed in another order). Evaluation keeps its scores on the device and
reads its metrics back once.
"""

from __future__ import annotations

import functools
import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.data.test_sampler import make_graph, random_graph, small
from tests.device_shim import ShimDevice
from tgdist.data.device_sampler import DeviceSampler
from tgdist.data.sampler import TCSR, TemporalSampler
from tgdist.errors import ConfigError
from tgdist.models.modules import use_sync_free
from tgdist.runtime.build import build_trainer, compose

TINY = ["data=synthetic", "data.synthetic.num_events=1200", "data.synthetic.num_nodes=60", "model.mem_dim=8",
        "model.time_dim=8", "model.dropout=0", "model.cpu_kernels=false", "train.batch_size=100",
        "train.num_neg_eval=9", "train.num_threads=1", "sampler.num_threads=1", "train.progress=false"]


def _same_hops(graph, fanouts, roots, root_t):
    host = TemporalSampler(TCSR.build(graph), fanouts).sample(roots, root_t)
    dev = DeviceSampler(TCSR.build(graph), fanouts, "cpu").sample(torch.from_numpy(roots),
                                                                   torch.from_numpy(root_t.astype(graph.t.dtype)))
    assert len(host) == len(dev) == len(fanouts)
    for h, d in zip(host, dev):
        for name in ("nbr", "eid", "t", "mask", "dt"):
            a, b = getattr(h, name), getattr(d, name).numpy()
            assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_the_device_sampler_writes_the_host_samplers_slots():
    """Small graph: ties in time (events 1 and 2 at t=2), a node without events, a padded root
    (-1), a root before every event and after the last; two hops (the second from padded slots)."""
    g = small()
    roots = np.array([0, 1, 2, 3, -1, 0, 2, 1], dtype=np.int64)
    root_t = np.array([3, 3, 2, 9, 4, 1, 6, 2], dtype=np.int64)
    _same_hops(g, [3, 2], roots, root_t)
    for seed in range(3):
        r = random_graph(seed)
        rng = np.random.default_rng(seed)
        _same_hops(r, [4, 3], rng.integers(-1, r.num_nodes, 300), rng.integers(0, 60, 300))


def test_the_device_sampler_on_float_times_and_real_data():
    """Float times with ties and negative values, and CollegeMsg's first 5,000 events."""
    rng = np.random.default_rng(7)
    t = np.sort(rng.choice(np.array([-2.5, 0.0, 0.25, 1.0, 1e9]), 300)).astype(np.float64)
    g = make_graph(rng.integers(0, 20, 300), rng.integers(0, 20, 300), t, num_nodes=22)
    _same_hops(g, [5], rng.integers(-1, 22, 200), rng.choice(np.r_[t, -3.0, 2e9], 200))
    cfg = compose(["data=collegemsg", "data.max_events=5000"])
    from tgdist.data.load import load_data

    cm = load_data(cfg.data)
    idx = rng.integers(0, 5000, 2000)
    _same_hops(cm, [10, 5], np.r_[cm.src[idx], cm.dst[idx]], np.r_[cm.t[idx], cm.t[idx]])


def _pair(extra=()):
    host = build_trainer(compose([*TINY, "sampler.on_device=false", *extra]), progress=False)
    dev = build_trainer(compose([*TINY, "sampler.on_device=true", *extra]), progress=False)
    assert host.device_sampler is None and dev.device_sampler is not None
    dev.model.load_state_dict(host.model.state_dict())
    return host, dev


@pytest.mark.parametrize("extra, every_node", [
    ((), True), (("data.synthetic.num_nodes=20000",), False), (("model.num_layers=2",), True)],
    ids=["tgn-every-node", "tgn-slots", "tgn-2-layers"])
def test_a_trainer_on_the_device_sampler_scores_as_the_hosts(extra, every_node):
    """Training steps agree to float rounding, and evaluation from the same state (parameters and
    memory copied over) is the same bits: scores, metrics and the memory it leaves. Both node
    tables: every node (60 nodes, fewer than a batch's roots and slots) and the slots as they are
    (20,000 nodes)."""
    host, dev = _pair(extra)
    s, e = next(host.batches("train"))
    table = dev.sample(s, e, host.negatives.fixed("val", s, e, 1)).ids
    assert torch.equal(table, torch.arange(dev.g.num_nodes)) == every_node
    for s, e in list(host.batches("train"))[:4]:
        neg = host.negatives.train(e - s, 1)
        a, b = host.step(s, e, neg, train=True), dev.step(s, e, neg, train=True)
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(a.pos, b.pos, rtol=1e-4, atol=1e-5)
    dev.model.load_state_dict(host.model.state_dict())
    dev.memory.load_state_dict(host.memory.state_dict())
    for s, e in list(host.batches("val"))[:2]:
        neg = host.negatives.fixed("val", s, e, 9)
        (pa, na), (pb, nb) = host.eval_step(s, e, neg), dev.eval_step(s, e, neg)
        assert np.array_equal(pa, pb) and np.array_equal(na, nb)
    np.testing.assert_equal(host.evaluate("test"), dev.evaluate("test"))  # (NaN equal to NaN)
    for k, v in host.memory.state_dict().items():
        assert torch.equal(v, dev.memory.state_dict()[k]), k
    nodes = np.arange(10)
    times = np.full(10, host.g.t[-1])
    assert torch.equal(host.embed(nodes, times), dev.embed(nodes, times))


@pytest.mark.parametrize("extra, reason", [
    (["model=apan"], "model=apan delivers mails to sampled neighbours on the host"),
    (["sampler.strategy=uniform"], "sampler.strategy=uniform (the device sampler is recent's)"),
    (["model=tgat2", "cache.enabled=true"], "the embedding cache (cache.*) looks up the sampled hops on the host"),
])
def test_the_device_sampler_where_it_does_not_apply(extra, reason, caplog):
    """Required where it cannot serve: one line naming why; by default on the CPU: the host's."""
    with pytest.raises(ConfigError, match="sampler.on_device=true does not apply here: .*" + reason.split(" (")[0]):
        build_trainer(compose([*TINY, "sampler.on_device=true", *extra]), progress=False)
    assert build_trainer(compose([*TINY, *extra]), progress=False).device_sampler is None


class _Reads(TorchFunctionMode):
    """Counts the reads of tensor values into Python or host memory (each waits for a GPU), but
    the one only the CPU makes (the attention's query rows cut at ``index.max()``; a GPU uses the
    whole table)."""

    KINDS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.KINDS and "int(index.max())" not in traceback.extract_stack(limit=2)[0].line:
            self.sites.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_evaluation_reads_its_metrics_back_once():
    """One read for the whole part, whatever its batches (two a batch before); the metrics as the
    NumPy functions give them from the same scores."""
    from tgdist.runtime.metrics import average_precision, reciprocal_ranks, roc_auc

    _, dev = _pair(("data=collegemsg", "data.max_events=3000"))  # (nodes unseen in training: inductive AP)
    use_sync_free(dev.model, True)  # the memory updater as a GPU runs it (a CPU asks which rows have a mail)
    lo, hi = dev.split.range("val")
    assert len(list(dev.batches("val"))) > 1
    state = {k: v.clone() for k, v in dev.memory.state_dict().items()}
    with _Reads() as reads:
        res = dev.evaluate("val")
    assert reads.sites == ["tolist"]
    dev.memory.load_state_dict(state)
    pos, neg = zip(*(dev.eval_step(s, e, dev.negatives.fixed("val", s, e, 9)) for s, e in dev.batches("val")))
    pos, neg = np.concatenate(pos), np.concatenate(neg)
    y = np.r_[np.ones(len(pos)), np.zeros(len(pos))]
    assert res["val_ap"] == pytest.approx(average_precision(y, np.r_[pos, neg[:, 0]]), abs=1e-12)
    assert res["val_auc"] == pytest.approx(roc_auc(y, np.r_[pos, neg[:, 0]]), abs=1e-12)
    assert res["val_mrr"] == pytest.approx(float(np.mean(reciprocal_ranks(pos, neg))), abs=1e-12)
    new = dev.split.new_node_mask[lo:hi]
    assert 0 < new.sum() < len(new)
    yi = np.r_[np.ones(new.sum()), np.zeros(new.sum())]
    assert res["val_ap_inductive"] == pytest.approx(average_precision(yi, np.r_[pos[new], neg[new, 0]]), abs=1e-12)


def test_the_device_sampler_keeps_to_its_device(monkeypatch):
    """On a device that holds values (the shim: a CPU tensor mixed in fails as on a GPU), training
    steps and evaluation run and give the CPU's scores."""
    from tgdist.runtime import trainer as trainer_module

    # fused Adam refuses the meta device; both trainers take the plain loop, so they stay comparable
    monkeypatch.setattr(trainer_module, "adam", lambda params, lr: torch.optim.Adam(list(params), lr=lr))
    cpu = build_trainer(compose([*TINY, "sampler.on_device=true"]), progress=False)
    with ShimDevice():
        other = build_trainer(compose([*TINY, "sampler.on_device=true"]), progress=False, device="meta")
        assert other.device_sampler.key.device.type == "meta"
        for s, e in list(cpu.batches("train"))[:2]:
            neg = cpu.negatives.train(e - s, 1)
            a, b = cpu.step(s, e, neg, train=True), other.step(s, e, neg, train=True)
            assert a.loss == pytest.approx(b.loss, rel=1e-6)
        got = other.evaluate("val")
    assert got == pytest.approx(cpu.evaluate("val"), rel=1e-6, nan_ok=True)


def test_a_read_saved_under_the_other_sampler_is_refused():
    """A checkpoint's prepared read (epoch parallelism saves them) holds the rows of the node table
    it was made for: given to the other sampler's table, one line says which setting made it."""
    host, dev = _pair()
    s, e = next(host.batches("train"))
    neg = host.negatives.train(e - s, 1)
    read = host.prepare(s, e, neg).read
    assert host.prepare(s, e, neg, read=read).read is read
    with pytest.raises(ConfigError, match=r"made with sampler.on_device=false; resume with that setting"):
        dev.prepare(s, e, neg, read=read)
    with pytest.raises(ConfigError, match=r"made with sampler.on_device=true; resume with that setting"):
        host.prepare(s, e, neg, read=dev.prepare(s, e, neg).read)


def test_null_picks_the_device_sampler_on_a_gpu_unless_deterministic(monkeypatch):
    """``sampler.on_device`` null: the device's sampler where the trainer's device is CUDA, the
    host's on the CPU and under ``train.deterministic=true`` (every store's scores exactly local
    memory's there). The choice alone (no GPU here: the sampler it would build is a stand-in)."""
    from tgdist.runtime import build

    class Chosen(tuple):
        def nbytes(self):
            return 0

    monkeypatch.setattr(build, "DeviceSampler", lambda tcsr, fanouts, dev: Chosen(("device sampler", dev)))
    tr = build_trainer(compose([*TINY]), progress=False)  # a CPU trainer: its parts, to ask about others
    cfg = compose([*TINY])
    choices = build.validate(cfg)
    ask = functools.partial(build.device_sampler, choices=choices, graph=tr.g, model=tr.model, sampler=tr.sampler,
                            cache=None, mem=tr.memory)
    assert ask(cfg, dev="cuda") == ("device sampler", "cuda")
    assert ask(cfg, dev="cpu") is None
    assert ask(compose([*TINY, "train.deterministic=true"]), dev="cuda") is None
    assert ask(compose([*TINY, "sampler.on_device=false"]), dev="cuda") is None
    assert ask(compose([*TINY, "sampler.on_device=true"]), dev="cpu") == ("device sampler", "cpu")
    # features too large for the device stay in host memory: every slot's rows would be gathered there
    featured = build_trainer(compose([*TINY, "data.synthetic.edge_dim=4"]), progress=False)
    monkeypatch.setattr(build, "stays_on_host", lambda a, dev: a is not None and a is featured.g.edge_feat)
    ask = functools.partial(ask, graph=featured.g)
    assert ask(cfg, dev="cuda") is None
    with pytest.raises(ConfigError, match="the features stay in host memory"):
        ask(compose([*TINY, "sampler.on_device=true"]), dev="cuda")


def test_the_advisor_counts_a_batchs_rows_alike_under_either_sampler():
    """``tgdist plan --profile`` prices the partitioned stores by a batch's sampled vertices and
    distinct nodes; the device sampler's table is neither, so they are counted as the host's."""
    from tgdist.launcher.advisor.measure import _rows

    for extra in ((), ("data.synthetic.num_nodes=20000",)):
        host, dev = _pair(extra)
        s, e = next(host.batches("train"))
        neg = host.negatives.train(e - s, 1)
        want = _rows(host, host.prepare(s, e, neg), s, e)
        assert _rows(dev, dev.prepare(s, e, neg), s, e) == want and want[1] < want[0]


def test_the_stores_that_take_repeated_ids():
    """The device sampler serves the stores that read in the trainer's process, row for row
    (local memory, DepCache's replicas); the others send or count the distinct ids."""
    from tgdist import memory
    from tgdist.runtime.build import load_strategies

    load_strategies()
    assert sorted(n for n in memory.names() if memory.store_class(n).reads_repeated_ids) == ["depcache", "local"]


def test_a_run_on_the_device_sampler_resumes_mid_epoch_to_the_same_metrics(tmp_path):
    """A run stopped in its second epoch and resumed from its checkpoint ends with the metrics of
    the uninterrupted run, both through the device sampler (the resume takes the run's settings)."""
    from tests.runtime.runs import metrics, run

    over = ["sampler.on_device=true", "train.epochs=2"]
    full, _ = run(tmp_path, "full", over)
    stopped, d = run(tmp_path, "part", [*over, "train.checkpoint_every=3", "train.stop_after_batches=18"])
    assert stopped["stopped"]
    resumed, _ = run(tmp_path, "resumed", [*over, f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)
