"""The strategy advisor (``tgdist.launcher.advisor``): the model on the papers' worked examples, the
cluster description, and the command line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from tgdist.errors import ConfigError
from tgdist.launcher.advisor import cluster as clusters
from tgdist.launcher.advisor import model
from tgdist.launcher.advisor.cluster import Cluster
from tgdist.launcher.advisor.profile import STAGES, BatchProfile, PlacementShare, Profile, read, write

ROW_BYTES = (4 * 100 + 8) + (4 * 372 + 8)  # mem_dim 100, mail_dim 372, one mail


def batch(b: int, seconds: dict, eta1: float = 0.6, eta2: float = 0.2, rows_per_event: float = 12.0) -> BatchProfile:
    return BatchProfile(b, {s: v * b for s, v in seconds.items()}, rows_per_event * b, rows_per_event * b * (1 - eta1),
                        2.0 * b, 2.0 * b * (1 - eta2))


def profile(sizes=(200, 600, 1600), per_event=None, num_nodes=10_000, events=100_000, **kw) -> Profile:
    per_event = per_event or {"sample": 1e-5, "features": 1e-5, "memory_read": 2e-6, "compute": 5e-5,
                              "memory_write": 2e-6}
    return Profile(data={"num_nodes": num_nodes, "num_train_events": events, "mem_dim": 100, "mail_dim": 372,
                         "mailbox_size": 1}, batches=[batch(b, per_event) for b in sizes],
                   grad_bytes=kw.pop("grad_bytes", 1_200_000), **kw)


# ------------------------------------------------------------------------------------------------
# DistTGL 3.2.4


def test_disttgl_worked_example():
    """4 machines x 8 GPUs, L = 3200, S = 1600, host memory for two copies per machine: among the
    daemon layouts the advisor's best is DistTGL's 2 x 2 x 8, k < machines and three copies per
    machine are refused with their reasons, and i = 4 (global batch 6400 > L) is flagged."""
    p = profile(num_nodes=2**20, sizes=(400, 1600), largest_batch=3200, saturation_batch=1600)
    copy_gib = 2**20 * ROW_BYTES / 2**30
    c = Cluster(name="paper", machines=4, trainers_per_machine=8, intra_link="nvlink", inter_link="ib100",
                host_memory_gb=2.5 * copy_gib, device_memory_gb=40)
    ranked = model.predict(p, c, backends=["daemon"], pipelines=["none"])
    ok = [x for x in ranked if x.refused is None]
    assert (ok[0].i, ok[0].j, ok[0].k, ok[0].batch_size) == (2, 2, 8, 1600)
    assert {(x.i, x.j, x.k) for x in ok} == {(1, 4, 8), (2, 2, 8), (4, 1, 8), (1, 8, 4), (2, 4, 4), (4, 2, 4),
                                             (8, 1, 4)}
    why = {(x.i, x.j, x.k): x.refused for x in ranked if x.refused}
    assert "k >= machines" in why[(8, 4, 1)] and "DistTGL 3.2.4" in why[(8, 4, 1)]
    assert "host memory" in why[(2, 1, 16)] and "4 memory copies" in why[(2, 1, 16)]
    beyond = next(x for x in ok if (x.i, x.j, x.k) == (4, 1, 8))
    assert beyond.risk_level == 2 and "6400 > L = 3200" in beyond.risk[0]
    assert ok.index(beyond) > ok.index(next(x for x in ok if (x.i, x.j, x.k) == (1, 8, 4)))  # risk ranks after


# ------------------------------------------------------------------------------------------------
# Sven 3.2: volumes (7)-(9), eq. (10), eq. (12)


@pytest.mark.parametrize("M", [2, 4, 8])
def test_volumes_sum_to_sven_eq_8_and_9(M):
    """Each trainer's busier direction, over M trainers sending and receiving it, is eq. (9) for
    sven and eq. (8) for depcomm with the ideal placement (M - 1) / M; depcache's all-gather is
    M / (M - 1) times eq. (7)."""
    N1r, eta1, N2r, eta2, d_msg, d_mem = 1000.0, 0.8, 400.0, 0.5, 372, 100
    paper = model.paper_volumes(M * N1r, eta1, M * N2r, eta2, d_msg, d_mem, M)
    rb, mb = 4.0 * (d_msg + d_mem), 4.0 * d_mem
    for backend in ("sven", "depcomm", "depcache"):
        disp, agg = model.volumes(backend, N1r, N1r * (1 - eta1), N2r * (1 - eta2), rb, mb, 0.0, (M - 1) / M, M)
        total = 2 * M * (disp + agg)
        want = paper[backend] * (M / (M - 1) if backend == "depcache" else 1.0)
        assert total == pytest.approx(want, rel=1e-12)


def test_eq_10_sven_below_depcache_when_m_above_t_plus_2():
    for T in (0.5, 1.5, 1.9, 2.7):  # off the boundary M = T + 2, where the two are equal
        for M in range(2, 12):
            N2, eta2 = 1000.0, 0.5
            N1, eta1 = T * N2 * (1 - eta2) / (1 - 0.8), 0.8  # N1 (1 - eta1) = T N2 (1 - eta2)
            v = model.paper_volumes(N1, eta1, N2, eta2, 372, 100, M)
            assert (v["sven"] < v["depcache"]) == model.sven_beats_depcache(T, M), (T, M)


def test_eq_12_row_fit_recovers_eta():
    """eta1 = A + B / bs (Sven eq. (12)) fitted from profiled batches gives the rows at any batch."""
    A, B = 0.55, 60.0
    p = Profile(data={"num_nodes": 100, "num_train_events": 1000, "mem_dim": 8, "mail_dim": 16},
                batches=[batch(b, {"compute": 1e-5}, eta1=A + B / b) for b in (200, 400, 1600)], grad_bytes=4)
    rows = model.RowFit.of(p)
    assert (rows.A1, rows.B1) == (pytest.approx(A), pytest.approx(B))
    assert rows.distinct(800) == pytest.approx(12 * 800 * (1 - A - B / 800))


def test_micro_count_is_what_auto_chooses():
    """The model's n is the one ``micro_batches=auto`` fits (eq. (12) at the measured batch)."""
    from tgdist.runtime.pipelines.plain import fit_granularity

    for C, D, o in [(0.1, 0.05, 0.002), (0.02, 0.2, 0.001), (0.3, 0.3, 0.05), (0.01, 0.5, 0.02)]:
        g = fit_granularity([100, 200, 400], [0.7, 0.6, 0.55], 400, C, D, o, 8)
        assert model.micro_count(C, D, o) == g.n


