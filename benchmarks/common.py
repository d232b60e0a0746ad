"""Shared helpers for the benchmark scripts: machine description, peak memory, JSON output."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("TGDIST_DATASETS", REPO.parent / "shared" / "datasets"))
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


def emit(result: dict) -> None:
    print(json.dumps(result, indent=1, default=float), flush=True)


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
