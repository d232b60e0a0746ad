"""Partitioned node memory (issue 29): placement, Sven's and DepComm's stores against DepCache on
the same data, and the bytes each phase counts against the batch's placement and Sven (7)-(9)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launcher.helpers import free_port
from tgdist import memory
from tgdist.config import PlacementConfig
from tgdist.data.graph import chronological_split
from tgdist.data.load import load_data
from tgdist.errors import ConfigError, DataError
from tgdist.memory import placement, volumes
from tgdist.memory.store import LocalMemory
from tgdist.memory.sven import append_in_order, redundancy_free
from tgdist.partition import measures
from tgdist.runtime.build import build_trainer, compose

PROBE = str(Path(__file__).with_name("partitioned_probe.py"))
SMALL = ["data.max_events=1000", "model.mem_dim=16", "model.time_dim=8", "model.dropout=0.0", "train.num_threads=1",
         "sampler.num_threads=1", "train.progress=false", "train.num_neg_eval=4", "train.batch_size=50"]
# DepComm is compared at a tiny learning rate: its owners sum the updater's gradient over several
# trainers' rows, in another order than DepCache's trainers do, so gradients differ by float
# rounding (about 1e-7 relative); Adam turns such noise in near-zero gradient entries into
# lr-sized steps of either sign, and TGN's time encoding (cos(w dt), dt up to 1e6 s here) turns a
# 1e-3 change of w into other features, so at lr=1e-3 the two runs part within a few steps. At
# lr=1e-7 they stay within these tolerances:
DEPCOMM_LR = "train.lr=1e-7"
STATE_TOL = {"rtol": 1e-5, "atol": 1e-6}  # memory, mails and their times after every step
GRAD_RTOL = 1e-5  # of the largest gradient entry
METRIC_TOL = 2e-3  # AP / AUC / MRR: a rank statistic, a 1e-7 score change can swap two scores
RUNS = f"runs=depcache,sven,depcache:{DEPCOMM_LR},depcomm:{DEPCOMM_LR}"


# ------------------------------------------------------------------------------------------------
# Pieces, in one process


def test_algorithm_2_gives_the_distinct_ids_and_psi_restores_the_read():
    ids = torch.tensor([7, 3, 7, 9, 3, 3])
    uniq, psi = redundancy_free(ids)
    assert uniq.tolist() == [7, 3, 9] and psi.tolist() == [0, 1, 0, 2, 1, 1]
    assert torch.equal(uniq[psi], ids)
    distinct = torch.tensor([4, 1, 2])
    same, none = redundancy_free(distinct)
    assert same is distinct and none is None  # the trainer's reads: nothing to restore


@pytest.mark.parametrize("seed", range(3))
def test_appending_mails_in_one_write_equals_one_write_mail_per_mail(seed):
    """Aggregation applies a group's mails in (group rank, call) order, a node often getting more
    than its ring holds (APAN): the ring must end as successive write_mail calls leave it."""
    g = torch.Generator().manual_seed(seed)
    n, s, dim, k = 6, 3, 2, 40
    ids = torch.randint(0, n, (k,), generator=g)
    key = torch.randperm(k, generator=g)
    mail, ts = torch.randn(k, dim, generator=g), torch.randn(k, generator=g, dtype=torch.float64)
    a, b = LocalMemory(n, 1, dim, s), LocalMemory(n, 1, dim, s)
    a.head[:] = torch.randint(0, s, (n,), generator=g)
    b.head[:] = a.head
    append_in_order(a, ids, key, mail, ts)
    for i in torch.argsort(key).tolist():
        b.write_mail(ids[i:i + 1], mail[i:i + 1], ts[i:i + 1])
    assert torch.equal(a.mail, b.mail) and torch.equal(a.mail_ts, b.mail_ts) and torch.equal(a.head, b.head)
    assert torch.bincount(ids, minlength=n).max() > s  # some ring overflowed


def _graph():
    cfg = compose(SMALL)
    g = load_data(cfg.data)
    return g, chronological_split(g, cfg.data.val_frac, cfg.data.test_frac).train_end


def test_placement_at_start_by_each_method():
    g, train_end = _graph()
    n = g.num_nodes
    owner, source = placement.compute_owner(g, train_end, 2, 50, (10,), PlacementConfig(method="range"))
    assert source == "range" and owner.tolist() == (np.arange(n) * 2 // n).tolist()
    owner, _ = placement.compute_owner(g, train_end, 3, 50, (10,), PlacementConfig(method="interval"))
    assert owner.tolist() == (np.arange(n) % 3).tolist()
    owner, source = placement.compute_owner(g, train_end, 2, 50, (10,), PlacementConfig())
    assert source.startswith("reflexbicut computed at start")
    access = placement.first_pass_access(g, train_end, 2, 50, (10,))
    w = access.weights("dedup")
    cost = measures.balance_cost(w, owner, 2)
    assert cost < measures.balance_cost(w, placement.compute_owner(g, train_end, 2, 50, (10,),
                                                                   PlacementConfig(method="range"))[0], 2)
    assert np.bincount(owner, minlength=2).max() <= math.ceil(1.05 * n / 2)  # the imbalance bound


def test_an_artifact_is_read_and_refused_in_one_line_when_it_does_not_fit(tmp_path):
    from tgdist.config import PartitionJob
    from tgdist.cli.partition import run as partition

    cfg = compose(SMALL)
    job = PartitionJob(data=cfg.data, sampler=cfg.sampler)
    job.partition.num_parts, job.partition.batch_size, job.partition.plot = 2, 100, False
    job.partition.out_dir, job.partition.progress, job.partition.method = str(tmp_path / "p"), False, "greedy"
    out = partition(job)
    g, _ = _graph()
    owner, source = placement.load_owner(str(out), g, 2, 100)
    assert source == f"greedy from {out}" and owner.shape == (g.num_nodes,) and set(owner.tolist()) == {0, 1}
    with pytest.raises(ConfigError, match=r"partition was made for 2 trainers, this run has 4; re-run tgdist "
                                          r"partition with partition.num_parts=4$"):
        placement.load_owner(str(out), g, 4, 200)
    other = load_data(compose(["data=synthetic", "data.synthetic.num_events=2000",
                               "data.synthetic.num_nodes=300"]).data)
    with pytest.raises(DataError, match=r"partition was made for data set 'collegemsg' \(source hash \w+\), not this "
                                        r"one \(source hash \w+\); re-run tgdist partition for this data$"):
        placement.load_owner(str(out), other, 2, 100)
    with pytest.raises(DataError, match="no such partition directory"):
        placement.load_owner(str(tmp_path / "none"), g, 2, 100)


@pytest.mark.parametrize("overrides,message", [
    (["memory.backend=depcomm", "parallel.j=2", "train.epochs=2"],
     "memory.backend=depcomm: with epoch parallelism (parallel.j=2) a trainer idles in the first and last "
     "iterations and could not update the memory it owns for the others; use parallel.j=1, or memory.backend=sven "
     "or depcache"),
    (["memory.backend=depcomm", "partition.method=metis"],
     "partition.method='metis': choose one of range, interval, reflexbicut, greedy"),
    (["memory.backend=sven", "partition.weights=all"], "partition.weights='all': choose one of dedup, raw"),
])
def test_settings_a_partitioned_store_cannot_run_with_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_trainer(compose([*SMALL, *overrides]))
    assert str(e.value) == message


def test_depcomm_refuses_a_last_batch_that_leaves_a_trainer_without_events():
    from tgdist.distributed.schedule import Layout

    cfg = compose([*SMALL, "memory.backend=depcomm"])
    ctx = memory.StoreContext(10, 2, 4, 1, layout=Layout(4, 1, 1), cfg=cfg, batch_size=50, train_end=402)
    with pytest.raises(ConfigError) as e:
        memory.create("depcomm", ctx)
    assert str(e.value) == ("memory.backend=depcomm: the last global batch has 2 events for parallel.i=4 trainers, so "
                            "a trainer would have none and could not update the memory it owns for the others; change "
                            "train.batch_size")


def test_a_partitioned_store_of_one_trainer_trains_as_local_memory():
    """A memory group of one (no process group): every node is local, the collectives pass
    their input through, and training is the single-process loop's, bit for bit."""
    out = {}
    for backend in ("local", "sven", "depcomm"):
        cfg = compose([*SMALL, "model=apan", "train.lr=1e-3", "partition.method=interval", f"memory.backend={backend}"])
        tr = build_trainer(cfg, progress=False)
        m = tr.model
        if backend != "local":
            tr.memory = memory.create(backend, memory.StoreContext(
                tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, cfg=cfg, batch_size=tr.batch_size,
                fanouts=tuple(tr.sampler.fanouts), graph=tr.g, train_end=tr.split.range("train")[1]))
            assert tr.memory.rows_held() == tr.g.num_nodes
        losses = []
        for lo, hi in list(tr.batches("train"))[:5]:
            losses.append(tr.step(lo, hi, tr.negatives.train(hi - lo, 1), train=True).loss)
            tr.memory.exchange()
        st = tr.memory.full_state() if backend != "local" else {k: getattr(tr.memory, k) for k in ("mem", "mail")}
        out[backend] = losses, st["mem"], st["mail"]
        if backend != "local":  # a checkpoint's shard loads back as it was, and only onto its placement
            saved = {k: v.clone() for k, v in tr.memory.state_dict().items()}
            tr.memory.reset_state()
            tr.memory.load_state_dict(saved)
            assert all(torch.equal(v, tr.memory.state_dict()[k]) for k, v in saved.items())
            with pytest.raises(ConfigError, match=f"^memory.backend={backend}: the checkpoint's shard of group rank 0 "
                                                  f"holds other nodes than this run's placement gives it"):
                tr.memory.load_state_dict({**saved, "owned": saved["owned"].flip(0)})
    for backend in ("sven", "depcomm"):
        assert out[backend][0] == out["local"][0]
        assert torch.equal(out[backend][1], out["local"][1]) and torch.equal(out[backend][2], out["local"][2])


