"""The simulated interconnect (``parallel.link``): the pure cost model, its config, and what two
gloo ranks' collectives take under it, synchronous and asynchronous.

Timing on a shared machine is noisy, so every lower bound (a collective never completes before its
modelled time) is asserted strictly and every upper bound generously (e.g. an overlapped
collective takes clearly less than computation + transfer, not about the larger of the two).
"""

from __future__ import annotations

import functools
import io
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.device_shim import ShimDevice
from tests.launcher.helpers import spawn_ranks
from tgdist.distributed import collectives as C
from tgdist.distributed.link import PRESETS, Link, link_seconds, parse_link, wire_bytes
from tgdist.errors import ConfigError

# ---------------------------------------------------------------- the cost model


def test_presets_are_the_documented_numbers():
    assert PRESETS["eth10"] == Link(bandwidth=1.25e9, latency=50e-6, name="eth10")
    assert PRESETS["ib100"] == Link(bandwidth=12.5e9, latency=5e-6, name="ib100")
    assert PRESETS["nvlink"] == Link(bandwidth=300e9, latency=2e-6, name="nvlink")
    assert PRESETS["eth10"].describe() == "eth10 (1.25 GB/s, 50 us per collective)"


def test_link_seconds_is_latency_plus_wire_bytes_over_bandwidth():
    eth = PRESETS["eth10"]
    # 1.25 MB broadcast / all-gather / all-to-all: 1 ms on the wire + 50 us
    for kind in ("broadcast", "all_gather", "all_to_all"):
        assert link_seconds(kind, 1_250_000, 2, eth) == pytest.approx(1.05e-3, rel=1e-12)
        assert link_seconds(kind, 1_250_000, 8, eth) == pytest.approx(1.05e-3, rel=1e-12)  # nbytes: this rank's
    # ring all-reduce: 2 (n-1)/n of the buffer, i.e. 1x at n = 2, 1.5x at n = 4, 1.75x at n = 8
    assert wire_bytes("all_reduce", 1000, 2) == 1000 and wire_bytes("all_reduce", 1000, 4) == 1500
    assert link_seconds("all_reduce", 1_250_000, 4, eth) == pytest.approx(50e-6 + 1.5e-3, rel=1e-12)
    assert link_seconds("all_reduce", 1_250_000, 8, eth) == pytest.approx(50e-6 + 1.75e-3, rel=1e-12)
    assert link_seconds("barrier", 0, 4, eth) == 50e-6  # latency only
    ib, nv = PRESETS["ib100"], PRESETS["nvlink"]
    assert link_seconds("all_to_all", 12_500_000, 4, ib) == pytest.approx(5e-6 + 1e-3, rel=1e-12)
    assert link_seconds("all_to_all", 3_000_000, 4, nv) == pytest.approx(2e-6 + 1e-5, rel=1e-12)
    custom = Link(bandwidth=1e6, latency=0.5)
    assert link_seconds("broadcast", 250_000, 3, custom) == 0.75


def test_no_link_or_a_group_of_one_costs_nothing():
    for kind in ("all_reduce", "all_gather", "all_to_all", "broadcast", "barrier"):
        assert link_seconds(kind, 10**9, 1, PRESETS["eth10"]) == 0.0
        assert link_seconds(kind, 10**9, 0, PRESETS["eth10"]) == 0.0
        assert link_seconds(kind, 10**9, 8, None) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind 'reduce_scatter'"):
        link_seconds("reduce_scatter", 1, 2, PRESETS["eth10"])
    with pytest.raises(ValueError, match="positive bandwidth"):
        Link(bandwidth=0, latency=1e-6)


