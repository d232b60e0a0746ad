"""Sven's pipelining levels (``tgdist.runtime.pipelines``): each a controlled change of the loop.

Prefetch must leave a run bit-identical; micro-batches must give the parameters of one batch up to
float rounding and exactly its memory and mails; asynchronous all-reduce must follow eq. (13)."""

import math
import threading
import time

import pytest
import torch

from tgdist.data.graph import chronological_split
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.data.synthetic import generate
from tgdist.distributed import collectives
from tgdist.models.modules import build_model
from tgdist.runtime.pipelines.base import GradientHooks, GradientSync, Prefetcher
from tgdist.runtime.pipelines.plain import fit_eta, fit_granularity
from tgdist.runtime.trainer import Trainer, memory_for, micro_bounds

from tests.runtime.runs import SMALL, metrics, run


def trainer_on(g, name, seed=0):
    torch.manual_seed(seed)
    m = build_model(name, num_nodes=g.num_nodes, mem_dim=16, time_dim=8, edge_dim=g.edge_dim, num_heads=2,
                    dropout=0.0, mailbox_size=4 if name == "apan" else 1)
    sampler = TemporalSampler(TCSR.build(g), [5]) if m.num_hops else None
    return Trainer(g, chronological_split(g, 0.15, 0.15), m, memory_for(m, g.num_nodes), sampler,
                   NegativeSampler(g, 0), batch_size=120, lr=1e-3, progress=False)


@pytest.fixture(scope="module")
def small_graph():
    return generate(1500, 60, num_communities=4, edge_dim=4, seed=3)