@pytest.mark.parametrize("remote_dispatch", ["occurrences", "distinct"])
def test_a_remote_dispatch_a_row_short_is_refused_in_one_line(monkeypatch, remote_dispatch):
    """An owner that sends one row fewer than a requester asked for (a row per occurrence, or per
    distinct node) would shift every later node's updated memory onto another node's place (or
    index past the end): the requester counts the rows from each owner and refuses the batch,
    naming both counts. Without the fault the same steps train."""
    from tgdist.distributed import collectives

    cfg = compose([*SMALL, "partition.method=interval", "memory.backend=depcomm",
                   f"memory.remote_dispatch={remote_dispatch}"])
    tr = build_trainer(cfg, progress=False)
    m = tr.model
    tr.memory = memory.create("depcomm", memory.StoreContext(
        tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, cfg=cfg, batch_size=tr.batch_size,
        fanouts=tuple(tr.sampler.fanouts), graph=tr.g, train_end=tr.split.range("train")[1]))
    (lo, hi), (lo2, hi2) = list(tr.batches("train"))[:2]
    tr.step(lo, hi, tr.negatives.train(hi - lo, 1), train=True)  # (memory and mails to update from)
    tr.memory.exchange()
    sent = collectives.all_to_all_rows

    def a_row_short(parts, group=None, name="", **kw):
        if name == "remote_dispatch":
            parts = {p: [t[:-1] for t in v] for p, v in parts.items()}
        return sent(parts, group, name, **kw)

    monkeypatch.setattr(collectives, "all_to_all_rows", a_row_short)
    with pytest.raises(RuntimeError) as e:
        tr.step(lo2, hi2, tr.negatives.train(hi2 - lo2, 1), train=True)
    per = "occurrence" if remote_dispatch == "occurrences" else "distinct node"
    msg = str(e.value)
    assert msg.startswith("memory.backend=depcomm: the remote dispatch brought [") and "\n" not in msg, msg
    assert msg.endswith(f"(one row per {per}): an owner sent other rows than it was asked for"), msg
    got, asked = (int(x.split("]")[0]) for x in msg.split("[")[1:3])
    assert got == asked - 1 > 0, msg