def test_parse_link_reads_presets_and_bandwidth_latency_specs():
    assert parse_link("none") is None and parse_link(None) is None and parse_link(" None ") is None
    assert parse_link("eth10") is PRESETS["eth10"] and parse_link("IB100") is PRESETS["ib100"]
    assert parse_link("25gbps:5us") == Link(bandwidth=25e9 / 8, latency=5e-6, name="25gbps:5us")
    assert parse_link("300GB/s:2us") == Link(bandwidth=300e9, latency=2e-6, name="300GB/s:2us")
    assert parse_link("100MB/s:1.5ms") == Link(bandwidth=100e6, latency=1.5e-3, name="100MB/s:1.5ms")
    assert parse_link("800mbps:0s") == Link(bandwidth=100e6, latency=0.0, name="800mbps:0s")
    assert parse_link("1e3gbps:500ns").bandwidth == 125e9 and parse_link("1e3gbps:500ns").latency == pytest.approx(5e-7)
    for bad in ("eth100", "infiniband", "25gbps", "25:5us", "25gbps:5", "0gbps:5us", "25gbps:-5us", "gbps:5us", ""):
        with pytest.raises(ConfigError) as e:
            parse_link(bad)
        said = str(e.value)
        assert "\n" not in said and said.startswith(f"parallel.link={bad!r}: choose none, eth10, ib100, nvlink, or "
                                                    f"BANDWIDTH:LATENCY such as 25gbps:5us or 300GB/s:2us"), said


def test_config_composes_the_link_and_refuses_an_unknown_one():
    from tgdist.runtime.build import compose, validate

    assert compose([]).parallel.link == "none" and parse_link(compose([]).parallel.link) is None
    for name in PRESETS:
        cfg = compose([f"parallel.link={name}"])
        assert cfg.parallel.link == name and parse_link(cfg.parallel.link) is PRESETS[name]
        validate(cfg)
    cfg = compose(["parallel.link=25gbps:5us", "parallel=disttgl_2x1x2"])
    assert parse_link(cfg.parallel.link) == Link(bandwidth=3.125e9, latency=5e-6, name="25gbps:5us")
    assert (cfg.parallel.i, cfg.parallel.k) == (2, 2)  # the layout file keeps the link given beside it
    with pytest.raises(ConfigError, match=r"^parallel.link='eth100': choose none, eth10, ib100, nvlink, or"):
        validate(compose(["parallel.link=eth100"]))


def test_resuming_under_another_link_is_allowed():
    """The link only delays collectives, so a checkpoint matches whatever link the resume has
    (and checkpoints written before ``parallel.link`` existed still match)."""
    from tgdist.runtime.build import compose
    from tgdist.runtime.checkpoint import identity

    none, eth = identity(compose([])), identity(compose(["parallel.link=eth10"]))
    assert none == eth and "parallel.link" not in none and "parallel.k" in none


@pytest.fixture
def installed_link():
    """Installs a link for the test and takes it away after (it is per process)."""
    yield C.set_link
    C.set_link(None)


def test_set_link_installs_what_the_config_names(installed_link):
    assert C.current_link() is None
    assert installed_link("ib100") is PRESETS["ib100"] and C.current_link() is PRESETS["ib100"]
    link = Link(bandwidth=1e6, latency=0.1)
    assert installed_link(link) is link and C.current_link() is link
    assert installed_link("none") is None and C.current_link() is None
    with pytest.raises(ConfigError, match="parallel.link='eth1'"):
        installed_link("eth1")


def test_one_process_collectives_cost_nothing_under_a_link(installed_link):
    installed_link(Link(bandwidth=1.0, latency=10.0))  # 10 s per collective, were any priced
    counter = C.ByteCounter()
    t = torch.tensor([1.0, 3.0])
    start = time.perf_counter()
    C.all_reduce_mean([t], name="grad", counter=counter)
    assert C.all_reduce_mean_async([t], name="grad", counter=counter).wait() == [t]
    rows = torch.ones(2, 3)
    got = C.all_to_all_rows_async([rows], name="rows", counter=counter).wait()
    assert len(got) == 1 and got[0] is rows
    C.barrier(counter=counter)
    assert C.broadcast_object(5, counter=counter) == 5
    assert time.perf_counter() - start < 5.0 and counter.as_dict() == {} and t.tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match=r"one tensor per rank of the group \(1\), got 2"):
        C.all_to_all_rows_async([rows, rows])


