"""Shared helpers for the benchmark scripts: machine description, peak memory, JSON output."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import resource
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("TGDIST_DATASETS") or REPO.parent / "shared" / "datasets")  # as tgdist reads it
# the shared data sets the training benchmarks take by name (--data)
DATA_FILES = {"wikipedia": "wikipedia/wikipedia.csv.gz", "enron": "enron/ml_enron.txt.gz",
              "collegemsg": "collegemsg/CollegeMsg.txt.gz"}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba
    import numpy
    import torch
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "numba": numba.__version__, "platform": platform.platform(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "runtime default"),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "date": dt.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would carry a parent's peak over exec)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plain(x):
    """``x`` with NaN and infinities as None (strict JSON has neither) and numpy scalars as floats."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def emit(result: dict) -> None:
    print(json.dumps(_plain(result), indent=1, default=float, allow_nan=False), flush=True)


def at_least(least, kind=int):
    """An argparse ``type``: a ``kind`` number of at least ``least`` (argparse then prints the
    usage and one error line naming the option, exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (value >= least and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text}: give at least {least}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


OPTIONAL = {"torch_geometric": "bench", "sklearn": "bench", "matplotlib": "plot"}


def run_main(main) -> None:
    """``sys.exit(main())``: tgdist's own errors (a bad setting, a missing data file) and a missing
    optional package are one line on stderr and exit 2 (1 for a failed run), as in tgdist's commands."""
    from tgdist.errors import TgdistError

    script = Path(sys.argv[0]).name
    try:
        rc = main()
    except TgdistError as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))  # 1 for a run that failed (RunFailure)
    except ModuleNotFoundError as e:
        if e.name not in OPTIONAL:
            raise
        print(f"{script}: error: {e.name} is not installed: pip install -e '.[{OPTIONAL[e.name]}]'", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc or 0)


def require(*modules: str) -> None:
    """Fail at once (``run_main`` prints one line) when an optional package is missing, not after
    minutes of work."""
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def free_port() -> int:
    """A TCP port free on this machine now (torchrun's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_ranks(script: str, nproc: int, args: list[str], timeout: float, plan=None, what: str = "",
                   prefix: str = "tgdist-bench-") -> list:
    """Run ``script --worker OUT [PLAN] ARGS`` as ``nproc`` ranks under torchrun (gloo, one thread
    each) and return what each rank wrote to ``OUT.RANK`` (JSON), by rank. ``plan``: JSON-able
    work handed to the ranks as a file; ``what``: how failures name the run (default "N ranks")."""
    import subprocess
    import tempfile

    from tgdist.errors import RunFailure

    what = what or f"{nproc} ranks"
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        out, extra = f"{d}/rank", []
        if plan is not None:
            (Path(d) / "plan.json").write_text(json.dumps(plan))
            extra = [str(Path(d) / "plan.json")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", script, "--worker", out, *extra, *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
        except subprocess.TimeoutExpired:
            raise RunFailure(f"{what}: no result within {timeout:.0f} s") from None
        if r.returncode:
            lines = [ln for ln in r.stderr.strip().splitlines() if "Error" in ln or "error:" in ln]
            raise RunFailure(f"{what} failed (exit {r.returncode}): " + " | ".join(lines[-3:]))
        return [json.loads(Path(f"{out}.{k}").read_text()) for k in range(nproc)]


def rank_records(out: str, base: list[str], run) -> None:
    """The body of a benchmark's ``--worker``: this rank's process groups for ``base``'s layout,
    ``run(groups, rank)``'s records written to ``OUT.RANK`` for ``torchrun_ranks``, then a barrier
    (no rank exits while another still trains) and the groups freed."""
    from tgdist.distributed import collectives
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import ProcessGroups, detect
    from tgdist.runtime.build import compose

    world = detect()
    cfg = compose(base)
    groups = ProcessGroups.init(world, Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k))
    try:
        Path(f"{out}.{world.rank}").write_text(json.dumps(run(groups, world.rank)))
        collectives.barrier(groups.get("world"), name="shutdown")
    finally:
        groups.destroy()


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
