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
    3: {"speed:tgn", "speed:jodie", "speed:apan", "speed:pyg_tgn"},
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


@pytest.mark.slow
def test_the_cpu_dry_run_of_every_part_passes(tmp_path):
    """``--prepare`` into a folder of its own, then the whole flow on the CPU with tiny data (about
    1.5 minutes here): one passing JSON line per check on stdout and in checks.jsonl, every part
    timed, the summary written."""
    env = {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "prep"), "GPU_CHECKS_DEVICE": "cpu",
           "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    prep = subprocess.run(["bash", str(SCRIPT), "--prepare"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert prep.returncode == 0, prep.stderr
    assert {p.name for p in (tmp_path / "prep" / "site").iterdir()} >= {"hydra", "omegaconf", "antlr4"}
    assert (tmp_path / "prep" / "datasets" / "wikipedia" / "wikipedia.csv.gz").is_file()
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900, check=False)
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