def test_byte_counter_reports_modelled_seconds_only_under_a_link():
    c = C.ByteCounter()
    c.add("grad", sent=8, received=8)
    assert c.as_dict() == {"grad": {"calls": 1, "bytes_sent": 8, "bytes_received": 8}}
    c.add("grad", sent=4, received=4, seconds=0.25)
    c.add("rows", seconds=0.5)
    assert c["grad"] == C.Traffic(calls=2, bytes_sent=12, bytes_received=12, modelled_seconds=0.25)
    assert c.as_dict() == {"grad": {"calls": 2, "bytes_sent": 12, "bytes_received": 12, "modelled_seconds": 0.25},
                           "rows": {"calls": 1, "bytes_sent": 0, "bytes_received": 0, "modelled_seconds": 0.5}}
    assert c.total_modelled_seconds() == 0.75
    c.reset()
    c.add("x")
    assert c.as_dict() == {"x": {"calls": 1, "bytes_sent": 0, "bytes_received": 0}}


# ---------------------------------------------------------------- two gloo ranks

# 1 MB/s and 20 ms: 100 kB take 0.12 s, measurable against the scheduling noise of a shared machine
LINK = Link(bandwidth=1e6, latency=0.02, name="test")
COMPUTE = 0.6  # seconds of "computation" overlapped with an asynchronous all-reduce of ~0.62 s


def _timed(fn):
    dist.barrier()  # both ranks issue together (a raw barrier: not priced)
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _checks(rank: int) -> dict:
    """What rank ``rank`` measures; the tests assert on it."""
    out: dict = {}
    C.set_link(LINK)
    c = C.ByteCounter()

    # synchronous all-reduce of 200 kB: 0.02 + 0.2 s
    x = torch.full((50_000,), float(rank + 1))
    out["sync_all_reduce_s"], _ = _timed(lambda: C.all_reduce_mean([x], name="sync", counter=c))
    out["sync_all_reduce_values"] = sorted(set(x.tolist()))

    # asynchronous all-reduce of 600 kB (0.62 s) while this rank "computes" for 0.6 s
    y = torch.full((150_000,), float(rank + 1))

    def overlapped():
        handle = C.all_reduce_mean_async([y], name="async", counter=c)
        out["async_pending_at_issue"] = not handle.is_completed()
        time.sleep(COMPUTE)
        got = handle.wait()
        out["async_same_on_second_wait"] = handle.wait() is got and handle.is_completed()
        return got

    out["async_all_reduce_s"], got = _timed(overlapped)
    out["async_all_reduce_values"] = sorted(set(got[0].tolist()))
    # the same without computation in between: the full modelled time
    out["async_wait_at_once_s"], _ = _timed(lambda: C.all_reduce_mean_async([y], name="async", counter=c).wait())

    # two asynchronous all-reduces issued together share the rank's one link: the second is through
    # no earlier than both delays after the issue (queued, not each on a link of its own)
    def two_at_once():
        first = C.all_reduce_mean_async([x], name="queued", counter=c)
        second = C.all_reduce_mean_async([x.clone()], name="queued", counter=c)
        first.wait()
        out["queued_first_s"] = time.perf_counter() - began[0]
        return second.wait()

    began = [0.0]
    dist.barrier()
    began[0] = time.perf_counter()
    two_at_once()
    out["queued_both_s"] = time.perf_counter() - began[0]
    # a parts exchange (the counts now, the rows asynchronously) arrives as the synchronous one does
    parts = {"a": [torch.full((q + rank + 1, 2), float(10 * rank + q)) for q in range(2)],
             "b": [torch.arange(q + rank + 1) + 100 * rank for q in range(2)]}
    out["parts_async"] = {k: [t.tolist() for t in v] for k, v in C.all_to_all_parts_async(parts, name="pa", counter=c).wait().items()}
    out["parts_sync"] = {k: [t.tolist() for t in v] for k, v in C.all_to_all_rows(parts, name="ps", counter=c).items()}

    # all-to-all of rows: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0, none to itself
    counts = [1, 2] if rank == 0 else [3, 0]
    rows = [torch.arange(n * 3, dtype=torch.float64).view(n, 3) + 100 * rank + 10 * q for q, n in enumerate(counts)]
    got = C.all_to_all_rows_async(rows, name="rows", counter=c).wait()
    out["rows"] = [g.tolist() for g in got]
    known = C.all_to_all_rows_async(rows, name="rows_known", counter=c, counts=[1, 3] if rank == 0 else [2, 0]).wait()
    out["rows_known"] = [g.tolist() for g in known]
    # 400 kB each way (25_000 rows of 4 float32 to the other rank): 0.42 s
    big = [torch.ones(0 if q == rank else 25_000, 4) for q in range(2)]
    out["all_to_all_s"], _ = _timed(lambda: C.all_to_all_rows_async(big, name="big_rows", counter=c).wait())

    # every other helper pays too
    p = torch.full((10_000,), float(rank))
    out["broadcast_tensors_s"], _ = _timed(lambda: C.broadcast_tensors([p], src=0, name="bcast", counter=c))
    out["broadcast_object_s"], _ = _timed(lambda: C.broadcast_object("x" * 30_000, src=0, name="bobj", counter=c))
    out["all_gather_object_s"], _ = _timed(lambda: C.all_gather_object([rank] * 5_000, name="gobj", counter=c))
    out["barrier_s"], _ = _timed(lambda: C.barrier(name="barrier", counter=c))
    g_rows = torch.ones(2_000 * (rank + 1), 5)
    out["all_gather_rows_s"], _ = _timed(lambda: C.all_gather_rows(g_rows, name="grows", counter=c))
    out["counter"] = c.as_dict()

    # a group of one costs nothing, under the same link
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    c1 = C.ByteCounter()
    out["group_of_one_s"], _ = _timed(lambda: C.all_reduce_mean([torch.ones(1_000_000)], alone, counter=c1))
    out["group_of_one_counter"] = c1.as_dict()

    # compute on another device than gloo's (the shim's "meta"): results come back there
    with ShimDevice():
        z = torch.full((3,), float(rank + 1), device="meta")
        C.all_reduce_mean_async([z], counter=C.ByteCounter()).wait()
        parts = C.all_to_all_rows_async([torch.full((q + 1, 2), float(rank), device="meta") for q in range(2)],
                                        counter=C.ByteCounter()).wait()
        out["shim"] = {"mean": (z.device.type, z.tolist()), "rows": [(t.device.type, t.tolist()) for t in parts]}
    C.set_link(None)
    return out