# ------------------------------------------------------------------------------------------------
# Overlap: the pipeline levels and MSPipe's bound


def one_gpu_profile(tau=(1.0, 1.0, 1.0, 3.0, 1.0)) -> Profile:
    b = 100
    secs = dict(zip(("sample", "features", "memory_read", "compute", "memory_write"), (t / b for t in tau)))
    return profile(sizes=(b,), per_event=secs, events=100 * 400)


def test_pipeline_levels_on_one_gpu():
    """Stage times 1, 1, 1, 3, 1 (s): in turn 7 s an iteration; prefetch takes sampling and features
    off (5 s); MSPipe's stall-free schedule runs at the slowest stage, 3 s, reading memory K = 1
    iteration stale (eq. (3)-(4), C1-C3)."""
    got = {c.pipeline: c for c in model.predict(one_gpu_profile(), clusters.preset("gpu-1"), batch_sizes=[100])
           if c.refused is None}
    assert got["none"].iteration_s == pytest.approx(7.0)
    assert got["prefetch"].iteration_s == pytest.approx(5.0)
    assert got["mspipe"].iteration_s == pytest.approx(3.0)
    assert got["mspipe"].staleness == 1 and "K = 1" in got["mspipe"].risk[0]
    assert got["none"].epoch_s == pytest.approx(400 * 7.0)


def test_measured_overlap_scales_what_stage_threads_save():
    """Where the profile measured that a stage thread buys a share e of the ideal overlap, prefetch
    saves e times min(sampling + features, the rest) and MSPipe e times its ideal saving."""
    for e, pre, ms in [(0.0, 7.0, 7.0), (0.5, 6.0, 5.0), (1.0, 5.0, 3.0)]:
        p = dataclasses.replace(one_gpu_profile(), overlap={"prefetch": e})
        got = {c.pipeline: c for c in model.predict(p, clusters.preset("gpu-1"), batch_sizes=[100])
               if c.refused is None}
        assert got["none"].iteration_s == pytest.approx(7.0)
        assert got["prefetch"].iteration_s == pytest.approx(pre)
        assert got["mspipe"].iteration_s == pytest.approx(ms)


def test_mspipe_bound_from_runtime():
    """The staleness the model reports is the runtime's steady bound for the same stage times."""
    from tgdist.runtime.pipelines.mspipe import staleness_bounds

    tau = (0.5, 0.5, 2.0, 1.0, 2.5)
    c = next(c for c in model.predict(one_gpu_profile(tau), clusters.preset("gpu-1"), batch_sizes=[100],
                                      pipelines=["mspipe"]) if c.refused is None)
    assert c.staleness == staleness_bounds(tau, 400).steady()
    assert c.iteration_s == pytest.approx(2.5, rel=1e-6)  # the memory update, the slowest stage


def test_shared_cores_bound_the_iteration():
    """Four CPU ranks on two cores: an iteration takes at least 4 x the rank's CPU seconds / 2."""
    p = profile(sizes=(600,))
    cpu = sum(p.batches[0].seconds.values())
    c = next(c for c in model.predict(p, clusters.preset("cpu-4-eth10"), batch_sizes=[600], backends=["local"],
                                      pipelines=["none"]) if c.refused is None)
    assert (c.i, c.j, c.k) == (1, 1, 4)
    assert c.iteration_s == pytest.approx(4 * cpu / 2 + 0.0, rel=0.05)
    assert any("shared cores" in n for n in c.notes)


def test_measured_core_sharing_scales_the_cpu_stages():
    """On the profile's machine the measured slowdown of processes side by side replaces cores: two
    ranks that each keep a core busy run 1.6x slower when the profile measured 2 -> 1.6x."""
    p = profile(sizes=(600,), core_sharing={"1": 1.0, "2": 1.6, "4": 3.0})
    cpu = sum(p.batches[0].seconds.values())
    c2 = next(c for c in model.predict(p, clusters.preset("cpu-2-ib100"), batch_sizes=[600], backends=["local"],
                                       pipelines=["none"]) if c.refused is None)
    link = model.link_seconds("all_reduce", p.grad_bytes, 2, clusters.preset("cpu-2-ib100").link(False))
    path = cpu + link
    busy = 2 * cpu / path
    assert c2.iteration_s == pytest.approx(path + (float(np.interp(busy, [1, 2, 4], [1.0, 1.6, 3.0])) - 1) * cpu)
    # a GPU cluster's trainers each have a device: no sharing
    g = next(c for c in model.predict(p, clusters.preset("gpu-1"), batch_sizes=[600], pipelines=["none"])
             if c.refused is None)
    assert g.iteration_s == pytest.approx(cpu)


def test_expected_max_of_normals():
    """E[max of n standard normals]: 0, 1 / sqrt(pi), 1.0294 (tables of normal order statistics)."""
    assert model.expected_max_normal(1) == 0.0
    assert model.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert model.expected_max_normal(4) == pytest.approx(1.02938, rel=1e-4)
    assert model.expected_max_normal(16) == pytest.approx(1.76599, rel=1e-4)


def test_synchronised_ranks_wait_for_the_slowest():
    """A step-time spread cv adds cv E[max of W] of the rank's CPU seconds to an iteration of W
    ranks, sqrt(3) times that for a store whose ranks meet three times an iteration (sven's
    dispatch and aggregation, then the gradients), and nothing to one trainer."""
    two = dataclasses.replace(clusters.preset("dgx-8"), name="two", trainers_per_machine=2)
    base = profile(sizes=(600,))
    spread = dataclasses.replace(base, batches=[dataclasses.replace(b, step_cv=0.1) for b in base.batches])
    cpu = sum(base.batches[0].seconds.values())  # each trainer has a device: no shared cores, no real collectives

    def one(p, backend):
        return next(c for c in model.predict(p, two, batch_sizes=[600], backends=[backend], pipelines=["none"])
                    if c.refused is None and (c.i, c.j, c.k) == ((1, 1, 2) if backend == "local" else (2, 1, 1)))

    for backend, phases in (("local", 1), ("sven", 3)):
        quiet, waited = one(base, backend), one(spread, backend)
        wait = 0.1 * model.expected_max_normal(2) * math.sqrt(phases) * cpu
        assert quiet.stages["straggler"] == 0.0
        assert waited.iteration_s - quiet.iteration_s == pytest.approx(wait, rel=1e-6)
        assert waited.stages["straggler"] == pytest.approx(wait * waited.iterations, rel=1e-6)
    single = [c for c in model.predict(spread, clusters.preset("gpu-1"), batch_sizes=[600], pipelines=["none"])
              if c.refused is None]
    assert single and all(c.stages["straggler"] == 0.0 for c in single)


