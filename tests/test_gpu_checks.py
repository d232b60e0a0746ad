"""``scripts/gpu_checks.sh`` (issue 41): the CPU dry run of the whole flow passes here, so the checks
are ready before a session is lent a GPU; a bad argument is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
# every check of the full run, by part (speed:pyg_tgn passes without PyG on a CPU, saying so)
EXPECTED = {
    0: {"gpu_tests"},
    1: {f"two_ranks:{n}" for n in ("depcache", "depcomm", "sven", "daemon", "sven+pipeline=sven",
                                   "mspipe(K=1)+depcache")},
    2: {"nccl_smoke", "resume:local", "resume:sven+sven-levels(n=2)", "resume:mspipe(K=1)"}
       | {f"world_one:{n}" for n in ("local", "depcache", "depcomm", "sven", "daemon", "pipeline=prefetch",
                                     "pipeline.micro_batches=2", "pipeline=async_allreduce", "pipeline=sven",
                                     "sven+pipeline=sven", "pipeline=mspipe(auto)")}
       | {f"exact:{b}" for b in ("local", "depcache", "depcomm", "sven", "daemon")},
    3: {"speed:tgn", "speed:jodie", "speed:apan", "speed:pyg_tgn", "speed:profile:tgn", "speed:cli:tgn",
        "speed:profile_cli:tgn", "speed:eval_stream", "speed:cli:tgn_b200", "speed:cli:jodie", "speed:cli:apan"},
    4: {"pipelines:sven_ladder", "pipelines:mspipe_2x1x1", "pipelines:mspipe_1proc", "pipelines:freshgnn_tgat2"},
}


def test_a_bad_argument_is_one_line_and_exit_2():
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "gpu_checks: unknown argument --bogus (use --prepare, --quick or --parts 0,1,2,3,4)"]


def test_all_of_the_data_is_asked_for_as_null(monkeypatch):
    """The GPU sizes ask for all of Wikipedia as 0, which the dry run's sizes never do: each data
    size goes through ``events_override``, whose override the config accepts (run 1 on the H200
    lost a check to ``data.max_events=0``)."""
    import sys

    from tgdist.runtime.build import compose

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "gpu_checks"))
    shared = __import__("shared")
    try:
        assert shared.events_override(0) == "data.max_events=null"
        assert compose([shared.events_override(0)]).data.max_events is None
        assert compose([shared.events_override(1500)]).data.max_events == 1500
        scripts = "".join((REPO / "scripts" / "gpu_checks" / f).read_text() for f in
                          ("pipelines.py", "two_ranks.py", "world_one.py", "speed.py"))
        assert "data.max_events={" not in scripts  # no size formatted in by hand
    finally:
        sys.modules.pop("shared", None)


@pytest.fixture
def ranks(monkeypatch):
    """``scripts/gpu_checks/ranks.py`` (and its ``shared``), imported as the helpers import them."""
    import sys

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "gpu_checks"))
    try:
        yield __import__("ranks")
    finally:
        sys.modules.pop("ranks", None)
        sys.modules.pop("shared", None)


def _record(losses, mems, comm=None, micro_batches=None):
    return ({"losses": list(losses), "communication": comm or {"aggregation": {"calls": 5, "bytes_sent": 800,
                                                                              "bytes_received": 800}},
             "summary": {"pipeline": {"micro_batches": micro_batches}}}, mems)


def test_part_1_judges_memory_from_iteration_0_losses_with_headroom_and_bytes(ranks):
    """Part 1's comparison of a rank's device run with its CPU run (``compare_rank``), against the
    differences recorded on the H200 (benchmarks/results/gpu_checks.md): the memory is judged
    after every probed iteration, from the first, by the record's size there (a difference of
    1e-5 after iteration 0, where 0 was recorded, fails; the recorded 6.7e-3 after iteration 4
    passes, 0.1 fails); a loss 1.5e-4 apart (twice the largest record, which the old 1e-4 failed)
    passes and 2e-3 fails; bytes that differ fail unless the two runs chose other micro-batch counts."""
    import torch

    mem = {t: {"mem": torch.full((4, 3), 0.5), "mem_ts": torch.arange(4.0, dtype=torch.float64),
               "mail_ts": torch.tensor([1.0, float("-inf"), 2.0, float("nan")], dtype=torch.float64),
               "head": torch.zeros(4, dtype=torch.long)} for t in range(5)}
    losses = [0.7, 0.69, 0.68, 0.67, 0.66]

    def moved(t, by, key="mem", at=(1, 2)):
        out = {i: {k: v.clone() for k, v in m.items()} for i, m in mem.items()}
        out[t][key][at] += by
        return out

    def compare(dev, ref=None):
        return ranks.compare_rank(*(ref or _record(losses, mem))[:1], dev[0], (ref or _record(losses, mem))[1],
                                  dev[1], 1)

    same = compare(_record(losses, mem))
    assert same["ok"] and same["why"] == [] and same["bytes_equal"]
    assert same["memory_bound_per_iteration"] == [ranks.memory_bound(t) for t in range(5)]
    assert ranks.memory_bound(0) == ranks.memory_bound(1) == ranks.TOL["memory_floor"] == 1e-6
    assert compare(_record(losses, moved(4, 6.73e-3)))["ok"]
    for t, by in ((0, 1e-5), (1, 1e-5), (2, 1e-3), (4, 0.1)):
        got = compare(_record(losses, moved(t, by)))
        assert not got["ok"] and got["memory_first_beyond"]["iteration"] == t, (t, got["why"])
        assert got["why"][0].startswith(f"rank 1: memory mem after iteration {t} beyond its bound"), got["why"]
    for at in (1, 3):  # a time of no mail (-inf) or NaN on one device only
        ts = moved(0, -1.0, "mail_ts", at)
        ts[0]["mail_ts"][at] = 3.0
        assert not compare(_record(losses, ts))["ok"], at
    assert compare(_record([x * (1 + 1.5e-4) for x in losses], mem))["ok"]
    off = compare(_record([losses[0], losses[1] * (1 + 2e-3), *losses[2:]], mem))
    assert not off["ok"] and "losses of iterations [1] beyond rtol 0.001" in off["why"][0]
    more = {"aggregation": {"calls": 5, "bytes_sent": 808, "bytes_received": 800}}
    got = compare(_record(losses, mem, more))
    assert not got["ok"] and got["bytes_differ"] == {"aggregation": [(808, 800), (800, 800)]}
    assert got["why"] == ["rank 1: bytes sent or received differ from the CPU run's (device, cpu): "
                          "{'aggregation': [(808, 800), (800, 800)]}"]
    got = compare(_record(losses, mem, more, micro_batches=2), _record(losses, mem, micro_batches=1))
    assert got["ok"] and not got["bytes_equal"] and "micro-batches 1 on the CPU and 2" in got["bytes_note"]
    calls = compare(_record(losses, mem, {"aggregation": {"calls": 6, "bytes_sent": 800, "bytes_received": 800}}))
    assert calls["ok"] and calls["bytes_equal"] and not calls["communication_equal"]  # calls: reported


def test_part_3_summarises_a_trace_as_key_averages_does(monkeypatch):
    """Part 3's profile summary is read from the trace's raw events in one pass (``key_averages``
    costs ~0.1 ms an event, and a GPU epoch holds hundreds of thousands): each op's self CPU time
    (its time less that of the ops nested in it) and calls equal ``key_averages``' on the same
    profile; the device's busy time counts overlapping kernels once."""
    import sys

    import torch
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "gpu_checks"))
    monkeypatch.setenv("GPU_CHECKS_DEVICE", "cpu")
    try:
        speed = __import__("speed")
        x = torch.randn(64, 64, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):  # matmul holds mm, linear holds addmm / t: nested ops
                (torch.nn.functional.linear(x, x, x[0]).relu() @ x).sum().backward()
        got = speed.analyse(prof, 1.0, 3, "test")
        rows = got["trace"]["top_by_self_cpu_time"]
        assert len(rows) == speed.TOP_OPS and got["busy_fraction"] is None and got["aten_ops_per_iteration"] > 10
        avg = {a.key: a for a in prof.key_averages()}
        for row in rows:
            ref = avg[row["op"]]
            assert row["calls"] == ref.count, row
            assert abs(row["self_cpu_ms"] - ref.self_cpu_time_total / 1e3) <= 1e-3 * ref.count + 1e-6, (row, ref)
        assert speed.busy_seconds([(20, 30), (0, 10), (5, 15), (12, 14)]) == 25e-9  # overlaps once
    finally:
        sys.modules.pop("speed", None)
        sys.modules.pop("shared", None)