def _worker(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        try:
            got = _checks(rank)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(got, buf)
        out.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, "failed", traceback.format_exc()))


@functools.cache  # one run of two ranks for the module
def _run() -> dict:
    return spawn_ranks(_worker, timeout=180)


@pytest.mark.distributed
def test_a_synchronous_collective_takes_at_least_its_modelled_time():
    modelled = link_seconds("all_reduce", 200_000, 2, LINK)
    assert modelled == pytest.approx(0.22)
    for rank, got in _run().items():
        assert got["sync_all_reduce_values"] == [1.5]
        assert modelled <= got["sync_all_reduce_s"] < modelled + 1.5, rank
        assert got["counter"]["sync"] == {"calls": 1, "bytes_sent": 200_000, "bytes_received": 200_000,
                                          "modelled_seconds": pytest.approx(modelled)}
        assert link_seconds("all_to_all", 400_000, 2, LINK) <= got["all_to_all_s"] < 0.42 + 1.5


@pytest.mark.distributed
def test_an_asynchronous_collective_overlaps_computation():
    """Issue, compute 0.6 s, wait: about max(0.6, 0.62) s, clearly less than 0.6 + 0.62."""
    modelled = link_seconds("all_reduce", 600_000, 2, LINK)
    assert modelled == pytest.approx(0.62)
    for rank, got in _run().items():
        assert got["async_all_reduce_values"] == [1.5]
        assert got["async_pending_at_issue"] and got["async_same_on_second_wait"]
        assert max(COMPUTE, modelled) <= got["async_all_reduce_s"] < COMPUTE + modelled - 0.25, rank
        assert modelled <= got["async_wait_at_once_s"] < modelled + 1.5, rank  # nothing to overlap: the whole delay
        assert got["counter"]["async"] == {"calls": 2, "bytes_sent": 1_200_000, "bytes_received": 1_200_000,
                                           "modelled_seconds": pytest.approx(2 * modelled)}