def test_placement_share_prices_the_dispatch():
    """sven's dispatch time follows the placement's remote share and imbalance (profiled at M)."""
    p = profile(sizes=(600,), placements=[PlacementShare("range", 4, 0.75, 2.0), PlacementShare("reflexbicut", 4, 0.3, 1.0)])
    c = clusters.Cluster(name="x", machines=1, trainers_per_machine=4, intra_link="eth10", inter_link="eth10",
                         host_memory_gb=64, device_memory_gb=16)
    got = {x.placement: x for x in model.predict(p, c, batch_sizes=[600], backends=["sven"], pipelines=["none"])
           if x.refused is None and x.i == 4}
    link = 1.25e9
    rows = 12 * 600 * 0.4
    assert got["range"].stages["dispatch"] / got["range"].iterations == pytest.approx(4 * 50e-6 + rows * 0.75 * 2.0 * ROW_BYTES / link)
    assert got["reflexbicut"].stages["dispatch"] < got["range"].stages["dispatch"]
    assert got["reflexbicut"].epoch_s < got["range"].epoch_s


# ------------------------------------------------------------------------------------------------
# Refusals


def test_refusals_name_the_reason():
    p = profile(sizes=(600,))
    c = clusters.Cluster(name="x", machines=1, trainers_per_machine=4, intra_link="nvlink", inter_link="nvlink",
                         host_memory_gb=64, device_memory_gb=16)
    ranked = model.predict(p, c, batch_sizes=[600])
    why = {(x.layout, x.backend, x.pipeline): x.refused for x in ranked if x.refused}
    assert "epoch parallelism" in why[("2x2x1", "depcomm", "none")]  # the runtime's own check
    assert "pipeline.mode=mspipe" in why[("4x1x1", "sven", "mspipe")]
    assert "local memory serves one trainer" in why[("4x1x1", "local", "none")]
    # a device too small for a whole copy refuses the stores that hold one, not the partitioned ones
    big = profile(sizes=(600,), num_nodes=8_000_000)
    small = clusters.Cluster(name="s", machines=1, trainers_per_machine=4, intra_link="nvlink", inter_link="nvlink",
                             host_memory_gb=512, device_memory_gb=12)
    got = {(x.layout, x.backend, x.pipeline): x for x in model.predict(big, small, batch_sizes=[600])}
    assert "GiB per trainer" in got[("4x1x1", "depcache", "none")].refused
    assert got[("4x1x1", "sven", "none")].refused is None


# ------------------------------------------------------------------------------------------------
# The cluster description and the profile file


def test_cluster_presets_and_yaml(tmp_path):
    assert clusters.preset("gpu-4x8-ib100").trainers == 32
    assert clusters.cluster_of("cpu-2-eth10").simulated
    f = tmp_path / "mine.yaml"
    f.write_text("machines: 2\ntrainers_per_machine: 4\nintra_link: nvlink\ninter_link: 25gbps:5us\n"
                 "host_memory_gb: 256\ndevice_memory_gb: 24\n")
    c = clusters.cluster_of(str(f))
    assert (c.name, c.trainers, c.link(True).bandwidth) == ("mine", 8, 25e9 / 8)
    f.write_text("machines: 2\ntrainers: 4\n")
    with pytest.raises(ConfigError, match="unknown key"):
        clusters.load(f)
    with pytest.raises(ConfigError, match="unknown cluster"):
        clusters.cluster_of("nosuch")
    with pytest.raises(ConfigError, match="intra_link"):
        Cluster(name="b", machines=1, trainers_per_machine=1, intra_link="fast", inter_link="eth10", host_memory_gb=1)


