"""The benchmark scripts refuse bad arguments in one line before any work, and print strict JSON."""

from __future__ import annotations

import json
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
    ("parallel.py", ["--layouts", "1,1,2", "--epochs", "1"], "train.epochs = 1 is not a multiple of parallel.j x"),
    ("partition.py", ["--synthetic-events", "-1"], "argument --synthetic-events: -1: give at least 1"),
    ("memory_backends.py", ["--trainers", "2", "1"], "argument --trainers: 1: give at least 2"),
    ("memory_backends.py", ["--global-batch", "1001"], "--global-batch 1001 is not a multiple of every trainer count"),
    ("pipelining.py", ["--trainers", "2", "1"], "argument --trainers: 1: give at least 2"),
    ("pipelining.py", ["--links", "warp9"], "parallel.link='warp9': choose none, eth10"),
    ("embedding_cache.py", ["--settings", "off", "0.9"], "setting '0.9': give off or P_GRAD:T_STALE"),
    ("embedding_cache.py", ["--settings", "0.9:5"], "--settings: the first setting is the baseline and must be off"),
    ("mspipe.py", ["--epochs", "0"], "argument --epochs: 0: give at least 1"),
    ("mspipe.py", ["--seeds", "0", "-1"], "argument --seeds: -1: give at least 0"),
    ("mspipe.py", ["--points", "K=1", "auto"], "--points: the baseline 'none' is needed"),
    ("mspipe.py", ["--mitigation", "bogus"], "argument --mitigation: invalid choice: 'bogus'"),
    ("mspipe.py", ["--seeds"], "--seeds: give at least one seed"),
    ("eval_cost.py", ["--epochs", "0"], "argument --epochs: 0: give at least 1"),
    ("select_study.py", ["--seeds", "-1"], "argument --seeds: -1: give at least 0"),
])
def test_a_bad_argument_is_one_line_before_any_work(script, args, message):
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
