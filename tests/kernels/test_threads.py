"""Thread counts left at 0 (the default) follow the CPUs a process may use, not the machine's count."""

import os
import subprocess
import sys

import pytest

from tgdist import version_line
from tgdist.distributed import collectives
from tgdist.runtime import distributed

QUICK = ["data.max_events=1200", "model.mem_dim=16", "model.time_dim=8", "train.epochs=1", "train.batch_size=100",
         "train.num_neg_eval=4", "train.progress=false", "train.stop_after_batches=2"]


def on_one_cpu(args, cwd):
    """Run ``python args`` with this process's affinity narrowed to its first CPU (as ``taskset``)."""
    first = min(os.sched_getaffinity(0))
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
                          preexec_fn=lambda: os.sched_setaffinity(0, {first}))


def test_auto_threads_follow_the_affinity_mask(tmp_path):
    code = ("import torch; from tgdist.kernels import graph as kernels; "
            "print(kernels.available_cpus(), kernels.set_threads(0), torch.get_num_threads())")
    r = on_one_cpu(["-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1", "1"]
    r = subprocess.run([sys.executable, "-c", "from tgdist.kernels import graph as kernels; print(kernels.available_cpus())"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert int(r.stdout) == len(os.sched_getaffinity(0))


@pytest.mark.slow
def test_train_defaults_to_the_cpus_it_may_use(tmp_path):
    r = on_one_cpu(["-m", "tgdist", "train", *QUICK, f"run_dir={tmp_path / 'a'}"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{version_line()}; threads: 1 torch, 1 numba" in r.stderr  # versions head the run's log
    assert version_line() in (tmp_path / "a" / "train.log").read_text()
    r = on_one_cpu(["-m", "tgdist", "train", *QUICK, "train.num_threads=3", "sampler.num_threads=2",
                    f"run_dir={tmp_path / 'b'}"], tmp_path)
    assert r.returncode == 0, r.stderr
    # explicit counts win; numba's only up to the pool it sized at import (1 CPU here)
    assert "threads: 3 torch, 1 numba" in r.stderr


@pytest.mark.parametrize("peers, expected", [
    ([("a", tuple(range(8)))] * 4, 2),                                   # 4 unbound ranks split 8 CPUs
    ([("a", tuple(range(8)))] + [("b", tuple(range(8)))] * 3, 8),         # same mask, other machines
    ([("a", tuple(range(8)))] + [("a", tuple(range(8 * i, 8 * i + 8))) for i in (1, 2, 3)], 8),  # bound ranks
    ([("a", tuple(range(8)))] * 16, 1),                                  # more ranks than CPUs: one each
])
def test_cpu_share_splits_a_shared_mask_among_its_machine_s_ranks(monkeypatch, caplog, peers, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(distributed.socket, "gethostname", lambda: "a")
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj, group, **kw: [obj] + peers[1:])
    with caplog.at_level("WARNING", logger=distributed.log.name):
        assert distributed.cpu_share(group=None) == expected
    oversubscribed = "16 trainer processes share 8 CPUs on a: each runs one thread, and they take turns"
    assert (oversubscribed in caplog.text) == (len(peers) == 16), caplog.text


def test_the_kernels_a_prefetch_thread_runs_release_the_gil():
    """``pipeline.prefetch`` samples and organises the next batches in a thread while the main one
    dispatches the step: its numba kernels must not hold the interpreter lock meanwhile."""
    from tgdist.kernels import graph as kernels

    for fn in (kernels.sample_recent, kernels.sample_recent_serial, kernels.sample_uniform,
               kernels.sample_uniform_serial, kernels.organize):
        assert fn.targetoptions.get("nogil") is True, fn.__name__