def test_profile_round_trip(tmp_path):
    p = profile(placements=[PlacementShare("range", 2, 0.5, 1.1)], largest_batch=1200)
    write(p, tmp_path / "p.json")
    q = read(tmp_path / "p.json")
    assert q == p and math.isinf(q.collectives["bytes_per_s"])
    # a profile written before the stream factor and the step spread reads with neither
    old = p.as_json()
    for b in old["batches"]:
        del b["stream_factor"], b["step_cv"]
    (tmp_path / "old.json").write_text(__import__("json").dumps(old))
    assert read(tmp_path / "old.json").batches[0].step_cv == 0.0
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not a profile"):
        read(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------------
# The command line


def run_cli(argv, capsys):
    from tgdist.cli import main as cli_main

    rc = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


TINY = ["data=synthetic", "data.synthetic.num_events=3000", "data.synthetic.num_nodes=200"]


def test_plan_profile_then_advise(tmp_path, capsys):
    """``tgdist plan --profile`` measures (a progress line per stage), writes the profile, and
    advises: the table, the best candidate's launch and sbatch lines, the PNG and the sweep, whose
    experiment files compose to the candidates' configs."""
    from tgdist.runtime.build import compose

    prof, png, sweep = tmp_path / "p.json", tmp_path / "top.png", tmp_path / "sweep"
    rc, out, err = run_cli(["--profile", *TINY, "--batch-sizes", "50", "100", "--iterations", "4", "--warmup", "2",
                            "--parts", "2", "--methods", "range", "--largest-batch", "200", "--no-collectives",
                            "--out", str(prof), "--cluster", "cpu-2-eth10", "--top", "3", "--png", str(png),
                            "--sweep", str(sweep)], capsys)
    assert rc == 0, err
    assert "[1/4] batch 50" in err and "[2/4] batch 100" in err and "[3/4] overlap: prefetch" in err
    assert "[4/4] placements at M = 2" in err
    p = read(prof)
    assert p.batch_sizes() == [50, 100] and p.largest_batch == 200 and p.accuracy_source == "given"
    assert p.placement("range", 2) is not None and p.data["num_train_events"] > 0
    assert 0.0 <= p.overlap["prefetch"] <= 1.0
    assert all(b.rows_distinct <= b.rows_sampled and b.seconds["compute"] > 0 for b in p.batches)
    assert all(set(b.stream_factor) == set(STAGES) and b.step_cv >= 0 for b in p.batches)
    assert "epoch s" in out and "best: " in out and p.data["device"] == "cpu" and "note: the profile" not in out
    launch = next(ln for ln in out.splitlines() if ln.strip().startswith("tgdist launch --nproc 2"))
    assert "parallel.link=eth10" in launch and "data.synthetic.num_events=3000" in launch
    assert any(ln.strip().startswith("sbatch --nodes 1") for ln in out.splitlines())
    assert png.stat().st_size > 1000
    files = sorted((sweep / "experiment").glob("advice_*.yaml"))
    assert len(files) == 3 and (sweep / "sweep.sh").exists()
    sweep_line = next(ln for ln in out.splitlines() if ln.startswith("sweep over the top 3: "))
    assert sweep_line.split(": ", 1)[1] in (sweep / "sweep.sh").read_text()
    from tgdist.launcher import launch

    assert launch.main(["--dry-run", "--nproc", "2", "--", "-m", f"hydra.searchpath=[file://{sweep}]",
                        "experiment=advice_01,advice_02,advice_03", *TINY, f"run_dir={tmp_path}/runs"]) == 0
    assert capsys.readouterr().out.count("torch.distributed.run --nproc-per-node 2") == 3
    ranked = [c for c in model.predict(p, clusters.preset("cpu-2-eth10")) if c.refused is None]
    for f, c in zip(files, ranked):
        cfg = compose([f"hydra.searchpath=[file://{sweep}]", f"experiment={f.stem}", *TINY])
        assert (cfg.parallel.i, cfg.parallel.j, cfg.parallel.k) == (c.i, c.j, c.k)
        assert cfg.train.batch_size == c.batch_size and cfg.parallel.link == "eth10"
        assert (cfg.train.epochs % (c.j * c.k)) == 0


def test_plan_from_profile_json_and_errors(tmp_path, capsys):
    import json

    f = tmp_path / "p.json"
    write(profile(sizes=(200, 600), largest_batch=1200, saturation_batch=600), f)
    cpu_profile = dataclasses.replace(read(f), data={**read(f).data, "device": "cpu"})
    write(cpu_profile, f)
    rc, out, _ = run_cli(["--from-profile", str(f), "--cluster", "gpu-4x8-ib100", "--top", "2"], capsys)
    assert rc == 0 and "note: the profile was taken on cpu, the cluster's trainers are cuda" in out
    rc, out, _ = run_cli(["--from-profile", str(f), "--cluster", "gpu-4x8-ib100", "--json"], capsys)
    got = json.loads(out)
    assert rc == 0 and got["best"]["sbatch"].startswith("sbatch --nodes 4 --gpus-per-node 8")
    assert "--nnodes 4" in got["best"]["launch"]
    assert {c["refused"] is None for c in got["candidates"]} == {True, False}
    for argv, words in [(["--from-profile", str(f)], "needs --cluster"),
                        (["--from-profile", str(f), "--cluster", "nosuch"], "unknown cluster"),
                        (["--from-profile", str(tmp_path / "none.json"), "--cluster", "gpu-1"], "cannot read")]:
        rc, out, err = run_cli(argv, capsys)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_collective_costs_on_this_machine():
    from tgdist.launcher.advisor.measure import collective_costs

    got = collective_costs(repeats=3)
    assert got["fixed_s"] > 0 and got["bytes_per_s"] > 0, got


def test_paid_costs_take_what_two_processes_paid_beyond_the_model():
    """A collective as a run pays it: the seconds two sven ranks spent in the gradients' all-reduce,
    less the model's own wait for the slower rank at that meeting and the bytes at the idle rate;
    the seconds in the store, less the one process's memory read and write, the waits at its two
    meetings and its bytes, per collective; the median over batch sizes, never below 0."""
    from tgdist.launcher.advisor.measure import paid_costs

    runs = {"batches": [100, 200, 400], "gradients_s": [0.004, 0.0035, 0.005], "store_s": [0.008, 0.0095, 0.012],
            "calls": [6.0, 6.0, 6.0], "bytes": [200_000, 400_000, 800_000]}
    alone, alone_store, bps, grad = [0.010, 0.012, 0.020], [0.001, 0.0015, 0.002], 1e9, 1_000_000
    got = paid_costs(runs, alone, alone_store, [0.0, 0.0, 0.0], grad, bps)
    # gradients: 4 - 1, 3.5 - 1, 5 - 1 ms -> median 3 ms
    assert got["gradient_s"] == pytest.approx(0.003)
    # store: (8 - 1 - 0.2) / 6, (9.5 - 1.5 - 0.4) / 6, (12 - 2 - 0.8) / 6 ms -> median 7.6 / 6 ms
    assert got["exchange_s"] == pytest.approx(0.0076 / 6, rel=1e-4)
    assert got["paid"]["alone_s"] == alone and got["paid"]["store_s"] == runs["store_s"]
    # a step-time spread: the model's own waits (cv E[max of 2] of the step over three meetings, one
    # at the all-reduce and two at the store's) are taken off, so that it does not count them twice
    one = {k: v[1:2] for k, v in runs.items()}  # batch 200 alone
    spread = paid_costs(one, alone[1:2], alone_store[1:2], [0.1], grad, bps)
    wait = 0.1 * model.expected_max_normal(2) / math.sqrt(3) * 0.012
    assert spread["gradient_s"] == pytest.approx(0.0035 - wait - 0.001, abs=1e-7)  # (7 decimals kept)
    assert spread["exchange_s"] == pytest.approx((0.0095 - 0.0015 - 2 * wait - 0.0004) / 6, abs=1e-7)
    # two processes that paid nothing beyond the model: no cost, not a negative one
    free = paid_costs({**runs, "gradients_s": [0.0] * 3, "store_s": alone_store}, alone, alone_store, [0.0] * 3,
                      grad, bps)
    assert free["gradient_s"] == 0.0 and free["exchange_s"] == 0.0


def test_paid_collectives_price_the_profile_machine_only():
    """On the profile's machine (a simulated cluster) sven pays its six collectives at the paid
    store cost and the all-reduce at the paid gradient cost, besides their bytes at the idle rate;
    without the paid measure both fall back to the idle cost; a real cluster pays neither."""
    coll = {"fixed_s": 1e-4, "bytes_per_s": 1e9}
    paid = {**coll, "exchange_s": 1e-3, "gradient_s": 3e-3}
    cpu2 = dataclasses.replace(clusters.preset("cpu-2-ib100"), cores_per_machine=64)  # no shared cores

    def pick(p, cluster, backend):
        return next(c for c in model.predict(p, cluster, batch_sizes=[600], backends=[backend], pipelines=["none"])
                    if c.refused is None and (c.i, c.j, c.k) == ((1, 1, 2) if backend == "local" else (2, 1, 1)))

    for backend, store_calls in (("local", 0), ("sven", 6)):
        with_paid = pick(profile(sizes=(600,), collectives=paid), cpu2, backend)
        idle = pick(profile(sizes=(600,), collectives=coll), cpu2, backend)
        per_with, per_idle = (c.stages["collective_cpu"] / c.iterations for c in (with_paid, idle))
        assert per_with - per_idle == pytest.approx(store_calls * (1e-3 - 1e-4) + (3e-3 - 1e-4), rel=1e-6)
        two_gpus = dataclasses.replace(clusters.preset("dgx-8"), name="two", trainers_per_machine=2)
        real = pick(profile(sizes=(600,), collectives=paid), two_gpus, backend)
        assert real.stages["collective_cpu"] == 0.0


def test_exchange_runs_on_this_machine():
    """Two real sven trainer processes over the window: an iteration's wall, its seconds in the
    gradients' all-reduce and in the store (less than the wall), and sven's six collectives an
    iteration (request, dispatch, aggregation: two each) with the bytes its store sent."""
    from tgdist.launcher.advisor.measure import exchange_runs

    got = exchange_runs([*TINY, "model=tgn", "train.device=cpu", "train.progress=false", "train.num_neg_eval=1"],
                        [(50, 2, 6), (100, 2, 6)], timeout=300)
    assert got["batches"] == [50, 100] and got["windows"] == [[50, 2, 6], [100, 2, 6]]
    for wall, grads, store in zip(got["wall_s"], got["gradients_s"], got["store_s"]):
        assert 0 < grads < wall and 0 < store < wall, got
    assert got["calls"] == [6.0, 6.0] and all(b > 0 for b in got["bytes"]), got
    assert set(got["calls_by_name"][50]) >= {"dispatch.sizes", "aggregation.sizes"}


def test_exchange_runs_fail_with_the_ranks_error():
    """A rank that fails names its error in one line (the profile then notes it and keeps the idle
    cost), and neither rank is left behind."""
    from tgdist.launcher.advisor.measure import exchange_runs

    with pytest.raises(RuntimeError, match="nosuch"):
        exchange_runs([*TINY, "train.device=cpu", "train.nosuch=1"], [(50, 2, 4)], timeout=120)
    assert _children_running("--exchange-worker") == []


def test_exchange_runs_end_the_peer_of_a_killed_rank(monkeypatch):
    """One rank killed mid-run (``TGDIST_FAULT_KILL``): the call fails at once naming the exit, not
    after gloo's timeout with the other rank waiting for its peer, and leaves no rank running."""
    import time

    from tgdist.launcher.advisor.measure import exchange_runs

    monkeypatch.setenv("TGDIST_FAULT_KILL", "1:2")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1: exit -9"):
        exchange_runs([*TINY, "model=tgn", "train.device=cpu", "train.progress=false"], [(50, 2, 4)], timeout=240)
    assert time.monotonic() - t0 < 120
    assert _children_running("--exchange-worker") == []


def _children_running(word: str) -> list[str]:
    """Command lines of this process's children that hold ``word`` (from /proc)."""
    import os

    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if word in cmd:
                    found.append(cmd)
        except (OSError, IndexError, ValueError):  # (a process that ended meanwhile)
            continue
    return found


def test_saturation_and_largest_safe():
    from tgdist.launcher.advisor.measure import largest_safe, saturation

    assert saturation([200, 600, 1200, 2400], [10_000, 25_000, 29_000, 30_000]) == 1200
    assert largest_safe([200, 600, 1200, 2400], [0.95, 0.948, 0.942, 0.90], 0.01) == 1200


def test_best_takes_the_least_risk_among_near_ties():
    """A predicted gain within 5% does not buy an accuracy risk; a larger one does; beyond L comes last."""
    from tgdist.launcher.advisor.report import best

    def cand(pipe, t, risk):
        return model.Candidate(1, 1, 1, "local", pipe, None, 600, epoch_s=t, risk_level=risk)

    assert best([cand("mspipe", 1.77, 1), cand("prefetch", 1.78, 0), cand("none", 1.79, 0)]).pipeline == "prefetch"
    assert best([cand("mspipe", 1.50, 1), cand("prefetch", 1.78, 0)]).pipeline == "mspipe"
    assert best([cand("none", 1.0, 0), cand("prefetch", 0.5, 2)]).pipeline == "none"  # as predict ranks them
    assert best([]) is None


def test_core_sharing_on_this_machine():
    """Processes side by side: 1.0 alone, and never less than R / CPUs times slower."""
    import os

    from tgdist.launcher.advisor.measure import core_sharing

    got = core_sharing((1, 2), work=300, rounds=1)
    assert got["1"] == 1.0 and got["2"] >= max(1.0, 2 / (os.cpu_count() or 1)), got


# ------------------------------------------------------------------------------------------------
# Issue 52: the profile's progress and file, --quick, bad input before any measuring, the sweep's
# files, corrupt profiles, layouts the runtime refuses, absurd clusters, and the link's units


def test_link_costs_bytes_not_bits():
    """A hand-computed iteration of sven at 2 x 1 x 1 on a 8 Gbit/s link (1e9 bytes/s, 10 us per
    collective): every byte count divided by bytes per second, never by bits (a model that priced
    bytes as bits would be 8x slow on each transfer). b = 600, 12 rows per event, eta1 = 0.6,
    eta2 = 0.2, rows of 1,904 bytes, half of them on the other trainer (the ideal placement):
    dispatch 2,880 x 0.5 x 1,904 = 2,741,760 B in four collectives, aggregation 960 x 0.5 x 1,904 =
    913,920 B in two, the gradients' ring all-reduce 2 x (1/2) x 1,200,000 B in one."""
    two = Cluster(name="two", machines=1, trainers_per_machine=2, intra_link="8gbps:10us", inter_link="8gbps:10us",
                  host_memory_gb=64, device_memory_gb=16)
    c = next(c for c in model.predict(profile(sizes=(600,)), two, batch_sizes=[600], backends=["sven"],
                                      pipelines=["none"], placements=["range"]) if c.refused is None and c.i == 2)
    assert c.iterations == 84  # ceil(100,000 / (2 x 600))
    per = {s: v / c.iterations for s, v in c.stages.items()}
    assert per["dispatch"] == pytest.approx(4 * 10e-6 + 2_741_760 / 1e9, rel=1e-9)  # 2.78176 ms
    assert per["aggregation"] == pytest.approx(2 * 10e-6 + 913_920 / 1e9, rel=1e-9)  # 0.93392 ms
    assert per["allreduce"] == pytest.approx(10e-6 + 1_200_000 / 1e9, rel=1e-9)  # 1.21 ms
    assert c.bytes_per_epoch == pytest.approx(84 * 2 * (2_741_760 + 913_920 + 1_200_000), rel=1e-12)
    # the whole iteration: the stages in turn, the aggregation hidden by the backward half of compute
    stages = 600 * (1e-5 + 1e-5 + 2e-6 + 5e-5 + 2e-6)
    assert c.iteration_s == pytest.approx(stages + 2.78176e-3 + 1.21e-3, rel=1e-9)
    # on the profile's own machine (ib100: 100 Gbit/s = 12.5e9 bytes/s, 5 us) the real collectives
    # add their bytes at the measured bytes per second (1e9): six store collectives, one all-reduce
    here = dataclasses.replace(clusters.preset("cpu-2-ib100"), cores_per_machine=64)
    coll = {"fixed_s": 1e-4, "bytes_per_s": 1e9, "exchange_s": 1e-3, "gradient_s": 3e-3}
    h = next(c for c in model.predict(profile(sizes=(600,), collectives=coll), here, batch_sizes=[600],
                                      backends=["sven"], pipelines=["none"], placements=["range"])
             if c.refused is None and c.i == 2)
    hper = {s: v / h.iterations for s, v in h.stages.items()}
    assert hper["dispatch"] == pytest.approx(4 * 5e-6 + 2_741_760 / 12.5e9, rel=1e-9)
    assert hper["allreduce"] == pytest.approx(5e-6 + 1_200_000 / 12.5e9, rel=1e-9)
    assert hper["collective_cpu"] == pytest.approx(6 * 1e-3 + 3e-3 + (2_741_760 + 913_920 + 1_200_000) / 1e9,
                                                   rel=1e-9)


def test_progress_lines_within_a_step(monkeypatch, capsys):
    """A step's progress: done of total and the time left, at most every PROGRESS_EVERY seconds."""
    from tgdist.launcher.advisor import measure

    monkeypatch.setattr(measure, "PROGRESS_EVERY", 3600.0)
    p = measure.Progress("[2/9] batch 600", 40, "iterations")
    for n in range(1, 41):
        p.update(n)
    assert capsys.readouterr().err == ""  # nothing sooner than PROGRESS_EVERY
    monkeypatch.setattr(measure, "PROGRESS_EVERY", 0.0)
    p = measure.Progress("[2/9] batch 600", 40, "iterations")
    p.t0 -= 10.0  # ten seconds spent on the first 10: thirty left
    p.update(10)
    err = capsys.readouterr().err
    assert err.startswith("tgdist plan --profile: [2/9] batch 600: 10 of 40 iterations (10 s, about 30 s left)"), err


def test_profile_written_before_the_advice_with_progress(tmp_path, monkeypatch, capsys):
    """``--profile ... --cluster`` without ``--out``: profile.json is written (where the command runs)
    before any advice is computed, the long steps print progress within them, and the line that
    says so names the --from-profile form that reuses it."""
    from tgdist.launcher.advisor import cli, measure

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(measure, "PROGRESS_EVERY", 0.0)
    seen = []
    real = cli.predict

    def predict_after_the_file(prof, *a, **kw):
        seen.append(read(tmp_path / "profile.json").as_json() == prof.as_json())
        return real(prof, *a, **kw)

    monkeypatch.setattr(cli, "predict", predict_after_the_file)
    rc, out, err = run_cli(["--profile", *TINY, "--quick", "--batch-sizes", "50", "100", "--no-collectives",
                            "--cluster", "cpu-2-eth10", "--top", "2"], capsys)
    assert rc == 0, err
    assert seen == [True]
    p = read(tmp_path / "profile.json")
    assert p.batch_sizes() == [50, 100] and p.batches[0].iterations == 10 and p.largest_batch is None
    assert {(q.method, q.parts) for q in p.placements} == {("reflexbicut", 2), ("reflexbicut", 4)}
    assert p.accuracy_source == "none"
    assert "wrote profile.json" in err and "--from-profile profile.json" in err
    assert "L (the largest global batch without accuracy loss) was not measured" in out and "best: " in out
    within = [ln for ln in err.splitlines() if "] batch 50: " in ln and " of " in ln and " left)" in ln]
    assert within and "iterations" in within[0], err
    assert any("] placements: " in ln and " left)" in ln for ln in err.splitlines()), err


def test_quick_settings_and_flags_over_them():
    from tgdist.launcher.advisor import cli

    args = cli._parser().parse_args(["--profile", "data=wikipedia", "--quick"])
    assert cli._settings(args) == cli.QUICK
    args = cli._parser().parse_args(["--profile", "data=wikipedia", "--quick", "--iterations", "20"])
    assert cli._settings(args) == {**cli.QUICK, "iterations": 20}
    assert cli._settings(cli._parser().parse_args(["--profile"])) == cli.FULL


def _no_measuring(monkeypatch):
    from tgdist.launcher.advisor import measure

    def measured(*a, **kw):
        raise AssertionError("measured before the input was checked")

    monkeypatch.setattr(measure, "measure", measured)


def test_inputs_refused_before_any_measuring(tmp_path, monkeypatch, capsys):
    """Every advisor input error is one line (exit 2) before any measuring: an output folder missing
    or read-only, an output file there already, a picture type matplotlib cannot write, a cluster
    unknown, a partition method unknown, a bad override, flags that go with another mode."""
    _no_measuring(monkeypatch)
    (tmp_path / "taken.json").write_text("mine")
    (tmp_path / "cl.yaml").write_text("machines: 0\ntrainers_per_machine: 2\nintra_link: eth10\nhost_memory_gb: 8\n")
    f = tmp_path / "p.json"
    write(profile(sizes=(200, 600)), f)
    profile_call = ["--profile", *TINY, "--quick"]
    cases = [
        ([*profile_call, "--out", str(tmp_path / "missing" / "p.json")], "does not exist"),
        ([*profile_call, "--out", str(tmp_path)], "a folder"),
        ([*profile_call, "--out", str(tmp_path / "taken.json")], "--overwrite"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--cluster", "cpu-2-eth10", "--png",
          str(tmp_path / "missing" / "top.png")], "does not exist"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--cluster", "cpu-2-eth10", "--png",
          str(tmp_path / "top.nosuch")], "ending in .png"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--cluster", "nosuch"], "unknown cluster"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--cluster", str(tmp_path / "cl.yaml")], "machines"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--methods", "nosuch"], "not a partition method"),
        ([*profile_call, "--out", str(tmp_path / "p2.json"), "--png", str(tmp_path / "top.png")], "needs --cluster"),
        (["--profile", *TINY, "train.nosuch=1", "--out", str(tmp_path / "p2.json")], "nosuch"),
        (["--from-profile", str(f), "--quick", "--cluster", "gpu-1"], "goes with --profile"),
        (["--from-profile", str(f), "--cluster", "gpu-1", "--placements", "nosuch"], "not a partition method"),
    ]
    for argv, words in cases:
        rc, out, err = run_cli(argv, capsys)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "p2.json").exists() and (tmp_path / "taken.json").read_text() == "mine"


