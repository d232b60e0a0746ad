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


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