def test_sven_below_depcache_exactly_when_m_exceeds_t_plus_2():
    """Eq. (10): with T = N1 (1 - eta1) / (N2 (1 - eta2)), C_Sven < C_DepCache iff M > T + 2."""
    for n1, eta1, n2, eta2 in ((4000, 0.75, 800, 0.5), (3000, 0.9, 1000, 0.6), (5000, 0.2, 1000, 0.0)):
        t = n1 * (1 - eta1) / (n2 * (1 - eta2))
        for m in range(2, 17):
            sven = sum(volumes.sven_volume(n1, eta1, n2, eta2, m, 72, 136))
            assert (sven < volumes.depcache_volume(n2, eta2, m, 72, 136)) == (m > t + 2 + 1e-12), (n1, m)


# ------------------------------------------------------------------------------------------------
# Whole runs under torchrun: DepCache, Sven and DepComm on the same data


def _probe(tmp_path, nproc: int, *overrides: str, runs: str = RUNS, env: dict | None = None) -> list[dict]:
    out = tmp_path / "probe"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", PROBE, str(out), runs, *SMALL, *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "still referenced after destroy" not in r.stderr
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(nproc)]


def _same_metrics(a: dict, b: dict, tol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or abs(a[k] - b[k]) <= tol for k in a)