def test_micro_bounds_cover_the_batch_in_order():
    assert micro_bounds(10, 21, 3) == [(10, 14), (14, 18), (18, 21)]
    assert micro_bounds(0, 2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # empty ones last
    assert micro_bounds(5, 5, 1) == [(5, 5)]


@pytest.mark.parametrize("name", ["tgn", "jodie", "apan"])
@pytest.mark.parametrize("n", [2, 3, 7])
def test_micro_batches_give_one_batch_step(small_graph, name, n):
    """Several iterations, one trainer with whole batches and one with n micro-batches: the
    forward scores agree to rounding, the accumulated gradients equal the batch's to float rounding,
    and memory and mails after the step are identical bit for bit (the write is computed from the
    same reads). The second trainer is reset to the first's state before each step, so rounding
    cannot accumulate across steps.

    Parameters after the step: with SGD they agree to rounding (rtol 1e-5). With Adam the first
    steps move each entry by about lr * g / (|g| + eps), so an entry whose gradient is at rounding
    level (|g| ~ eps = 1e-8) moves by a different fraction of lr: bounded by lr, checked at 0.1 lr."""
    g = small_graph
    a, b = trainer_on(g, name), trainer_on(g, name)
    lo0 = a.split.range("train")[0]
    grads = {}

    def keep(tag):
        def sync(params):
            grads[tag] = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        return sync

    for it in range(4):
        sgd = it % 2 == 1
        if sgd:  # plain SGD on alternate steps: the parameter update is the gradient itself
            a.optimizer = torch.optim.SGD(a.model.parameters(), lr=1e-3)
            b.optimizer = torch.optim.SGD(b.model.parameters(), lr=1e-3)
        else:
            b.optimizer.load_state_dict(a.optimizer.state_dict())
        lo, hi = lo0 + it * 120, lo0 + (it + 1) * 120
        neg = a.negatives.keyed(3, lo, hi, 1)
        b.model.load_state_dict(a.model.state_dict())
        b.memory.load_state_dict(a.memory.state_dict())
        out_a = a.compute(a.prepare(lo, hi, neg), train=True, hooks=GradientHooks(keep("a")))
        out_b = b.compute(b.prepare_micro(lo, hi, neg, n), train=True, hooks=GradientHooks(keep("b")))
        # the same rows through smaller matrix products: equal but for the kernels' summation order
        torch.testing.assert_close(out_b.pos, out_a.pos, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_b.neg, out_a.neg, rtol=1e-5, atol=1e-6)
        assert math.isclose(out_a.loss, out_b.loss, rel_tol=1e-5)
        for (k, _), ga, gb in zip(a.model.named_parameters(), grads["a"], grads["b"]):
            scale = float(ga.abs().max()) + 1e-12
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m: f"{name} n={n} step {it} grad {k}: {m}")
        tol = dict(rtol=1e-5, atol=1e-8) if sgd else dict(rtol=0, atol=1e-4)  # 0.1 lr
        for (k, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            torch.testing.assert_close(pb, pa, **tol, msg=lambda m: f"{name} n={n} step {it} {k}: {m}")
        for k, va in a.memory.state_dict().items():
            assert torch.equal(b.memory.state_dict()[k], va), f"{name} n={n} step {it}: memory {k} differs"


def test_micro_batch_reads_all_precede_the_writes(small_graph):
    """With memory of one process, writes apply at once: every micro-batch must still read the
    memory from before the batch (as one batch does). Compare the reads with the batch's own."""
    tr = trainer_on(small_graph, "tgn")
    lo = tr.split.range("train")[0]
    for it in range(3):  # some memory first
        s, e = lo + it * 120, lo + (it + 1) * 120
        tr.compute(tr.prepare(s, e, tr.negatives.keyed(3, s, e, 1)), train=True)
    s, e = lo + 360, lo + 480
    neg = tr.negatives.keyed(3, s, e, 1)
    whole = tr.prepare(s, e, neg)
    parts = tr.prepare_micro(s, e, neg, 3)
    tr.compute(parts, train=True)
    mem_of = {int(i): whole.read.mem[k] for k, i in enumerate(whole.ids)}
    for q in parts:
        for k, i in enumerate(q.ids):
            assert torch.equal(collectives.resolve(q.read).mem[k], mem_of[int(i)])


# ------------------------------------------------------------------------------------------
# Prefetcher


def test_prefetcher_returns_results_in_order_and_bounds_its_queue():
    made = []

    def make(x):
        made.append(x)
        return x * x

    pf = Prefetcher(make, ((k, k) for k in range(20)), depth=3)
    time.sleep(0.2)
    assert len(made) <= 3 + 1  # queue of 3, and one being made
    assert [pf.get(k) for k in range(20)] == [k * k for k in range(20)]
    pf.close()
    assert not pf.alive


def test_prefetcher_raises_the_workers_error_and_leaks_no_thread():
    def make(x):
        if x == 2:
            raise ValueError("bad batch 2")
        return x

    before = threading.active_count()
    pf = Prefetcher(make, ((k, k) for k in range(5)), depth=2)
    assert pf.get(0) == 0 and pf.get(1) == 1
    with pytest.raises(RuntimeError, match="bad batch 2"):
        pf.get(2)
    pf.close()
    assert threading.active_count() == before


def test_prefetcher_closes_while_its_worker_waits_on_a_full_queue():
    pf = Prefetcher(lambda x: x, ((k, k) for k in range(1000)), depth=1)
    time.sleep(0.1)
    t0 = time.perf_counter()
    pf.close()
    assert not pf.alive and time.perf_counter() - t0 < 2


def test_prefetcher_refuses_an_out_of_order_request():
    pf = Prefetcher(lambda x: x, ((k, k) for k in range(3)), depth=2)
    with pytest.raises(RuntimeError, match="asked for 1 but the next prefetched batch is 0"):
        pf.get(1)
    pf.close()


# ------------------------------------------------------------------------------------------
# Asynchronous all-reduce, eq. (13)


def test_async_allreduce_follows_eq_13_on_one_process():
    """w_{t+1} = w_t - lr * grad(w_{t-1}), w_1 = w_0, and the last gradient applied at the drain,
    against the sequence computed by hand with plain SGD on a quadratic."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    xs = [torch.randn(4, 3) for _ in range(5)]
    sync = GradientSync(stale=True)
    weights = [lin.weight.detach().clone()]
    for x in xs:
        opt.zero_grad(set_to_none=True)
        (lin(x) ** 2).mean().backward()
        if sync(lin.parameters()):
            opt.step()
        weights.append(lin.weight.detach().clone())
    assert sync.drain(lin.parameters())
    opt.step()
    weights.append(lin.weight.detach().clone())

    def grad(w, x):
        w = w.clone().requires_grad_(True)
        ((x @ w.T) ** 2).mean().backward()
        return w.grad

    hand = [weights[0], weights[0].clone()]  # w_1 = w_0: no gradient has arrived yet
    for t in range(1, len(xs)):
        hand.append(hand[t] - 0.1 * grad(hand[t - 1], xs[t - 1]))
    hand.append(hand[-1] - 0.1 * grad(hand[-2], xs[-1]))  # the drain: the last gradient
    assert len(hand) == len(weights)
    for t, (w, h) in enumerate(zip(weights, hand)):
        torch.testing.assert_close(w, h, rtol=1e-6, atol=1e-7, msg=lambda m: f"w_{t}: {m}")


def test_async_allreduce_pending_gradient_survives_a_checkpoint():
    lin = torch.nn.Linear(2, 1)
    sync = GradientSync(stale=True)
    (lin(torch.ones(1, 2)).sum()).backward()
    assert sync(lin.parameters()) is False
    saved = sync.pending()
    other = GradientSync(stale=True)
    other.restore(saved, "cpu")
    assert other.drain(lin.parameters())
    for p, g in zip(lin.parameters(), saved):
        assert torch.equal(p.grad, g)


# ------------------------------------------------------------------------------------------
# Eq. (12)


def test_fit_eta_recovers_a_and_b():
    sizes = [400, 200, 100, 50]
    a, b = fit_eta(sizes, [2.5 + 120.0 / m for m in sizes])
    assert math.isclose(a, 2.5, rel_tol=1e-9) and math.isclose(b, 120.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="two distinct"):
        fit_eta([100, 100], [1.0, 1.0])


def test_granularity_follows_the_cost_model_and_scales_with_the_rows():
    sizes = [400, 200, 100, 50]
    eta = [2.0 + 100.0 / m for m in sizes]
    # dispatch as long as compute (0.1 s), 5 ms per extra micro-batch: n* = sqrt(0.1 / 0.005) = 4.47
    g = fit_granularity(sizes, eta, 400, compute_s=0.1, dispatch_s=0.1, overhead_s=0.005, n_max=8)
    assert g.n == 4 and math.isclose(g.n_model, math.sqrt(20))
    assert math.isclose(g.A * 400 + g.B, 900.0) and math.isclose(g.S, 900.0 / math.sqrt(20))
    assert g.at(400, 8) == 4 and g.at(800, 8) == 8 and g.at(800, 6) == 6  # eq. (12) at other batch sizes
    # communication tiny next to the overhead of a micro-batch: no splitting
    assert fit_granularity(sizes, eta, 400, 0.1, 0.0005, 0.005, 8).n == 1
    # the smaller of the two sets what can hide: compute-bound looks like dispatch-bound
    assert fit_granularity(sizes, eta, 400, 0.02, 0.5, 0.005, 8).n == 2
    assert fit_granularity(sizes, eta, 400, 1.0, 1.0, 0.001, 8).n == 8  # capped


def test_eq_12s_s_is_the_links_measured_speed_times_the_dispatch_time_of_a_micro_batch():
    """S = v tau: v the rows per second the measured dispatch moved, tau the dispatch seconds one
    micro-batch carries at the cost model's optimum. Held at another batch size, n grows with the
    rows (the paper's hypothesis). The transmission constant that looks obvious, the rows the link
    moves in one micro-batch's overhead, would give n = D / overhead, where the model's time is
    exactly that of n = 1."""
    sizes = [400, 200, 100, 50]
    eta = [2.0 + 100.0 / m for m in sizes]
    C, D, o = 0.1, 0.1, 0.005
    g = fit_granularity(sizes, eta, 400, compute_s=C, dispatch_s=D, overhead_s=o, n_max=64)
    assert math.isclose(g.rows_per_s, 900.0 / D) and math.isclose(g.tau_s, D / math.sqrt(C / o))
    assert math.isclose(g.S, g.rows_per_s * g.tau_s)

    def model_time(n):  # T(n) of fit_granularity's docstring
        return max(C, D) + min(C, D) / n + n * o

    assert model_time(g.n) < model_time(1) and model_time(g.n) <= min(model_time(g.n - 1), model_time(g.n + 1))
    obvious = 900.0 / (g.rows_per_s * o)  # n with S = v * overhead
    assert math.isclose(obvious, D / o) and math.isclose(model_time(obvious), model_time(1))


# ------------------------------------------------------------------------------------------
# Whole runs of one process






@pytest.mark.parametrize("strategy", ["recent", "uniform"])
def test_prefetch_leaves_a_run_bit_identical(tmp_path, strategy):
    """The worker samples the same batches in the same order (uniform sampling draws from the
    sampler's call count, so the order matters), also across the epoch's evaluation."""
    over = ["train.epochs=2", f"sampler.strategy={strategy}"]
    plain, _ = run(tmp_path, "plain", over)
    before = threading.active_count()
    ahead, _ = run(tmp_path, "ahead", [*over, "pipeline.prefetch=3"])
    assert metrics(ahead) == metrics(plain) and len(metrics(plain)) >= 6
    assert threading.active_count() == before  # the worker is joined


def test_prefetch_and_a_mid_epoch_checkpoint_resume_exactly(tmp_path):
    """A checkpoint taken while the worker is batches ahead records the sampler where the loop is."""
    over = ["train.epochs=2", "sampler.strategy=uniform", "pipeline.prefetch=2"]
    full, _ = run(tmp_path, "full", over)
    stopped, d = run(tmp_path, "part", [*over, "train.checkpoint_every=3", "train.stop_after_batches=15"])
    assert stopped["stopped"]
    resumed, _ = run(tmp_path, "resumed", [*over, f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)


def test_async_allreduce_resumes_exactly_with_its_gradient_in_flight(tmp_path):
    over = ["train.epochs=2", "pipeline.async_allreduce=true"]
    full, _ = run(tmp_path, "full", over)
    plain, _ = run(tmp_path, "plain", ["train.epochs=2"])
    assert metrics(full) != metrics(plain)  # staleness one is another update rule
    stopped, d = run(tmp_path, "part", [*over, "train.checkpoint_every=4", "train.stop_after_batches=16"])
    state = torch.load(d / "checkpoints" / "last.pt", weights_only=True)
    assert state["pending_gradients"] is not None and len(state["pending_gradients"]) > 0
    resumed, _ = run(tmp_path, "resumed", [*over, f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)
    from tgdist.errors import ConfigError
    with pytest.raises(ConfigError, match="pipeline.async_allreduce"):  # the update rule is part of the run
        run(tmp_path, "other", ["train.epochs=2", "pipeline.async_allreduce=false", f"train.resume={d}"])


def test_micro_batches_auto_measures_then_chooses_and_reports(tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="tgdist.runtime.pipelines")
    s, _ = run(tmp_path, "auto", ["train.epochs=1", "pipeline.micro_batches=auto", "pipeline.profile_iterations=4"])
    chosen = [r.getMessage() for r in caplog.records if "micro_batches=auto: n=" in r.getMessage()]
    assert len(chosen) == 1 and "A=" in chosen[0] and "S=" in chosen[0]
    assert s["pipeline"]["micro_batches"] >= 1 and s["pipeline"]["fit"]["A"] is not None


@pytest.mark.parametrize("bad, message", [("pipeline.micro_batches=0", "pipeline.micro_batches=0"),
                                          ("pipeline.micro_batches=many", "or auto"),
                                          ("pipeline.micro_batches=101", "^pipeline.micro_batches=101 cuts each "
                                           "batch of train.batch_size=100 events \\(per trainer\\) into more "
                                           "micro-batches than it has events: give at most 100$"),
                                          ("pipeline.prefetch=-1", "pipeline.prefetch=-1")])
def test_bad_pipeline_settings_are_refused_in_one_line(bad, message):
    from tgdist.errors import ConfigError
    from tgdist.runtime.build import compose, validate
    with pytest.raises(ConfigError, match=message):
        validate(compose(SMALL + [bad]))


@pytest.mark.parametrize("bad, message", [
    ("pipeline.micro_batches=many", "^pipeline.micro_batches=many: give a number of micro-batches per batch "
                                    r"\(1: none\) or auto$"),
    ("pipeline.micro_batches=0", "^pipeline.micro_batches=0: give"),
    ("pipeline.staleness=soon", r"^pipeline.staleness=soon: give the iterations of writes a read may miss \(0: none\) "
                                "or auto$"),
    ("pipeline.staleness=-1", "^pipeline.staleness=-1: give")])
def test_a_count_or_auto_key_is_checked_when_the_config_is_composed(bad, message):
    """OmegaConf cannot type "a count or auto" (a Union[int, Enum] refuses the word from YAML);
    the schema's field carries the rule and composing applies it, before any validation."""
    from tgdist.config.overrides import checked_compose
    from tgdist.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        checked_compose([bad])
    for good in (["pipeline.micro_batches=auto"], ["pipeline.micro_batches=3"], ["pipeline=mspipe", "pipeline.staleness=0"],
                 ["pipeline=mspipe"]):
        checked_compose(good)


def test_ctrl_c_during_a_prefetching_run_leaves_no_thread(tmp_path):
    """Ctrl-C (KeyboardInterrupt in the loop) while the worker samples ahead: the run closes, the
    worker is stopped and joined."""
    from tgdist.runtime.build import compose
    from tgdist.runtime.run import Run

    before = threading.active_count()
    r = Run(compose(SMALL + ["train.epochs=2", "pipeline.prefetch=4", f"run_dir={tmp_path / 'r'}"]), tmp_path / "r")

    def interrupt(t, loss):
        if t == 3:
            assert r.pipeline.prefetcher is not None and r.pipeline.prefetcher.alive
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        r.train(on_iteration=interrupt)
    assert r.pipeline.prefetcher is None and threading.active_count() == before


# ------------------------------------------------------------------------------------------
# A strategy from outside the package: one class, registered


def test_a_pipeline_registered_from_a_test_module_trains(tmp_path, monkeypatch):
    """A new pipeline is one module (here this test's class) registered under a name and picked
    by ``pipeline.mode``: the loop calls its hooks and never asks which it holds. This one reads
    each batch when it trains, nothing ahead, which in one process is the plain loop bit for bit;
    its own settings check refuses what it cannot run, in one line."""
    from tgdist.errors import ConfigError
    from tgdist.runtime import pipelines
    from tgdist.runtime.build import compose, validate
    from tgdist.runtime.pipelines import registry

    calls = []

    class Written(pipelines.StepHooks):
        def __init__(self, pipe):
            self.pipe = pipe

        def written(self):
            self.pipe.trainer.memory.start_exchange()

        def sync_gradients(self, params):
            calls.append("sync")
            return self.pipe.grads(params)

    class Lazy(pipelines.Pipeline):
        name = "lazy"

        @classmethod
        def validate(cls, pipe, parallel=None, backend="auto"):
            if parallel is not None and parallel.j > 1:
                raise ConfigError("pipeline.mode=lazy reads no slot ahead: it cannot run epoch parallelism")

        def read_ahead(self, t):
            calls.append("read_ahead")

        def take(self, t, now):
            self.grads.issue()
            if not now.active:
                return None
            self.trainer.memory.open_position(now.position, now.read_slot, now.reset_memory)
            return self.trainer.prepare(now.lo, now.hi, self.ctx.negatives(now), lookup=True)

        def hooks(self, t):
            return Written(self)

        def after_step(self, t):
            self.trainer.memory.close_position()

    monkeypatch.setitem(registry.PIPELINES, "lazy", Lazy)  # what @register("lazy") does, undone after the test
    plain, _ = run(tmp_path, "plain", ["train.epochs=2"])
    lazy, _ = run(tmp_path, "lazy", ["train.epochs=2", "pipeline.mode=lazy"])
    assert metrics(lazy) == metrics(plain) and len(metrics(plain)) >= 6
    assert lazy["pipeline"]["mode"] == "lazy" and calls.count("read_ahead") == calls.count("sync") > 0
    with pytest.raises(ConfigError, match="^pipeline.mode=lazy reads no slot ahead"):
        validate(compose(SMALL + ["pipeline.mode=lazy", "parallel.j=2", "train.epochs=2"]))
    with pytest.raises(ConfigError, match="^pipeline.mode=lazier: give one of plain, mspipe, lazy$"):
        validate(compose(SMALL + ["pipeline.mode=lazier"]))