def test_read_only_output_folder_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """A folder that takes no files (here /sys: even root cannot write there) is refused at once."""
    from tgdist.data.graph import unwritable

    if unwritable(Path("/sys")) is None:
        pytest.skip("/sys takes files here")
    _no_measuring(monkeypatch)
    rc, _, err = run_cli(["--profile", *TINY, "--out", "/sys/profile.json"], capsys)
    assert rc == 2 and "cannot write in /sys" in err and len(err.strip().splitlines()) == 1, err


def test_sweep_never_replaces_a_user_file(tmp_path, capsys):
    """``--top 2 --sweep DIR`` into a folder holding the user's own sweep.sh: refused in one line
    naming --overwrite, the file as it was; with --overwrite the sweep's files are replaced and an
    older sweep's extra advice file does not stay beside them."""
    f = tmp_path / "p.json"
    write(profile(sizes=(200, 600), largest_batch=1200, saturation_batch=600), f)
    d = tmp_path / "advice"
    (d / "experiment").mkdir(parents=True)
    (d / "sweep.sh").write_text("#!/bin/bash\necho my own script\n")
    argv = ["--from-profile", str(f), "--cluster", "dgx-8", "--top", "2", "--sweep", str(d)]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and "--overwrite" in err and "sweep.sh" in err and len(err.strip().splitlines()) == 1, err
    assert (d / "sweep.sh").read_text() == "#!/bin/bash\necho my own script\n" and out == ""
    (d / "experiment" / "advice_07.yaml").write_text("# an older sweep's\n")
    rc, out, err = run_cli([*argv, "--overwrite"], capsys)
    assert rc == 0, err
    assert "my own script" not in (d / "sweep.sh").read_text()
    assert sorted(p.name for p in (d / "experiment").iterdir()) == ["advice_01.yaml", "advice_02.yaml"]


