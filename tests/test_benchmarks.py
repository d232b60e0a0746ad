"""The benchmark scripts refuse bad arguments in one line before any work, and print strict JSON."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script, args, message", [
    ("vs_pyg_tgn.py", ["--max-events", "-5"], "argument --max-events: -5: give at least 1"),
    ("vs_pyg_tgn.py", ["--epochs", "-1"], "argument --epochs: -1: give at least 0"),
    ("vs_pyg_tgn.py", ["--device", "gpu"], "--device gpu: choose cpu, cuda or cuda:N"),
    ("models.py", ["--data", "bogus", "--models", "jodie"], "In 'train': Could not find 'data/bogus'"),
    ("synthetic_epoch.py", ["--events", "0"], "argument --events: 0: give at least 1"),
    ("sampler.py", ["--batch", "0"], "argument --batch: 0: give at least 1"),
    ("daemon.py", ["--nodes", "200", "--read-ids", "500"], "--write-ids 1200 <= --read-ids 500 <= --nodes 200"),
    ("step_profile.py", ["--window", "0"], "argument --window: 0: give at least 1"),
    ("gpu_predictors.py", ["--count-steps", "0"], "argument --count-steps: 0: give at least 1"),
    ("parallel.py", ["--layouts", "1,1,2", "--epochs", "1"], "train.epochs = 1 is not a multiple of parallel.j x"),
    ("partition.py", ["--synthetic-events", "-1"], "argument --synthetic-events: -1: give at least 1"),
    ("memory_backends.py", ["--trainers", "2", "1"], "argument --trainers: 1: give at least 2"),
    ("memory_backends.py", ["--global-batch", "1001"], "--global-batch 1001 is not a multiple of every trainer count"),
    ("pipelining.py", ["--trainers", "2", "1"], "argument --trainers: 1: give at least 2"),
    ("pipelining.py", ["--links", "warp9"], "parallel.link='warp9': choose none, eth10"),
    ("pipelining.py", ["--configs", "prefetch", "bogus"], "argument --configs: invalid choice: 'bogus'"),
    ("pipelining.py", ["--seed-start", "-1"], "argument --seed-start: -1: give at least 0"),
    ("pipelining.py", ["--merge", "no-such-output.json"], "--merge no-such-output.json: [Errno 2]"),
    ("embedding_cache.py", ["--settings", "off", "0.9"], "setting '0.9': give off or P_GRAD:T_STALE"),
    ("embedding_cache.py", ["--settings", "0.9:5"], "--settings: the first setting is the baseline and must be off"),
    ("embedding_cache.py", ["--host-features"], "--host-features: only with --device cuda"),
    ("mspipe.py", ["--epochs", "0"], "argument --epochs: 0: give at least 1"),
    ("mspipe.py", ["--seeds", "0", "-1"], "argument --seeds: -1: give at least 0"),
    ("mspipe.py", ["--points", "K=1", "auto"], "--points: the baseline 'none' is needed"),
    ("mspipe.py", ["--mitigation", "bogus"], "argument --mitigation: invalid choice: 'bogus'"),
    ("mspipe.py", ["--seeds"], "--seeds: give at least one seed"),
    ("wait_policy.py", ["--reps", "0"], "argument --reps: 0: give at least 1"),
    ("wait_policy.py", ["--settings", "SPIN"], "argument --settings: invalid choice: 'SPIN'"),
    ("compare_trees.py", ["--before", "/nonexistent"], "--before /nonexistent: not a tgdist checkout"),
    ("eval_cost.py", ["--epochs", "0"], "argument --epochs: 0: give at least 1"),
    ("select_study.py", ["--seeds", "-1"], "argument --seeds: -1: give at least 0"),
    ("scale.py", ["ranks", "--events", "0"], "argument --events: 0: give at least 1"),
    ("scale.py", ["gather", "--batches", "0"], "argument --batches: 0: give at least 1"),
    ("advisor.py", ["--settings", "2"], "--settings 2: give M:LINK"),
    ("advisor.py", ["--settings", "2:warp9"], "parallel.link='warp9': choose none, eth10"),
    ("checkpoint_stall.py", ["--trainers", "1"], "argument --trainers: 1: give at least 2"),
])
def test_a_bad_argument_is_one_line_before_any_work(script, args, message, monkeypatch, capsys):
    """Run in this process as ``python SCRIPT ARGS`` would run it (``__main__``, its argv, from its
    folder): a subprocess per case spent 27 torch imports. ``test_a_script_run_as_a_user_runs_it``
    keeps the real command line covered."""
    monkeypatch.chdir(BENCH)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    out, err = capsys.readouterr()
    assert stop.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"{script}: error: {message}"), err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("script, args, message", [
    ("vs_pyg_tgn.py", ["--max-events", "-5"], "argument --max-events: -5: give at least 1"),
    ("models.py", ["--data", "bogus", "--models", "jodie"], "In 'train': Could not find 'data/bogus'"),
])
def test_a_script_run_as_a_user_runs_it(script, args, message):
    r = subprocess.run([sys.executable, script, *args], cwd=BENCH, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"{script}: error: {message}"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_emitted_json_is_strict(capsys, monkeypatch):
    import numpy as np

    monkeypatch.syspath_prepend(str(BENCH))
    from common import emit

    emit({"ratio": float("nan"), "rows": [np.float32(1.5), np.float64("inf")], "n": 3})
    assert json.loads(capsys.readouterr().out) == {"ratio": None, "rows": [1.5, None], "n": 3}


def test_pipelining_paired_differences(monkeypatch):
    """The accuracy section's statistics: differences paired by seed, the t interval and its verdict
    against +-0.5 point, and runs merged from batches of seeds."""
    monkeypatch.syspath_prepend(str(BENCH))
    from pipelining import accuracy_rows, paired, t_975

    assert t_975(1) == 12.706 and t_975(9) == 2.262 and abs(t_975(60) - 2.0003) < 1e-4
    p = paired([0.1, -0.1, 0.2, 0.0])  # mean 0.05, sd 0.1291, se 0.0645, t(3) = 3.182
    assert p["mean_points"] == pytest.approx(0.05) and p["se_points"] == pytest.approx(0.0645497, rel=1e-5)
    assert p["ci95_points"] == pytest.approx([0.05 - 3.182 * 0.0645497, 0.05 + 3.182 * 0.0645497], rel=1e-5)
    assert p["verdict"] == "within"
    assert paired([-1.0, -1.2, -0.9])["verdict"] == "outside"
    assert paired([-1.0, 0.8, 0.1])["verdict"] == "undecided"
    assert paired([0.1])["verdict"] == "undecided"

    def run(config, seed, ap):
        return {"data": "d", "M": 2, "config": config, "seed": seed, "epochs": 3, "overrides": [], "test_ap": ap,
                "epoch_seconds": 1.0}
    # two batches of seeds; the seed of the second batch is paired with its own none only
    rows = accuracy_rows([run("none", 0, 0.70), run("async all-reduce", 0, 0.71), run("none", 1, 0.80),
                          run("async all-reduce", 1, 0.79), run("none", 2, 0.75), run("none", 0, 0.70)])
    none, async_ = rows
    assert none["seeds"] == [0, 1, 2] and none["seed_sd_points"] == pytest.approx(5.0)
    assert async_["paired"]["seeds"] == [0, 1] and async_["paired"]["mean_points"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="seed 0: two runs with different test AP"):
        accuracy_rows([run("none", 0, 0.70), run("none", 0, 0.71)])


@pytest.mark.slow
def test_scale_build_and_gather_print_their_figures(tmp_path):
    """The two quick sections of ``scale.py`` on a tiny stream: the build's peak against the entry it
    wrote, with its progress lines, and the gather timed three ways over the same batches."""
    for section, extra in (("build", []), ("gather", ["--batches", "5", "--edge-dim", "8"])):
        r = subprocess.run([sys.executable, "scale.py", section, "--events", "20000", "--nodes", "500",
                            "--workdir", str(tmp_path), *extra], cwd=BENCH, capture_output=True, text=True,
                           timeout=300, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout)[section]
        if section == "build":
            assert got["events"] == 20000 and got["output_mib"] > 0 and got["peak_rss_mib"] > got["baseline_rss_mib"]
        else:
            assert got["rows_per_batch"] > 0 and set(got["median_over_in_memory"]) == {"mapped_warm", "mapped_cold"}


def test_embedding_cache_breakdown_times_the_cache_work_of_each_step(monkeypatch):
    """``--breakdown``: the cached trainer's lookup, pruning and admission are timed once per step,
    the uncached one has none, and the timers are taken off again afterwards."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH))
    from embedding_cache import paired

    from tgdist.runtime import trainer as trainer_module

    prune = trainer_module.prune_nodes
    args = argparse.Namespace(batch=100, epochs=1, num_neg_eval=1, threads=1, max_events=1500, device="cpu",
                              paired_warmup=3, paired_steps=5, breakdown=True)
    out = paired(args, "collegemsg", ["off", "0.9:20"])
    assert "cache_ms_median" not in out["off"]
    own = out["0.9:20"]["cache_ms_median"]
    assert set(own) == {"lookup", "prune_nodes", "admit", "total"}
    assert 0 < own["lookup"] and 0 < own["admit"] and own["total"] < out["0.9:20"]["median_step_ms"]
    assert out["0.9:20"]["hit_rate"] > 0  # served rows: pruning ran on real work
    assert trainer_module.prune_nodes is prune