def _delta(rec: dict, t: int, key: str) -> tuple[int, int]:
    """(sent, received) bytes of counter ``key`` in iteration ``t``."""
    now = rec["counters"][t].get(key, {"bytes_sent": 0, "bytes_received": 0})
    before = rec["counters"][t - 1].get(key, {"bytes_sent": 0, "bytes_received": 0}) if t else \
        {"bytes_sent": 0, "bytes_received": 0}
    return now["bytes_sent"] - before["bytes_sent"], now["bytes_received"] - before["bytes_received"]


def _check_bytes(ranks: list[dict], run: str, group: list[int], formulas: bool) -> None:
    """Every iteration's counted bytes of every phase, on every trainer of ``group`` (global ranks),
    exactly as the rows read and written and the placement imply; with ``formulas``, the group's
    totals against Sven (7)-(9) for the batch's N1, eta1, N2, eta2 and M."""
    recs = [ranks[r][run] for r in group]
    m = len(group)
    owner = recs[0].get("trainer_of")  # the placement (depcache has none)
    state = recs[0]["states"][0]
    d, (s, dm) = state["mem"].shape[1], state["mail"].shape[1:]
    mem_bytes, mail_bytes = 4 * d + 8, 4 * dm + 8  # a row with its float64 time
    backend = run.split(":")[0]
    per_occurrence = backend == "depcomm" and "memory.remote_dispatch=distinct" not in run
    for t in range(len(recs[0]["losses"])):
        reads = [torch.cat(r["reads"][t]) if r["reads"][t] else torch.zeros(0, dtype=torch.long) for r in recs]
        if backend == "sven":  # a row per distinct node of the batch, however many micro-batches read it
            reads = [torch.unique(x) for x in reads]
        uses = [torch.cat(r["uses"][t]) if r["uses"][t] else torch.zeros(0, dtype=torch.long) for r in recs]
        writes = [torch.cat(r["mem_writes"][t]) if r["mem_writes"][t] else torch.zeros(0, dtype=torch.long)
                  for r in recs]
        mails = [torch.cat(r["mail_writes"][t]) if r["mail_writes"][t] else torch.zeros(0, dtype=torch.long)
                 for r in recs]
        totals = {}
        for g, rec in enumerate(recs):
            if backend == "depcache":
                others = [x for x in range(m) if x != g]
                mine = len(writes[g]) * mem_bytes + len(mails[g]) * mail_bytes
                expected = {"aggregation.payload": (mine * (m - 1), sum(len(writes[x]) * mem_bytes +
                                                                        len(mails[x]) * mail_bytes for x in others)),
                            "aggregation.index": ((len(writes[g]) + 2 * len(mails[g])) * 8 * (m - 1),
                                                  sum((len(writes[x]) + 2 * len(mails[x])) * 8 for x in others))}
            else:
                need = int((owner[reads[g]] != g).sum())  # rows this trainer fetched
                served = sum(int((owner[reads[x]] == g).sum()) for x in range(m) if x != g)  # rows it served
                mem_out = int((owner[writes[g]] != g).sum())
                mem_in = sum(int((owner[writes[x]] == g).sum()) for x in range(m) if x != g)
                mail_out = int((owner[mails[g]] != g).sum())
                mail_in = sum(int((owner[mails[x]] == g).sum()) for x in range(m) if x != g)
                expected = {"dispatch.index": (need * 8, served * 8),
                            "aggregation.payload": (mem_out * mem_bytes + mail_out * mail_bytes,
                                                    mem_in * mem_bytes + mail_in * mail_bytes),
                            "aggregation.index": ((mem_out + 2 * mail_out) * 8, (mem_in + 2 * mail_in) * 8)}
                if backend == "sven":  # raw memory and mailbox rows
                    row = mem_bytes + s * mail_bytes
                    expected["dispatch.payload"] = (served * row, need * row)
                else:  # updated memory, its time and whether it was updated; gradients back
                    if per_occurrence:  # a row per sampled occurrence; each slot's count travels (int32)
                        expected["dispatch.index"] = (need * 12, served * 12)
                        need = int(uses[g][owner[reads[g]] != g].sum())
                        served = sum(int(uses[x][owner[reads[x]] == g].sum()) for x in range(m) if x != g)
                    expected["remote_dispatch.payload"] = (served * (mem_bytes + 1), need * (mem_bytes + 1))
                    expected["backward.payload"] = (need * 4 * d, served * 4 * d)
                    expected["dispatch.payload"] = (0, 0)
            for key, value in expected.items():
                assert _delta(rec, t, key) == value, (run, t, g, key)
                totals[key] = totals.get(key, 0) + sum(value)
        if not formulas:
            continue
        n1 = sum(sum(r["occurrences"][t]) for r in recs)
        assert n1 == sum(int(u.sum()) for u in uses)  # the store was told every sampled occurrence
        distinct1 = sum(len(x) for x in reads)
        n2 = sum(2 * sum(r["events"][t]) for r in recs)
        distinct2 = sum(len(x) for x in writes)
        eta1, eta2 = 1 - distinct1 / n1, 1 - distinct2 / n2
        assert 0 < eta1 < 1 and 0 <= eta2 < 1
        if backend == "depcache":  # (7) counts (M - 1) / M of the (M - 1) copies a write makes
            paper = volumes.depcache_volume(n2, eta2, m, mem_bytes, mail_bytes)
            assert totals["aggregation.payload"] == pytest.approx(paper * m / (m - 1), rel=1e-12)
            continue
        # measured remote shares in place of the ideal (M - 1) / M
        r1 = sum(int((owner[reads[g]] != g).sum()) for g in range(m)) / distinct1
        r2 = sum(int((owner[writes[g]] != g).sum()) for g in range(m)) / distinct2
        if backend == "sven":
            c1, c2 = volumes.sven_volume(n1, eta1, n2, eta2, m, mem_bytes, mail_bytes, remote=(r1, r2))
            assert totals["dispatch.payload"] == pytest.approx(c1, rel=1e-12)
        else:  # an updated row carries a flag (whether it was updated) besides its time: d_mem C0 + 1
            if per_occurrence:  # (8) as it stands: N1 rows, the remote share counted over occurrences
                rows = n1
                r1 = sum(int(uses[g][owner[reads[g]] != g].sum()) for g in range(m)) / n1
            else:  # the trainer's distinct nodes: (8)'s N1 becomes N1 (1 - eta1)
                rows = distinct1
            c1 = volumes.depcomm_volume(rows, n2, eta2, m, mem_bytes + 1, mail_bytes, remote=(r1, r2))[0]
            c2 = volumes.depcomm_volume(rows, n2, eta2, m, mem_bytes, mail_bytes, remote=(r1, r2))[1]
            assert totals["remote_dispatch.payload"] == pytest.approx(c1, rel=1e-12)
        assert totals["aggregation.payload"] == pytest.approx(c2, rel=1e-12)


