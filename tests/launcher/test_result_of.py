"""``collectives.result_of``: the other ranks wait for rank 0's work past the process group's timeout."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tgdist.distributed import collectives
from tgdist.errors import DataError

from .helpers import free_port

pytestmark = pytest.mark.distributed

GROUP_TIMEOUT = 2.0  # seconds; rank 0's work takes twice as long


def _worker(rank: int, port: int, how: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT))
    try:
        def work():
            time.sleep(2 * GROUP_TIMEOUT)
            if how == "fails":
                raise ValueError("no such file")
            if how == "bad input":
                raise DataError("x.csv: no such file")
            return {"test_ap": 0.9}

        try:
            if how == "plain":  # what the end of a run did before: a broadcast under the group's timeout
                got = collectives.broadcast_object(work() if rank == 0 else None, src=0)
            else:
                got = collectives.result_of(work, dist.group.WORLD, name="summary")
            out.put((rank, "ok", got))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.put((rank, type(e).__name__, str(e) + (f" (exit {e.exit_code})" if hasattr(e, "exit_code") else "")))
    finally:
        dist.destroy_process_group()


def _run(how: str) -> dict:
    """Two gloo ranks; what each got (or raised)."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, how, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, value = out.get(timeout=60)
        results[rank] = (status, value)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_a_plain_broadcast_times_out_while_rank_0_works():
    """The failure ``result_of`` prevents: rank 1 gives up after the group's 2 s, and rank 0's
    result then has nowhere to go."""
    results = _run("plain")
    assert results[1][0] == "RuntimeError" and "Timed out waiting 2000ms" in results[1][1]
    assert results[0][0] == "RuntimeError"


def test_result_of_waits_past_the_group_timeout():
    assert _run("works") == {0: ("ok", {"test_ap": 0.9}), 1: ("ok", {"test_ap": 0.9})}


def test_result_of_reports_a_failure_on_rank_0_to_the_others():
    """As a tgdist error (one line, not a traceback), with rank 0's exit code: 2 for bad input."""
    results = _run("fails")
    assert results[0] == ("ValueError", "no such file")
    assert results[1] == ("RunFailure", "rank 0 failed while this rank waited for it: ValueError: no such file (exit 1)")
    results = _run("bad input")
    said = "rank 0 failed while this rank waited for it: DataError: x.csv: no such file (exit 2)"
    assert results[1] == ("RunFailure", said)