def test_gpu_predictors_count_host_reads_and_dispatched_ops(monkeypatch):
    """The counters of ``gpu_predictors.py``: each Python-level read of a tensor value counts once
    (not again as the aten scalar read under it), data-shaped aten ops count, ``.to(device)`` apart
    from the reads, a dtype cast not at all; each call site is this file's line; the dispatched ops
    and views are counted; a read in a ``CPU_ONLY`` line counts apart."""
    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_predictors as gp

    def two_reads(x):
        a = x.sum().item()
        return a + float(x.max())

    def shaped_and_moved(x):
        x[x > 2]
        torch.nonzero(x)
        x.to(torch.float64)
        x.to(torch.device("cpu"))
        np.asarray(x)

    def ops(a, b):
        return (a + b).t()

    def cpu_only(x):
        return int(x.max())

    x = torch.arange(5.0)
    c = gp.Counts()
    with gp.HostReads(c), gp.AtenOps(c):
        two_reads(x)
    assert dict(c.reads) == {"item": 1, "float": 1}
    here = Path(__file__).resolve().relative_to(gp.REPO).as_posix()
    assert {site.split(":")[0] for sites in c.sites.values() for site in sites} == {here}
    assert [site.endswith("(two_reads)") for sites in c.sites.values() for site in sites] == [True, True]
    assert c.text[next(iter(c.sites["float"]))] == "return a + float(x.max())"

    c = gp.Counts()
    with gp.HostReads(c), gp.AtenOps(c):
        shaped_and_moved(x)
    assert dict(c.reads) == {"boolean mask index": 1, "nonzero": 1, "to(device)": 1, "numpy": 1}

    c = gp.Counts()
    a = torch.ones(2, 3)
    with gp.HostReads(c), gp.AtenOps(c):
        ops(a, a)
    assert sum(c.ops.values()) == 2 and c.views == 1 and not c.reads  # add, then the view t()

    monkeypatch.setattr(gp, "CPU_ONLY", [(here, "int(x.max())")])
    c = gp.Counts()
    with gp.HostReads(c), gp.AtenOps(c):
        cpu_only(x)
    assert dict(c.cpu_only) == {"int": 1} and not c.reads