def _check_links_against_partitioner(ranks: list[dict], model_overrides: tuple, i: int, j: int = 1) -> None:
    """Over the first pass, the rows each sven trainer served each other one are the
    partitioner's C matrix (dedup weights) for that placement, sampler and negatives."""
    cfg = compose([*SMALL, *model_overrides])
    tr = build_trainer(cfg, progress=False)
    train_end = tr.split.range("train")[1]
    access = placement.first_pass_access(tr.g, train_end, i, cfg.train.batch_size,
                                         tr.sampler.fanouts if tr.sampler is not None else (), subgroups=j,
                                         seed=cfg.train.seed)
    m = i * j
    owner = ranks[0]["sven"]["trainer_of"].numpy()
    predicted, _ = measures.comm_matrix(access.weights("dedup"), owner, m)
    last = -(-train_end // (i * cfg.train.batch_size)) - 1  # the first pass's last iteration
    served = np.stack([ranks[r]["sven"]["links"][last]["dispatch"].numpy() for r in range(m)])  # [owner, to]
    assert served.sum() > 0 and np.array_equal(served.T, predicted)


def _check_runs(ranks: list[dict], groups: list[list[int]], formulas: bool, depcomm: bool = True) -> None:
    nproc = len(ranks)
    for r in range(nproc):
        a, b = ranks[r]["depcache"], ranks[r]["sven"]
        assert a["losses"] == b["losses"] and len(a["losses"]) > 2  # bit-identical, every step
        for t, (x, y) in enumerate(zip(a["states"], b["states"])):
            assert all(torch.equal(x[k], y[k]) for k in x), (r, t)  # the whole memory, mails, rings
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
        if not depcomm:
            continue
        c, d = ranks[r][f"depcache:{DEPCOMM_LR}"], ranks[r][f"depcomm:{DEPCOMM_LR}"]
        assert c["losses"] == pytest.approx(d["losses"], rel=1e-6)
        for x, y in zip(c["states"], d["states"]):
            for k in x:  # (the ring heads exactly)
                torch.testing.assert_close(y[k], x[k], **(STATE_TOL if x[k].is_floating_point() else {}))
        for x, y in zip(c["grads"], d["grads"]):
            torch.testing.assert_close(y, x, rtol=0, atol=GRAD_RTOL * float(x.abs().max()))
    zero = ranks[0]
    assert _same_metrics(zero["depcache"]["metrics"], zero["sven"]["metrics"])
    assert all(torch.equal(zero["depcache"]["final_state"][k], zero["sven"]["final_state"][k])
               for k in zero["sven"]["final_state"])
    runs = ("depcache", "sven", f"depcache:{DEPCOMM_LR}", f"depcomm:{DEPCOMM_LR}") if depcomm else ("depcache", "sven")
    if depcomm:
        assert _same_metrics(zero[f"depcache:{DEPCOMM_LR}"]["metrics"], zero[f"depcomm:{DEPCOMM_LR}"]["metrics"],
                             METRIC_TOL)
    for run in runs[1::2]:
        for group in groups:
            owner = ranks[group[0]][run]["trainer_of"]
            n = owner.numel()
            held = [ranks[r][run]["rows_held"] for r in group]
            assert held == torch.bincount(owner, minlength=len(group)).tolist() and sum(held) == n
            assert max(held) < n  # every trainer holds only its part
            assert [ranks[r][run]["rows_after_training"] for r in group] == [n if r == 0 else 0 for r in group]
    for run in runs:
        for group in groups:
            _check_bytes(ranks, run, group, formulas)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["tgn", pytest.param("jodie", marks=pytest.mark.slow),
                                   pytest.param("apan", marks=pytest.mark.slow)])  # ~20, 20, 30 s