def _corrupt(good: dict, change) -> object:
    import copy

    d = copy.deepcopy(good)
    return change(d)


@pytest.mark.parametrize("name, change, words", [
    ("object", lambda d: {}, "no data"),
    ("list", lambda d: [], "a list"),
    ("string", lambda d: "abc", "a string"),
    ("string batch", lambda d: (d["batches"][0].update(batch_size="200"), d)[1], "batches[0].batch_size is a string"),
    ("nan stage", lambda d: (d["batches"][0]["seconds"].update(compute=float("nan")), d)[1],
     "batches[0].seconds.compute is nan"),
    ("no batches", lambda d: (d.update(batches=[]), d)[1], "batches is empty"),
    ("version 99", lambda d: (d.update(version=99), d)[1], "profile version 99, written by a newer tgdist"),
])
def test_corrupt_profile_is_one_line(tmp_path, capsys, name, change, words):
    import json

    good = profile(sizes=(200, 600)).as_json()
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_corrupt(good, change)))  # (NaN as JSON's NaN token, as Python writes it)
    rc, out, err = run_cli(["--from-profile", str(f), "--cluster", "gpu-1"], capsys)
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and out == ""


def test_never_ranks_a_layout_the_runtime_refuses():
    """1,000 training events at local batch 600 on 4 trainers: 1 x 1 x 4 has 2 global batches for 4
    memory segments, which the runtime refuses (its launch line would fail): the advisor refuses it
    with the runtime's reason, and every candidate it ranks passes the launcher's own check."""
    from tgdist import memory
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import WorldInfo, validate

    p = profile(sizes=(600,), events=1000)
    four = Cluster(name="four", machines=1, trainers_per_machine=4, intra_link="nvlink", inter_link="nvlink",
                   host_memory_gb=64, device_memory_gb=16)
    ranked = model.predict(p, four, batch_sizes=[600])
    why = {(c.layout, c.backend, c.pipeline): c.refused for c in ranked}
    assert "cannot be cut into parallel.k = 4 memory segments" in why[("1x1x4", "local", "none")]
    # 1,202 events at local batch 300 on 4 trainers: DepComm's last global batch holds 2 events for
    # i = 4 trainers, which its builder refuses; sven runs it
    uneven = {(c.layout, c.backend, c.pipeline): c.refused
              for c in model.predict(profile(sizes=(300,), events=1202), four, batch_sizes=[300])}
    assert "the last global batch has 2 events for parallel.i=4" in uneven[("4x1x1", "depcomm", "none")]
    assert uneven[("4x1x1", "sven", "none")] is None
    ok = [c for c in ranked if c.refused is None]
    assert ok
    for c in ok:
        layout = Layout(c.i, c.j, c.k)
        name = memory.resolve("auto" if c.backend == "local" else c.backend, layout.group_size)
        validate(layout, WorldInfo(world_size=4, local_world_size=4, num_nodes=1, launcher="torchrun"), name,
                 placement=memory.store_class(name).placement, num_train_events=1000, batch_size=c.batch_size)


