"""Real torchrun launches on this machine (gloo): world detection, validation, named groups."""

from __future__ import annotations

import pytest

from tgdist.distributed.schedule import Layout

from .helpers import expected_mean, free_port, read_ranks, run_all, torchrun_cmd

pytestmark = pytest.mark.distributed


def check_groups(records: list[dict], layout: Layout) -> None:
    assert sorted(r["world"]["rank"] for r in records) == list(range(layout.world_size))
    for r in records:
        rank = r["world"]["rank"]
        ii, jj, kk = layout.coords(rank)
        want = {
            "world": list(range(layout.world_size)),
            "memory": layout.memory_group_ranks(kk),
            "minibatch": layout.subgroup_ranks(jj, kk),
            "epoch": layout.epoch_peer_ranks(ii, kk),
        }
        leaders = [layout.memory_group_ranks(g)[0] for g in range(layout.k)]
        if rank in leaders:
            want["leaders"] = leaders
        for name, ranks in want.items():
            assert r["groups"][name] == [ranks, expected_mean(ranks)], (rank, name)
        if rank not in leaders:
            assert r["groups"]["leaders"] is None
        assert r["bytes"]["world"] == 4  # one float32 averaged


def test_torchrun_two_processes(tmp_path):
    port = free_port()
    (res,) = run_all([torchrun_cmd(2, port, "--layout", "2,1,1", "--groups", "--out", str(tmp_path))])
    res.check()
    records = read_ranks(tmp_path, 2)
    check_groups(records, Layout(2, 1, 1))
    for r in records:
        w = r["world"]
        assert (w["world_size"], w["local_world_size"], w["num_nodes"], w["launcher"]) == (2, 2, 1, "torchrun")
        assert w["local_rank"] == w["rank"]
    assert len({r["master"] for r in records}) == 1


def test_destroy_frees_every_group_and_names_one_kept_elsewhere(tmp_path):
    """Gloo's shutdown is a no-op, so a group lives (with its threads) until its last reference goes;
    one alive at interpreter exit can abort a finished rank. ``destroy`` frees ours and names the
    group a caller still holds."""
    (res,) = run_all([torchrun_cmd(2, free_port(), "--layout", "1,2,1", "--groups", "--hold", "memory",
                                   "--out", str(tmp_path))])
    res.check()
    records = read_ranks(tmp_path, 2, freed=False)
    assert [r["leaked"] for r in records] == [["memory"], ["memory"]]
    assert "process groups memory are still referenced after destroy" in res.stderr


def test_torchrun_two_nodes_on_loopback(tmp_path):
    """Two torchrun agents (--nnodes 2, node ranks 0 and 1) meeting at one c10d endpoint, two
    processes each: a 2 x 1 x 2 layout, one memory group per "machine"."""
    port = free_port()
    cmds = [torchrun_cmd(2, port, "--layout", "2,1,2", "--groups", "--out", str(tmp_path), nnodes=2, node_rank=n)
            for n in (0, 1)]
    for res in run_all(cmds):
        res.check()
    records = read_ranks(tmp_path, 4)
    layout = Layout(2, 1, 2)
    check_groups(records, layout)
    for r in records:
        w = r["world"]
        assert (w["world_size"], w["local_world_size"], w["num_nodes"]) == (4, 2, 2)
        # torchrun numbers ranks node by node, so memory group kk lives on node kk
        assert w["node_rank"] == layout.coords(w["rank"])[2] and w["local_rank"] == w["rank"] % 2


@pytest.mark.slow
def test_torchrun_two_nodes_one_process_each(tmp_path):
    port = free_port()
    cmds = [torchrun_cmd(1, port, "--layout", "1,1,2", "--groups", "--out", str(tmp_path), nnodes=2, node_rank=n)
            for n in (0, 1)]
    for res in run_all(cmds):
        res.check()
    records = read_ranks(tmp_path, 2)
    check_groups(records, Layout(1, 1, 2))
    assert sorted((r["world"]["node_rank"], r["world"]["rank"]) for r in records) == [(0, 0), (1, 1)]


def test_torchrun_layout_mismatch_fails_before_training():
    port = free_port()
    (res,) = run_all([torchrun_cmd(2, port, "--layout", "2,1,2")])
    assert res.returncode != 0
    assert "parallel.i x parallel.j x parallel.k = 2 x 1 x 2 = 4 but the world has 2 processes" in res.stderr