def test_2x1x1_sven_is_depcache_bit_for_bit_and_depcomm_within_rounding(tmp_path, model):
    """Also DepComm's two remote dispatches: a row per sampled occurrence (the default, eq. (8))
    trains bit for bit as a row per distinct node, and each counts its own bytes."""
    distinct = f"depcomm:{DEPCOMM_LR};memory.remote_dispatch=distinct"
    ranks = _probe(tmp_path, 2, f"model={model}", "parallel.i=2", "train.epochs=2", "train.lr=1e-3",
                   runs=f"{RUNS},{distinct}")
    _check_runs(ranks, [[0, 1]], formulas=model == "tgn")
    _check_links_against_partitioner(ranks, (f"model={model}",), 2)
    for r in range(2):
        a, b = ranks[r][f"depcomm:{DEPCOMM_LR}"], ranks[r][distinct]
        assert a["losses"] == b["losses"] and len(a["losses"]) > 2
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["states"], b["states"]) for k in x)
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert _same_metrics(ranks[0][f"depcomm:{DEPCOMM_LR}"]["metrics"], ranks[0][distinct]["metrics"])
    _check_bytes(ranks, distinct, [0, 1], formulas=model == "tgn")
    sent = {run: sum(ranks[r][run]["counters"][-1]["remote_dispatch.payload"]["bytes_sent"] for r in range(2))
            for run in (f"depcomm:{DEPCOMM_LR}", distinct)}
    assert sent[f"depcomm:{DEPCOMM_LR}"] > 1.5 * sent[distinct] > 0  # the occurrences are the many