@pytest.mark.distributed
def test_collectives_in_flight_together_queue_on_the_ranks_link():
    one = link_seconds("all_reduce", 200_000, 2, LINK)
    for rank, got in _run().items():
        assert one <= got["queued_first_s"] < one + 1.0, rank
        assert 2 * one <= got["queued_both_s"] < 2 * one + 1.5, rank  # not about one: the link is shared
        assert got["parts_async"] == got["parts_sync"] and len(got["parts_sync"]["a"]) == 2


@pytest.mark.distributed
def test_all_to_all_rows_delivers_and_counts_what_crosses_the_link():
    r0, r1 = _run()[0], _run()[1]
    # rank 0 got its own row to itself and rank 1's 3 rows; rank 1 got rank 0's 2 rows and none of its own
    assert r0["rows"] == [[[0.0, 1, 2]], [[100.0, 101, 102], [103, 104, 105], [106, 107, 108]]]
    assert r1["rows"] == [[[10.0, 11, 12], [13, 14, 15]], []]
    assert r0["rows_known"] == r0["rows"] and r1["rows_known"] == r1["rows"]
    row = 3 * 8  # float64 rows of 3
    assert r0["counter"]["rows"] == {"calls": 1, "bytes_sent": 2 * row, "bytes_received": 3 * row,
                                     "modelled_seconds": pytest.approx(link_seconds("all_to_all", 3 * row, 2, LINK))}
    assert r1["counter"]["rows"] == {"calls": 1, "bytes_sent": 3 * row, "bytes_received": 2 * row,
                                     "modelled_seconds": pytest.approx(link_seconds("all_to_all", 3 * row, 2, LINK))}
    for got in (r0, r1):
        assert got["counter"]["big_rows"]["bytes_sent"] == got["counter"]["big_rows"]["bytes_received"] == 400_000


@pytest.mark.distributed
def test_every_helper_pays_for_what_it_counts():
    kinds = {"bcast": "broadcast", "bobj": "broadcast", "gobj": "all_gather", "barrier": "barrier",
             "grows": "all_gather"}
    timings = {"bcast": "broadcast_tensors_s", "bobj": "broadcast_object_s", "gobj": "all_gather_object_s",
               "barrier": "barrier_s", "grows": "all_gather_rows_s"}
    for rank, got in _run().items():
        for name, kind in kinds.items():
            t = got["counter"][name]
            modelled = link_seconds(kind, max(t["bytes_sent"], t["bytes_received"]), 2, LINK)
            assert t["calls"] == 1 and t["modelled_seconds"] == pytest.approx(modelled), (rank, name)
            assert modelled <= got[timings[name]] < modelled + 1.5, (rank, name)
        assert got["counter"]["bcast"][["bytes_sent", "bytes_received"][rank]] == 40_000
        assert got["counter"]["barrier"]["modelled_seconds"] == pytest.approx(LINK.latency)
        assert got["counter"]["grows"]["bytes_sent"] == 2_000 * (rank + 1) * 5 * 4  # each rank pays its own traffic


@pytest.mark.distributed
def test_a_group_of_one_costs_nothing_and_devices_are_kept():
    for rank, got in _run().items():
        assert got["group_of_one_counter"] == {} and got["group_of_one_s"] < 0.5
        assert got["shim"]["mean"] == ("meta", [1.5, 1.5, 1.5])
        assert got["shim"]["rows"] == [("meta", [[0.0, 0.0]] * (rank + 1)), ("meta", [[1.0, 1.0]] * (rank + 1))]