def test_absurd_cluster_answers_at_once(tmp_path):
    """100,000 machines x 1,000 GPUs: a one-line bound on the combinations (or, narrowed, an
    answer), never a spin; 10^12 trainers: refused by the cluster itself. A subprocess with a
    generous timeout guards against a hang (it is not a timed assertion)."""
    import subprocess
    import sys

    f = tmp_path / "p.json"
    write(profile(sizes=(200, 600), largest_batch=1200, saturation_batch=600), f)
    huge = tmp_path / "huge.yaml"
    huge.write_text("machines: 100000\ntrainers_per_machine: 1000\nintra_link: nvlink\ninter_link: ib100\n"
                    "host_memory_gb: 1024\ndevice_memory_gb: 80\n")
    vast = tmp_path / "vast.yaml"
    vast.write_text("machines: 1000000000\ntrainers_per_machine: 1000\nintra_link: nvlink\nhost_memory_gb: 1024\n")

    def plan(*argv):
        return subprocess.run([sys.executable, "-m", "tgdist", "plan", "--from-profile", str(f), *argv],
                              capture_output=True, text=True, timeout=180, check=False)

    r = plan("--cluster", str(huge))
    assert r.returncode == 2 and "combinations to predict" in r.stderr and "--backends" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = plan("--cluster", str(huge), "--backends", "sven", "--pipelines", "none", "--placements", "range", "--top", "3")
    assert r.returncode == 0 and "best: " in r.stdout, r.stderr
    r = plan("--cluster", str(vast))
    assert r.returncode == 2 and "trainers, more than" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help_cites_pages_that_exist():
    """``tgdist plan --help`` and ``tgdist plan --profile --help`` name docs/advisor.md, which exists."""
    import re

    from tgdist.launcher import planner
    from tgdist.launcher.advisor import cli

    root = Path(__file__).resolve().parents[2]
    for text in (cli._parser().format_help(), planner._parser().format_help()):
        pages = re.findall(r"docs/[\w.-]+\.md", text)
        assert "docs/advisor.md" in pages
        assert all((root / page).is_file() for page in pages), pages


