"""Process helpers for the launcher tests: free ports, starting several commands at once with a
timeout, and killing whole process groups so that nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROBE = Path(__file__).with_name("probe.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_events(*overrides: str) -> int:
    """Training events of the data set ``tgdist train OVERRIDES`` would use (what one traversal is)."""
    from tgdist.data.graph import chronological_split
    from tgdist.data.load import load_data
    from tgdist.runtime.build import compose

    return chronological_split(load_data(compose(list(overrides)).data)).train_end


@dataclass
class Result:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json_lines(self) -> list[dict]:
        return [json.loads(ln) for ln in self.stdout.splitlines() if ln.startswith("{")]

    def check(self) -> "Result":
        assert self.returncode == 0, f"{' '.join(self.cmd)} exited {self.returncode}\n{self.stdout}\n{self.stderr[-4000:]}"
        return self


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group of ``proc`` (started with start_new_session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            # the leader is gone; children may still hold the group
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_all(cmds: list[list[str]], timeout: float = TIMEOUT, env: dict | None = None, cwd=None) -> list[Result]:
    """Start every command at once (each in its own session), wait for all up to ``timeout`` seconds
    in total, kill what is left, and return their results in order."""
    env = {**os.environ, **(env or {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=cwd or REPO, start_new_session=True) for c in cmds]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for c, p in zip(cmds, procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(p)
                out, err = p.communicate()
                err += f"\n[killed after {timeout:.0f} s]"
            results.append(Result(c, p.returncode, out, err))
    finally:
        for p in procs:
            kill_group(p)  # also reaps stragglers a finished leader left in its group
    return results


def run(cmd: list[str], timeout: float = TIMEOUT, env: dict | None = None, cwd=None) -> Result:
    return run_all([cmd], timeout, env, cwd)[0]


def torchrun_cmd(nproc: int, port: int, *args: str, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
            f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--max-restarts=0", str(PROBE), *args]


def read_ranks(folder: Path, n: int, freed: bool = True) -> list[dict]:
    """The probe's ``rank<N>.json`` files for ranks 0..n-1 (a missing one fails with its name). With
    ``freed``, ranks that built process groups must have freed them all in ``destroy()``."""
    out = []
    for r in range(n):
        f = Path(folder) / f"rank{r}.json"
        assert f.is_file(), f"no output from rank {r} in {folder}: {sorted(p.name for p in Path(folder).iterdir())}"
        rec = json.loads(f.read_text())
        if freed and "leaked" in rec:
            assert rec["leaked"] == [], f"rank {r}: groups {rec['leaked']} outlived destroy()"
        out.append(rec)
    return out


def expected_mean(ranks: list[int]) -> float:
    return sum(ranks) / len(ranks)


def spawn_ranks(worker, *args, ranks: int = 2, timeout: float = 240) -> dict:
    """Start ``worker(rank, port, *args, out)`` in ``ranks`` spawned processes (they meet at
    ``port``) and return ``{rank: value}`` of what each put on ``out`` as ``(rank, "ok", bytes of
    torch.save)``; a rank that reports ``(rank, "failed", traceback)`` fails the test with it."""
    import io

    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, *args, out)) for rank in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, status, value = out.get(timeout=timeout)
            assert status == "ok", f"rank {rank}:\n{value}"
            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
        return results
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
