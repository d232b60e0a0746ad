"""Parallel training (DistTGL i x j x k) against the single-process loop, with real torchrun launches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launcher.helpers import free_port, train_events

pytestmark = pytest.mark.distributed

PROBE = str(Path(__file__).with_name("parallel_probe.py"))
SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "model.dropout=0.0", "train.lr=1e-7",
         "train.num_threads=1", "sampler.num_threads=1", "train.lr_scaling=none", "train.progress=false"]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args]


def torchrun(nproc: int, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(torchrun_cmd(nproc, *args), capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "still referenced after destroy" not in r.stderr  # every group freed before exit
    return r


def test_2x1x1_with_batch_b_matches_1x1x1_with_batch_2b(tmp_path):
    """Same memory after every step, same loss curve, same averaged gradients. A tiny learning rate
    keeps the comparison about the data flow: with Adam, float noise in near-zero gradient entries
    flips the sign of whole lr-sized updates, which would swamp any tolerance after a few steps."""
    single, para = tmp_path / "single.pt", tmp_path / "para.pt"
    r = subprocess.run([sys.executable, PROBE, str(single), *SMALL, "train.batch_size=200", "train.epochs=1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun(2, PROBE, str(para), *SMALL, "train.batch_size=100", "parallel.i=2", "train.epochs=1")
    a, b = torch.load(single, weights_only=True), torch.load(para, weights_only=True)
    n = train_events(*SMALL)
    assert a["events"] == b["events"] == n  # the whole training split, once
    assert a["mem"].shape == b["mem"].shape and a["mem"].abs().sum() > 0
    torch.testing.assert_close(a["mem"], b["mem"], rtol=1e-4, atol=1e-5)  # memory after every step
    single_loss = a["losses"][0]
    r0, r1 = b["losses"]
    # global batch = 200 events = 100 per rank, except the last one, split as evenly as possible
    last = n % 200 or 200
    n0, n1 = (last + 1) // 2, last // 2
    para_loss = [(x + y) / 2 for x, y in zip(r0[:-1], r1[:-1])] + [(r0[-1] * n0 + r1[-1] * n1) / last]
    assert single_loss == pytest.approx(para_loss, rel=1e-4, abs=1e-5)
    # averaged gradients of every full step (the last global batch is split unevenly: the ranks'
    # means are averaged with equal weight there, while the single run weighs every event alike)
    torch.testing.assert_close(a["grads"][:-1], b["grads"][:-1], rtol=1e-3, atol=1e-6)
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_asynchronous_allreduce_of_2x1x1_averages_as_1x1x1_with_the_batch_of_both(tmp_path, monkeypatch):
    """Sven's asynchronous all-reduce (eq. (13), staleness one) on two ranks with batches of B
    equals one rank with batches of 2B, the same events and negatives, under plain SGD, where the
    scale of the averaged gradient moves the parameters (Adam would hide a sum in place of the
    mean). Compared over the first iterations: the applied gradient (``.grad`` after the step: the
    previous iteration's average; at iteration 0 none is applied, and each rank keeps its own),
    the parameters after each step and the losses."""
    single, para = tmp_path / "single.pt", tmp_path / "para.pt"
    over = [*SMALL, "pipeline.async_allreduce=true", "train.epochs=1"]
    monkeypatch.setenv("PROBE_SGD_LR", "1e-4")  # (both runs below take the environment)
    r = subprocess.run([sys.executable, PROBE, str(single), *over, "train.batch_size=200"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun(2, PROBE, str(para), *over, "train.batch_size=100", "parallel.i=2")
    a, b = torch.load(single, weights_only=True), torch.load(para, weights_only=True)
    # Iterations 0-2: two steps applied (at 1 and 2, of iteration 0's and 1's gradients). Later
    # ones are left out: a time-encoding weight's gradient reaches 6e3, so SGD moves it by 0.6 a
    # step and the loss surface there turns a rounding difference of 1e-7 into 1e-1 within two
    # more steps, in both runs alike (chaos, not a fault).
    first = 3
    assert a["grads"].shape[0] == b["grads"].shape[0] > first
    moved = (a["trajectory"][first - 1] - a["trajectory"][0]).abs().max()
    assert moved > 0.1  # the steps move the parameters far beyond the tolerances below
    # the same float32 sums in another order (two half-batch means averaged): rounding of a few
    # epsilons of the values' magnitude (observed: 5e-6 relative), where a sum instead of the mean
    # doubles every applied gradient
    torch.testing.assert_close(b["grads"][1:first], a["grads"][1:first], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b["trajectory"][:first], a["trajectory"][:first], rtol=1e-4, atol=1e-6)
    r0, r1 = b["losses"]
    assert a["losses"][0][:first + 1] == pytest.approx([(x + y) / 2 for x, y in zip(r0, r1)][:first + 1], rel=1e-4)


@pytest.mark.parametrize("layout,nproc,epochs", [pytest.param("1,1,2", 2, 2, marks=pytest.mark.slow),
                                                 pytest.param("1,2,1", 2, 2, marks=pytest.mark.slow),
                                                 pytest.param("2,1,2", 4, 2, marks=pytest.mark.slow)])  # ~17, 18, 30 s
def test_torchrun_layouts_train_every_event_the_expected_number_of_times(tmp_path, layout, nproc, epochs):
    i, j, k = layout.split(",")
    r = torchrun(nproc, "-m", "tgdist.train", *SMALL, "train.batch_size=100", f"parallel.i={i}", f"parallel.j={j}",
                 f"parallel.k={k}", f"train.epochs={epochs}", "train.num_neg_eval=4", f"run_dir={tmp_path / 'run'}",
                 cwd=tmp_path)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["parallel"] == f"{i} x {j} x {k}" and summary["replicas_identical"] is True
    assert summary["traversed_events"] == epochs * train_events(*SMALL)  # as many as the single-process run
    assert 0.0 <= summary["test_ap"] <= 1.0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test_ap"] == summary["test_ap"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["epoch"] == epochs - 1 and lines[0]["test_ap"] == summary["test_ap"]
    assert lines[0]["train_events"] == summary["traversed_events"]
    assert summary["checkpoint"].endswith("last.pt") and not (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    assert "[rank 0] [rank 0]" not in (tmp_path / "run" / "train.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no per-rank leftovers


@pytest.mark.parametrize("layout,nproc", [("2,1,1", 2), pytest.param("1,1,2", 2, marks=pytest.mark.slow)])
def test_embedding_cache_in_a_parallel_run(tmp_path, layout, nproc):
    """Each trainer holds its own FreshGNN cache (serving hop-1 pairs from its own batches); the
    replicas stay identical, and every event is trained as often as in one process."""
    i, j, k = layout.split(",")
    r = torchrun(nproc, "-m", "tgdist.train", *SMALL, "model=tgat2", "cache=freshgnn", "train.batch_size=100",
                 f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}", f"train.epochs={k}", "train.num_neg_eval=4",
                 f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["replicas_identical"] is True and 0.0 <= summary["test_ap"] <= 1.0
    assert summary["traversed_events"] == int(k) * train_events(*SMALL)
    assert "historical embedding cache: p_grad 0.9, t_stale 20" in r.stderr
    cache = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["cache"]
    assert cache["iterations"] >= summary["iterations"]  # the trainers' steps, summed
    assert 0 < cache["hit_rows"] < cache["rows"]


@pytest.mark.slow  # ~14 s
def test_static_pretraining_and_node_task_in_a_parallel_run(tmp_path):
    """Rank 0 pre-trains the static memory and every replica starts from its result (else rank 1's
    model would differ from rank 0's at the end); rank 0 trains the node-task decoder."""
    rows = ["u,i,ts,label"] + [f"{e % 30},{e * 7 % 30},{e},{int(e % 30 % 3 == 0)}" for e in range(1500)]
    (tmp_path / "labelled.csv").write_text("\n".join(rows) + "\n")
    r = torchrun(2, "-m", "tgdist.train", *SMALL, "data=file", f"data.path={tmp_path / 'labelled.csv'}",
                 f"data.cache_dir={tmp_path / 'cache'}", "train.batch_size=100", "parallel.i=2", "train.epochs=1",
                 "train.num_neg_eval=4", "model.static_memory=true", "model.static_pretrain_epochs=2",
                 "train.task=node", "train.node_class_epochs=2", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["replicas_identical"] is True
    assert 0.0 <= summary["test_node_auc"] <= 1.0 and 0.0 <= summary["val_node_auc"] <= 1.0
    assert r.stderr.count("static memory pre-training epoch 1") == 1  # rank 0 only


def test_layout_not_matching_the_world_fails_before_training(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd(2, "-m", "tgdist.train", *SMALL, "parallel.i=3", f"run_dir={tmp_path / 'run'}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode != 0
    assert "parallel.i x parallel.j x parallel.k = 3 x 1 x 1 = 3 but the world has 2 processes" in r.stderr
    assert not (tmp_path / "run").exists()


def _leftovers(tag: str) -> list[str]:
    """Processes still running whose command line mentions ``tag`` (this test's run directory)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if tag in cmd:
                out.append(cmd)
    return out


@pytest.mark.parametrize("layout,nproc,backend", [("1,1,2", 2, "auto"),  # the default suite's one; ~30-40 s each
                                                  pytest.param("1,2,1", 2, "auto", marks=pytest.mark.slow),
                                                  pytest.param("2,1,1", 2, "sven", marks=pytest.mark.slow),
                                                  pytest.param("2,1,1", 2, "depcomm", marks=pytest.mark.slow),
                                                  pytest.param("1,2,1", 2, "auto:pipeline.mode=mspipe,"
                                                               "pipeline.staleness=2", marks=pytest.mark.slow)])
def test_sigkill_of_a_trainer_then_resume_finishes_with_the_same_metrics(tmp_path, layout, nproc, backend):
    """A trainer SIGKILLed mid-run: every process exits within 30 s, the failure names the rank,
    nothing is left running; resuming from the last checkpoint (every memory copy or shard, every
    rank's pending reads: epoch parallelism's read slots, MSPipe's reads ahead) finishes with the
    metrics of an uninterrupted run. ``backend``: BACKEND[:OVERRIDE,OVERRIDE...]."""
    import time

    i, j, k = layout.split(",")
    backend, _, extra = backend.partition(":")
    common = [*SMALL, "train.batch_size=100", f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}",
              f"memory.backend={backend}", *filter(None, extra.split(",")),
              "train.epochs=2", "train.num_neg_eval=4", "train.checkpoint_every=4", "train.lr=1e-3"]
    full = torchrun(nproc, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'full'}", cwd=tmp_path)
    expected = json.loads(full.stdout.strip().splitlines()[-1])

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TGDIST_FAULT_KILL": "1:9"}
    cmd = torchrun_cmd(nproc, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'cut'}")
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode != 0 and time.monotonic() - start < 60
    assert "rank      : 1" in r.stderr and "Signal 9 (SIGKILL)" in r.stderr  # torchrun names the dead rank
    assert _leftovers(str(tmp_path / "cut")) == []
    assert (tmp_path / "cut" / "checkpoints" / "last.pt").exists()
    assert not any(p.name.startswith("tgdist") for p in Path("/dev/shm").iterdir() if str(tmp_path.name) in p.name)

    resumed = torchrun(nproc, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'resumed'}",
                       f"train.resume={tmp_path / 'cut'}", cwd=tmp_path)
    got = json.loads(resumed.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert got[key] == expected[key], key


@pytest.mark.slow
def test_a_finished_parallel_run_keeps_its_model_and_resumes_to_its_results(tmp_path):
    """Without train.checkpoint_every a parallel run still leaves checkpoints/last.pt (the trained
    model) at its end; resuming it reports the same results without training. Resuming with another
    train.epochs (every rank's schedule depends on it), or with epoch parallelism, is refused in one line
    (another trainer count is resumed on: tests/runtime/test_reshard.py)."""
    common = [*SMALL, "train.batch_size=100", "parallel.i=2", "train.num_neg_eval=4", "train.lr=1e-3"]
    done = json.loads(torchrun(2, "-m", "tgdist.train", *common, "train.epochs=2", f"run_dir={tmp_path / 'a'}",
                               cwd=tmp_path).stdout.strip().splitlines()[-1])
    state = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=True)
    assert state["iteration"] == done["iterations"] and state["epochs"] == 2 and state["model"]
    assert done["train_seconds"] > 0  # the slowest rank's training (a parallel run's summary said 0.0)
    # its reported metrics are what one process evaluating its checkpoint gets: rank 0 evaluated
    # group 0's memory with every write applied (validation, then test, as a run does)
    from tgdist.runtime import checkpoint
    from tgdist.runtime.build import build_trainer, compose
    tr = build_trainer(compose([*SMALL, "train.batch_size=100", "train.num_neg_eval=4", "train.lr=1e-3"]))
    checkpoint.load(tmp_path / "a" / "checkpoints" / "last.pt", tr, compose([*common, "train.epochs=2"]))
    alone = {**tr.evaluate("val"), **tr.evaluate("test")}
    assert done["memory_backend"] == "depcache" and done["parallel"] == "2 x 1 x 1"
    for key in ("val_ap", "val_auc", "val_mrr", "test_ap", "test_auc", "test_mrr"):
        assert done[key] == pytest.approx(alone[key], rel=1e-12, abs=0), key
    again = json.loads(torchrun(2, "-m", "tgdist.train", *common, "train.epochs=2", f"run_dir={tmp_path / 'b'}",
                                f"train.resume={tmp_path / 'a'}", cwd=tmp_path).stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert again[key] == done[key], key
    assert again["train_events_per_s"] is None and done["train_events_per_s"] > 0  # nothing trained on resume
    last = tmp_path / "a" / "checkpoints" / "last.pt"
    r = subprocess.run([sys.executable, "-m", "tgdist", "launch", "--", *common, "train.epochs=4",
                        f"train.resume={tmp_path / 'a'}", f"run_dir={tmp_path / 'c'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr == (f"tgdist launch: error: {last}: this parallel run was started with "
                                              "train.epochs=2, and resumes only with it (train.epochs=4 changes "
                                              "every rank's schedule)\n")
    r = subprocess.run([sys.executable, "-m", "tgdist", "launch", "--", *common, "train.epochs=2", "parallel.j=2",
                        f"train.resume={tmp_path / 'a'}", f"run_dir={tmp_path / 'd'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr == (
        f"tgdist launch: error: {last}: written by a run of layout 2 x 1 x 1, and this run's is 2 x 2 x 1 "
        "(parallel.i/j/k), a layout the memory cannot be re-placed to (with parallel.j > 1 the subgroups train other "
        "places in the stream in one iteration, and only the first writes memory); resume with layout 2 x 1 x 1, or "
        "change only parallel.i where j = k = 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_parallel_run_stopped_after_some_batches_ends_on_every_rank(tmp_path):
    """``train.stop_after_batches`` in a parallel run: every rank stops and exits 0 (the ranks but
    0 died in the driver with a TypeError, the summary having no run directory), and rank 0 names
    the checkpoint to resume from."""
    r = torchrun(2, "-m", "tgdist.train", *SMALL, "train.batch_size=100", "parallel.i=2", "train.epochs=2",
                 "train.checkpoint_every=2", "train.stop_after_batches=3", f"run_dir={tmp_path / 'a'}", cwd=tmp_path)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stopped"] and out["checkpoint"] == str(tmp_path / "a" / "checkpoints" / "last.pt")
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


# ~27-37 s each: slow; the default suite compares the stores in tests/memory/test_sven.py (2 x 1 x 1)
# and tests/runtime/test_run.py (one process)
@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", [("2,1,1", 2), ("1,2,1", 2)])
def test_daemon_and_depcache_backends_give_identical_runs(tmp_path, layout, nproc):
    """DistTGL's memory daemon (shared memory, one server process per group) and DepCache
    (replicas kept equal by all-gathered writes) are two implementations of one memory copy per
    group: both copy rows with the same code, so whole runs are bit-identical; no segment is left."""
    i, j, k = layout.split(",")
    common = [*SMALL, "train.batch_size=100", f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}",
              "train.epochs=2", "train.num_neg_eval=4", "train.lr=1e-3"]
    runs = {}
    before = {p for p in os.listdir("/dev/shm") if p.startswith("tgdist-")}
    for backend in ("depcache", "daemon"):
        r = torchrun(nproc, "-m", "tgdist.train", *common, f"memory.backend={backend}",
                     f"run_dir={tmp_path / backend}", cwd=tmp_path)
        runs[backend] = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert runs["daemon"][key] == runs["depcache"][key], key
    assert runs["daemon"]["memory_backend"] == "daemon"
    assert {p for p in os.listdir("/dev/shm") if p.startswith("tgdist-")} <= before  # nothing of ours is left


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``root``."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            try:
                out.append((c, open(f"/proc/{c}/cmdline", "rb").read().replace(b"\0", b" ").decode()))
            except OSError:
                continue
            todo.append(c)
    return out


@pytest.mark.slow  # ~55 s; test_daemon.py kills a trainer of the daemon's group in the default run
def test_sigkill_of_the_memory_daemon_then_resume(tmp_path):
    """The daemon of a 2 x 1 x 1 group is SIGKILLed mid-run: both trainers stop within 30 s with a
    message naming the daemon, no segment or process is left; a resume from the last checkpoint
    (memory copied out of the daemon) finishes with the metrics of an uninterrupted run."""
    import signal
    import time

    common = [*SMALL, "train.batch_size=50", "parallel.i=2", "train.epochs=2", "train.num_neg_eval=4",
              "train.checkpoint_every=3", "train.lr=1e-3", "memory.backend=daemon"]
    expected = json.loads(torchrun(2, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'full'}",
                                   cwd=tmp_path).stdout.strip().splitlines()[-1])
    before = {p for p in os.listdir("/dev/shm") if p.startswith("tgdist-")}
    cmd = torchrun_cmd(2, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'cut'}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "cut" / "checkpoints" / "last.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
            time.sleep(0.05)
        [daemon] = [pid for pid, cmdline in _descendants(proc.pid) if "tgdist.memory.daemon" in cmdline]
        os.kill(daemon, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    reports = [line for line in err.splitlines() if f"error: memory daemon of group 0 (pid {daemon}) died" in line]
    assert reports, err[-4000:]
    # rank 0 started the daemon and names the signal; when rank 1 notices first, torchrun may stop
    # rank 0 before it reports (test_daemon.py checks both ranks' messages without torchrun)
    rank0 = [line for line in reports if line.startswith("tgdist train [rank 0]: ")]
    assert all(line.endswith("died (killed by SIGKILL)") for line in rank0), reports
    assert _descendants(proc.pid) == [] and _leftovers(str(tmp_path / "cut")) == []
    assert {p for p in os.listdir("/dev/shm") if p.startswith("tgdist-")} <= before

    resumed = torchrun(2, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'resumed'}",
                       f"train.resume={tmp_path / 'cut'}", cwd=tmp_path)
    got = json.loads(resumed.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert got[key] == expected[key], key