def test_gpu_predictors_runs_and_prints_its_figures():
    """A tiny run of ``gpu_predictors.py`` (TGN, CollegeMsg's first events): per-step op counts by
    phase adding up, no host read in a TGN step (issue 53.5: the loss stays on the device, the
    memory updater runs as on a GPU), the one read only the CPU path makes (modules.py's
    ``int(index.max())``; if it moved, ``CPU_ONLY`` must follow) counted apart, the uploads' call
    sites in tgdist, and the milliseconds, by phase too."""
    r = subprocess.run([sys.executable, "gpu_predictors.py", "--data", "collegemsg", "--max-events", "3000",
                        "--models", "tgn", "--batch", "100", "--warmup", "1", "--window", "2", "--windows", "2",
                        "--count-steps", "2"], cwd=BENCH, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["dim"] == 8 and out["cpu_kernels"] is False and "load_average_1_5_15" in out["machine"]
    (run,) = out["runs"]
    ops, reads = run["aten_ops"], run["host_reads"]
    assert ops["dispatched"] == pytest.approx(sum(ops["dispatched_by_phase"].values()))
    assert min(ops["dispatched_by_phase"].values()) > 0 and 0 < ops["dispatched_views"] < ops["dispatched"]
    assert ops["profiler_all"] > ops["profiler_top_level"] > 0
    assert reads["per_step"] == 0 and reads["by_kind"] == {} and reads["top_sites"] == []
    assert reads["cpu_only"] == {"int": 1.0}
    root = BENCH.parent
    for site in reads["top_sites"] + reads["to_device_sites"]:
        path, line = site["site"].split(" ")[0].split(":")
        assert path.startswith("tgdist/") and site["line"] in (root / path).read_text().splitlines()[int(line) - 1]
    ms = run["host_ms"]
    assert reads["to_device_per_step"] == 0 and reads["to_device_queued_per_step"] > 0  # every upload queued (tgdist.uploads)
    assert 0 < ms["best"] <= ms["median"] and ms["cpu_best"] <= ms["cpu_median"]
    assert min(ms["cpu_by_phase"].values()) > 0  # each phase's own CPU time, adding up to the step's (the mean)
    assert 0.9 * ms["cpu_best"] <= sum(ms["cpu_by_phase"].values()) <= 1.1 * ms["cpu_median"]