# ------------------------------------------------------------------------------------------------
# Strategies price themselves (issue 54): the advisor reads the registries, never a name


def _code_strings(tree) -> list[str]:
    """The string constants of a module's code, docstrings left out (prose may name a paper)."""
    import ast

    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_advisor_names_no_store_or_pipeline():
    """No registered memory store or pipeline strategy (``memory.names()``, the pipeline registry's
    names and aliases) is named in ``tgdist/launcher/advisor/``'s code: no string that is one, no
    override that picks one (``memory.backend=NAME``, ``pipeline=NAME``, ...), no import of a
    strategy's module and no identifier that is one."""
    import ast
    import re

    from tgdist import memory
    from tgdist.runtime import pipelines
    from tgdist.runtime.pipelines.registry import ALIASES

    names = set(memory.names()) | set(pipelines.names())
    picks = names | set(ALIASES)
    assert {"sven", "depcache", "depcomm", "daemon", "local", "mspipe", "plain"} <= names
    pick = re.compile(r"(?:^|[\s'\"])(?:memory|memory\.backend|pipeline|pipeline\.mode)=(%s)\b"
                      % "|".join(map(re.escape, sorted(picks))))
    found = []
    for path in sorted(Path(model.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for text in _code_strings(tree):
            if text.strip() in names or pick.search(text):
                found.append(f"{path.name}: {text!r}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and set(node.module.split(".")) & names:
                found.append(f"{path.name}: from {node.module}")
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if set(a.name.split(".")) & names]
            # its own names (variables, arguments, functions, classes; not other APIs' keywords or fields)
            ident = (node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg)
                     else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
            if ident in names:
                found.append(f"{path.name}: identifier {ident}")
    assert not found, found


def test_predictions_equal_the_model_before():
    """The same saved profile (``advisor_profile.json``) fed to the model gives the predictions the
    model gave before the strategies priced themselves (``advisor_expected.json``, written by that
    model, d21f7a4): per candidate of four clusters, its epoch seconds, memory per rank, bytes per
    epoch, micro-batches, staleness and risk level, and which candidates are refused. The old
    pipeline level prefetch+micro, which no preset of configs/pipeline/ is, has no candidate now."""
    import json

    prof = read(Path(__file__).with_name("advisor_profile.json"))
    expected = json.loads(Path(__file__).with_name("advisor_expected.json").read_text())
    compared = 0
    for name, rows in expected.items():
        got = {c.label(): c for c in model.predict(prof, clusters.preset(name), batch_sizes=[300],
                                                  placements=["reflexbicut"])}
        for label, want in rows.items():
            if " prefetch+micro " in label:
                continue
            c = got[label]
            if want == 0:
                assert c.refused is not None, (name, label)
                continue
            assert c.refused is None, (name, label, c.refused)
            assert [c.epoch_s, c.memory_per_rank_gb, c.bytes_per_epoch] == pytest.approx(want[:3], rel=1e-9), label
            assert [c.micro_batches, c.staleness, c.risk_level] == want[3:], label
            compared += 1
    assert compared > 200  # (229 runnable candidates of the 500 compared)


def test_pipeline_candidates_are_the_composed_presets():
    """Every preset of configs/pipeline/ is a candidate, its settings what ``tgdist train
    pipeline=NAME`` composes, priced and checked by the strategy its ``pipeline.mode`` names."""
    from omegaconf import OmegaConf

    from tgdist.config import config_dir
    from tgdist.runtime import pipelines
    from tgdist.runtime.build import compose

    options = model.pipeline_options()
    presets = sorted(p.stem for p in (Path(config_dir()) / "pipeline").glob("*.yaml"))
    assert set(presets) <= set(options)
    for name in presets:
        pipe = OmegaConf.to_container(compose([f"pipeline={name}"]).pipeline, resolve=True)
        assert dict(options[name].pipe) == pipe, name
        assert options[name].strategy is pipelines.pipeline_class(pipe["mode"])


def test_profile_collectives_go_through_tgdist_distributed():
    """The advisor makes no collective of its own: no module of ``tgdist/launcher/advisor/`` imports
    ``torch.distributed`` (the profile's all-reduces are ``tgdist.distributed.collectives``')."""
    import ast

    found = []
    for path in sorted(Path(model.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("torch.distributed")]
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("torch.distributed")
                    or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
                found.append(f"{path.name}: from {node.module}")
    assert not found, found