@pytest.mark.slow
def test_the_cpu_dry_run_of_every_part_passes(tmp_path):
    """``--prepare`` into a folder of its own, then the whole flow on the CPU with tiny data (minutes
    on 2 shared cores; part 3 alone, with its six `tgdist train` processes, about 3): one passing JSON line per check on stdout and in checks.jsonl, every part
    timed, the summary written."""
    env = {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "prep"), "GPU_CHECKS_DEVICE": "cpu",
           "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    prep = subprocess.run(["bash", str(SCRIPT), "--prepare"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert prep.returncode == 0, prep.stderr
    assert {p.name for p in (tmp_path / "prep" / "site").iterdir()} >= {"hydra", "omegaconf", "antlr4"}
    assert (tmp_path / "prep" / "datasets" / "wikipedia" / "wikipedia.csv.gz").is_file()
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500, check=False)
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / "checks.jsonl").read_text().splitlines()]
    failed = [(ln["check"], ln.get("error", "")[-800:]) for ln in lines if ln["status"] != "pass"]
    assert not failed, failed
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x) for x in r.stdout.splitlines()] == lines  # stdout is the JSON lines, nothing else
    got: dict = {}
    for ln in lines:
        assert ln["device"] == "cpu" and isinstance(ln["seconds"], (int, float)) and isinstance(ln["figures"], dict)
        got.setdefault(ln["part"], set()).add(ln["check"])
    assert got == EXPECTED
    smoke = next(ln for ln in lines if ln["check"] == "nccl_smoke")
    assert smoke["figures"]["backend"] == "gloo" and "not NCCL" in smoke["note"]  # the dry run says so
    summary = (out / "summary.txt").read_text()
    assert f"{len(lines)}/{len(lines)} checks passed" in summary
    parts = [row.split("\t") for row in (out / "parts.tsv").read_text().splitlines()]
    assert [p[0] for p in parts] == ["0", "1", "2", "3", "4"] and all(p[2] == "0" for p in parts)