@pytest.mark.distributed
def test_2x1x1_sven_is_depcache_bit_for_bit_on_the_gpus_updater_path(tmp_path):
    """The updaters as a GPU runs them (no reads of device values) go by whether a read's
    mailboxes are unwritten since the reset (``MemoryRead.empty``): Sven's dispatch learns it from
    every owner, with the row counts, so it says what DepCache's replica says, and the two train
    bit for bit (without it, the first batch of each epoch gave the updater zero gradients under
    Sven and none under DepCache)."""
    ranks = _probe(tmp_path, 2, "parallel.i=2", "train.epochs=2", "train.lr=1e-3", "model.cpu_kernels=false",
                   runs="runs=depcache,sven", env={"PROBE_SYNC_FREE": "1"})
    _check_runs(ranks, [[0, 1]], formulas=True, depcomm=False)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tgn", "jodie", "apan"])
def test_4x1x1_sven_is_depcache_bit_for_bit_and_depcomm_within_rounding(tmp_path, model):
    ranks = _probe(tmp_path, 4, f"model={model}", "parallel.i=4", "train.epochs=1", "train.lr=1e-3")
    _check_runs(ranks, [[0, 1, 2, 3]], formulas=model == "tgn")
    _check_links_against_partitioner(ranks, (f"model={model}",), 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_2x1x2_two_memory_groups_each_partitioned(tmp_path):
    """Two memory copies (k = 2), each split between its 2 trainers; APAN's mailbox of 10."""
    ranks = _probe(tmp_path, 4, "model=apan", "parallel.i=2", "parallel.k=2", "train.epochs=2", "train.lr=1e-3")
    _check_runs(ranks, [[0, 1], [2, 3]], formulas=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_tgdist_train_with_sven_on_an_artifact_reports_what_depcache_does(tmp_path):
    """The command line end to end: sven placed by a `tgdist partition` artifact (range here, any
    placement trains the same model) gives DepCache's loss and metrics, and logs the rows each
    trainer holds; the summary counts its phases."""
    import json

    common = [*SMALL, "parallel.i=2", "train.epochs=2", "train.lr=1e-3"]
    r = subprocess.run([sys.executable, "-m", "tgdist", "partition", *SMALL[:1], "partition=range",
                        "partition.num_parts=2", "partition.batch_size=100", f"partition.out_dir={tmp_path / 'parts'}",
                        "partition.plot=false", "partition.progress=false"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summaries = {}
    for backend, extra in (("depcache", []), ("sven", [f"partition.artifact={tmp_path / 'parts'}"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "tgdist.train", *common, *extra,
               f"memory.backend={backend}", f"run_dir={tmp_path / backend}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        summaries[backend] = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert summaries["sven"][key] == summaries["depcache"][key], key
    comm = summaries["sven"]["communication"]
    assert summaries["sven"]["memory_backend"] == "sven" and comm["dispatch.payload"]["bytes_sent"] > 0
    # (rank 0's counts: the first 1000 events write nodes with ids below 237 only, all of them rank
    # 0's under range placement, so rank 0 sends no write and receives rank 1's)
    assert comm["aggregation.payload"]["bytes_received"] > 0
    assert "dispatch.payload" not in summaries["depcache"]["communication"]
    n = load_data(compose(SMALL).data).num_nodes
    line = [x for x in (tmp_path / "sven" / "train.log").read_text().splitlines() if "memory.backend=sven" in x]
    assert len(line) == 1 and (f"placement range from {tmp_path / 'parts'}; {n:,} nodes' memory and mails over 2 "
                               f"trainers, rows held per group rank [{(n + 1) // 2}, {n // 2}]") in line[0]


@pytest.mark.distributed
def test_1x2x1_sven_with_epoch_parallelism_is_depcache_bit_for_bit(tmp_path):
    """Epoch parallelism: both subgroups read every position together (the second one for its
    later iteration) and only the first writes; sven's group of 2 holds the memory split in two.
    (depcomm refuses j > 1: a trainer idles in the first and last iterations.)"""
    ranks = _probe(tmp_path, 2, "model=tgn", "parallel.j=2", "train.epochs=2", "train.lr=1e-3",
                   runs="runs=depcache,sven")
    assert None in ranks[1]["sven"]["losses"]  # the second subgroup's idle first iteration
    _check_runs(ranks, [[0, 1]], formulas=False, depcomm=False)
    _check_links_against_partitioner(ranks, ("model=tgn",), 1, 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_2x2x1_sven_with_both_parallelisms_is_depcache_bit_for_bit(tmp_path):
    ranks = _probe(tmp_path, 4, "model=apan", "parallel.i=2", "parallel.j=2", "train.epochs=2", "train.lr=1e-3",
                   runs="runs=depcache,sven")
    _check_runs(ranks, [[0, 1, 2, 3]], formulas=False, depcomm=False)
    _check_links_against_partitioner(ranks, ("model=apan",), 2, 2)


# ------------------------------------------------------------------------------------------------
# Sven's pipelining on the partitioned stores (tgdist.runtime.pipeline)


@pytest.mark.slow
@pytest.mark.distributed
def test_2x1x1_micro_batches_and_prefetch_on_every_store(tmp_path):
    """Each store with 3 micro-batches against itself with one, at DepComm's tiny learning rate
    (see DEPCOMM_LR: micro-batches sum each gradient in another order too): the first step's
    memory and mails are identical bit for bit (same reads, same parameters), later ones within
    rounding, as are losses and gradients. Prefetch leaves sven bit-identical, and sven's
    asynchronous all-reduce trains with replicas that stay identical."""
    lr = DEPCOMM_LR
    micro = "pipeline.micro_batches=3"
    runs = [f"{b}:{lr}" for b in ("depcache", "sven", "depcomm")] + \
        [f"{b}:{lr};{micro}" for b in ("depcache", "sven", "depcomm")] + \
        ["sven", "sven:pipeline.prefetch=2", "sven:pipeline.async_allreduce=true"] + \
        [f"sven:pipeline.micro_batches={n}" for n in (2, 4)]
    ranks = _probe(tmp_path, 2, "model=tgn", "parallel.i=2", "train.epochs=1", "train.lr=1e-3",
                   runs="runs=" + ",".join(runs))
    # Sven's dispatch is redundancy-free per batch: micro-batches fetch each distinct node of the
    # batch once (a later one takes the rows an earlier one brought), so every iteration's bytes
    # are those of the batch's distinct rows, exactly, and (7) holds with the batch's eta1; the
    # first iteration (same reads in every run) moves the very bytes of one micro-batch
    for n in (2, 4):
        run = f"sven:pipeline.micro_batches={n}"
        assert max(len(x) for x in ranks[0][run]["reads"]) == n  # n reads an iteration
        _check_bytes(ranks, run, [0, 1], formulas=True)
        for r in range(2):
            for key in ("dispatch.payload", "dispatch.index"):
                assert _delta(ranks[r][run], 0, key) == _delta(ranks[r]["sven"], 0, key), (n, r, key)
    for r in range(2):
        for b in ("depcache", "sven", "depcomm"):
            one, many = ranks[r][f"{b}:{lr}"], ranks[r][f"{b}:{lr};{micro}"]
            assert len(one["losses"]) == len(many["losses"]) > 2
            assert all(torch.equal(one["states"][0][k], many["states"][0][k]) for k in one["states"][0]), (r, b)
            assert many["losses"] == pytest.approx(one["losses"], rel=1e-5)
            for x, y in zip(one["states"], many["states"]):
                for k in x:
                    torch.testing.assert_close(y[k], x[k], **(STATE_TOL if x[k].is_floating_point() else {}))
            for x, y in zip(one["grads"], many["grads"]):
                torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))
        plain, ahead = ranks[r]["sven"], ranks[r]["sven:pipeline.prefetch=2"]
        assert plain["losses"] == ahead["losses"]
        assert all(torch.equal(x[k], y[k]) for x, y in zip(plain["states"], ahead["states"]) for k in x)
        stale = ranks[r]["sven:pipeline.async_allreduce=true"]
        assert all(torch.equal(plain["states"][0][k], stale["states"][0][k]) for k in plain["states"][0])
        assert stale["losses"] != plain["losses"] and all(math.isfinite(x) for x in stale["losses"] if x is not None)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["sven:pipeline.async_allreduce=true"]["params"],
                                                ranks[1]["sven:pipeline.async_allreduce=true"]["params"]))
    zero = ranks[0]
    for b in ("depcache", "sven", "depcomm"):
        assert _same_metrics(zero[f"{b}:{lr}"]["metrics"], zero[f"{b}:{lr};{micro}"]["metrics"], METRIC_TOL)
    assert _same_metrics(zero["sven"]["metrics"], zero["sven:pipeline.prefetch=2"]["metrics"])
