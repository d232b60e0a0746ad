"""Part 0: ``tests/gpu`` under pytest on the device (a step on the device against the CPU's torch
formulation, every model trained and evaluated there, deterministic repeats and a resume, MSPipe's
CUDA streams); ``TGDIST_TEST_DEVICE=cpu`` on a CPU. One line: the counts and the failed tests."""

from __future__ import annotations

import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared import REPO, deadline_arg, emit, guarded, on_cuda, out_dir, run_bounded

PART = 0


def main() -> int:
    seconds = deadline_arg(sys.argv)
    out = out_dir()
    xml = out / "gpu_tests.xml"
    xml.unlink(missing_ok=True)
    # tests/gpu's deterministic runs come after other tests' matrix products in this process, and
    # torch reads cuBLAS's workspace size once: fixed from the start (tgdist sets it per run, late)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **os.environ}
    if not on_cuda():
        env["TGDIST_TEST_DEVICE"] = os.environ.get("GPU_CHECKS_DEVICE", "cpu")
    t0 = time.perf_counter()
    rc, _ = run_bounded([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(REPO / "tests" / "gpu"),
                           "-m", "slow or not slow", "-v", "-rs", f"--junitxml={xml}"], seconds - 5, env=env,
                          log=out / "gpu_tests.log")
    took = time.perf_counter() - t0
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                failed.append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                failed.append(name)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    why = None
    if rc == 124:
        why = f"pytest timed out after {seconds - 5:.0f} s"
    elif rc != 0 or failed:
        why = f"pytest exit {rc}; failed: {failed or '(see gpu_tests.log)'}"
    elif counts["passed"] == 0:
        why = "no test ran (all skipped?)"
    emit("gpu_tests", PART, why is None, {**counts, "failed_tests": failed, "log": "gpu_tests.log"}, seconds=took,
         error=why)
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(guarded(PART, "gpu_tests", main))
