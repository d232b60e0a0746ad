"""One processed graph per machine (issue 42): a cache entry is built once, by one process, whatever
the number of processes and machines asking; a build killed half-way leaves nothing a later run
trusts; every process maps the entry read-only; training on it gives the in-memory results."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.runtime.test_parallel import free_port
from tgdist.data import mapped
from tgdist.data.load import load_graph
from tgdist.errors import DataError
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.run import Run

REPO = Path(__file__).resolve().parents[2]


def entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def events(path: Path, n: int = 3000, nodes: int = 80, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, nodes, n), rng.integers(0, nodes, n)
    feats = rng.standard_normal((n, 3)).round(3)
    path.write_text("".join(f"{s},{d},{i},{a},{b},{c}\n" for i, (s, d, (a, b, c)) in enumerate(zip(src, dst, feats))))
    return path


# A loader that reports whether it built the entry (mapped.write ran in it) and what it mapped.
LOADER = textwrap.dedent("""
    import json, os, sys, time
    from tgdist.data import mapped
    from tgdist.data.load import load_graph
    writes = []
    real = mapped.write
    def counting(folder, arrays, meta):
        writes.append(str(folder))
        time.sleep(float(os.environ.get("SLOW_WRITE", "0")))  # keeps the lock a while: the others must wait
        return real(folder, arrays, meta)
    mapped.write = counting
    g = load_graph(sys.argv[1], cache_dir=sys.argv[2])
    print(json.dumps({"built": len(writes), "mapped": g.mapped, "writeable": bool(g.src.flags.writeable),
                      "inode": os.stat(os.path.join(g.mapped, "src.npy")).st_ino, "src": g.src.tolist()[:50],
                      "edge_feat": g.edge_feat[:20].tolist()}))
""")


def load_together(source, cache, n: int) -> list[dict]:
    """``LOADER`` in ``n`` processes started at once (each entry write slowed): each one's report."""
    env = {**os.environ, "SLOW_WRITE": "1.5"}
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, str(source), str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_processes_starting_together_build_the_entry_once_and_map_the_same_files(tmp_path):
    source, cache = events(tmp_path / "e.csv"), tmp_path / "cache"
    out = load_together(source, cache, 4)
    assert sorted(o["built"] for o in out) == [0, 0, 0, 1]  # one builder; three waited, then mapped
    assert len({o["mapped"] for o in out}) == 1 and len({o["inode"] for o in out}) == 1
    assert not any(o["writeable"] for o in out)  # read-only maps, no private copies
    assert all(o["src"] == out[0]["src"] and o["edge_feat"] == out[0]["edge_feat"] for o in out)
    (entry,) = entries(cache)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == [f".{entry.name}.lock"]  # no .part left
    mapped.verify(entry)
    g = load_graph(source, cache=False)  # the source read in memory, as before the cache was mapped
    assert out[0]["src"] == g.src.tolist()[:50] and np.allclose(out[0]["edge_feat"], g.edge_feat[:20])


def test_a_build_killed_by_sigkill_leaves_no_lock_and_nothing_a_later_run_trusts(tmp_path):
    """The builder is killed while it writes (its .part folder half full, the lock held): the lock
    dies with it, no entry appears under the final name, and the next load builds it afresh and
    removes the leftovers."""
    source, cache = events(tmp_path / "e.csv"), tmp_path / "cache"
    hang = textwrap.dedent("""
        import numpy as np, os, time
        from tgdist.data import mapped
        real_save, saved = np.save, []
        def slow_save(path, a, **kw):  # the second array: half-written, then a long wait for the kill
            saved.append(path)
            real_save(path, a, **kw)
            if len(saved) == 2:
                open(os.environ['READY'], 'w').close()
                time.sleep(600)
        mapped.np.save = slow_save
    """)
    ready = tmp_path / "ready"
    env = {**os.environ, "READY": str(ready), "SLOW_WRITE": "0"}
    p = subprocess.Popen([sys.executable, "-c", hang + LOADER, str(source), str(cache)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    parts = [x for x in cache.iterdir() if ".part-" in x.name]
    assert len(parts) == 1 and len(list(parts[0].iterdir())) == 2 and entries(cache) == []
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    (lock,) = [x for x in cache.iterdir() if x.name.endswith(".lock")]
    with open(lock) as f:  # nobody holds it: the kernel dropped it with the builder
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    g = load_graph(source, cache_dir=cache)
    (entry,) = entries(cache)
    assert g.mapped == str(entry) and not any(".part-" in x.name for x in cache.iterdir())
    mapped.verify(entry)
    assert g.src.tolist() == load_graph(source, cache=False).src.tolist()


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("data", ["collegemsg", "wikipedia", pytest.param("wikipedia-all", marks=pytest.mark.slow)])
def test_a_run_on_the_mapped_graph_gives_the_in_memory_results(tmp_path, data):
    """The same training from the graph read into memory (data.cache=false: the reader's arrays, the
    T-CSR built by the sampler, the features copied into a tensor, as before the cache was mapped)
    and from the mapped entry (read-only maps, the entry's T-CSR, features gathered from the map,
    times converted per batch): identical scores. Wikipedia's first 12,000 events keep it quick
    (data.max_events: the sampler builds their T-CSR, the features come from the map); all of it,
    with the entry's T-CSR, is in the slow set. CollegeMsg's whole stream (the entry's T-CSR) runs
    with small dims (what is compared does not depend on them; 30 s at the default ones)."""
    base = [f"data={data.removesuffix('-all')}", "train.epochs=1", "train.progress=false", "train.num_neg_eval=9",
            f"data.cache_dir={tmp_path / 'cache'}"] + (["data.max_events=12000"] if data == "wikipedia" else [])
    if data == "collegemsg":
        base += ["model.mem_dim=16", "model.time_dim=16"]
    scores = {}
    for cache in ("false", "true"):  # the builder maps the entry it wrote, as every other process does
        cfg = compose([*base, f"data.cache={cache}"])
        tr = build_trainer(cfg, progress=False)
        assert (tr.g.mapped is not None) == (cache == "true")
        scores[cache] = Run(cfg, str(tmp_path / f"run-{cache}"), trainer=tr).train()
    for key in ("loss", "val_ap", "val_auc", "test_ap", "test_auc", "test_mrr", "traversed_events"):
        assert scores["true"][key] == scores["false"][key], key


def _agent(n: int, port: int, cache: Path, tmp: Path, *overrides: str) -> tuple[list[str], dict]:
    """One simulated machine: a torchrun agent (node rank ``n`` of 2, two ranks) in its own UTS
    namespace with its own host name where ``unshare`` allows it, else told apart by
    ``TGDIST_MACHINE_ID``; its own temporary folder (its ``/tmp``: where the check stamps live)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=2", f"--node-rank={n}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",  # not the host name
           "--max-restarts=0", "-m", "tgdist.train",
           *overrides, f"data.cache_dir={cache}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    if shutil.which("unshare") and subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "-u", "sh", "-c", f'hostname sim-machine-{n} && exec "$@"', "sh", *cmd]
    else:
        env["TGDIST_MACHINE_ID"] = f"sim-machine-{n}"
    return cmd, env


def _two_machines(tmp_path: Path, caches: tuple[Path, Path]) -> list[dict]:
    port = free_port()
    overrides = ["data=synthetic", "data.synthetic.num_events=4000", "data.synthetic.num_nodes=300",
                 "data.synthetic.edge_dim=4", "parallel.i=4", "memory.backend=sven", "partition.method=interval",
                 "train.batch_size=50", "train.epochs=1", "train.stop_after_batches=4", "train.progress=false",
                 "train.num_threads=1", "sampler.num_threads=1", f"run_dir={tmp_path / 'run'}"]
    procs = []
    for n in (0, 1):
        tmp = tmp_path / f"tmp{n}"
        tmp.mkdir()
        cmd, env = _agent(n, port, caches[n], tmp, *overrides)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    stamps = [sorted((tmp_path / f"tmp{n}").glob("tgdist-verified-*/*")) for n in (0, 1)]
    manifests = [json.loads((e / "manifest.json").read_text()) for c in set(caches) for e in entries(c)]
    return [{"stamps": len(s)} for s in stamps], manifests


@pytest.mark.slow
def test_two_machines_sharing_a_cache_folder_build_it_once(tmp_path):
    """A shared file system (most clusters): both machines see one cache folder. One process of one
    machine builds the entry; the other machine's ranks wait, check it once (their machine's
    stamp), and map it: never two writers, no node-local copy."""
    shared = tmp_path / "shared-cache"
    machines, manifests = _two_machines(tmp_path, (shared, shared))
    assert len(manifests) == 1 and manifests[0]["built_on"].split(":")[0] in ("sim-machine-0", "sim-machine-1")
    assert [m["stamps"] for m in machines] == [1, 1]  # each machine checked the one entry once
    assert not [x for x in shared.iterdir() if ".part-" in x.name]


@pytest.mark.slow
def test_two_machines_with_node_local_cache_folders_build_one_copy_each(tmp_path):
    local = (tmp_path / "local0", tmp_path / "local1")
    machines, manifests = _two_machines(tmp_path, local)
    assert sorted(m["built_on"].split(":")[0] for m in manifests) == ["sim-machine-0", "sim-machine-1"]
    assert [m["stamps"] for m in machines] == [1, 1]
    assert [len(entries(c)) for c in local] == [1, 1]


# ---------------------------------------------------------------------------------------------
# Large edge lists are read block by block (readers.edgelist._stream_edgelist), to the whole-file reader's graph

STREAM_CASES = {
    "features": "".join(f"{i * 7 % 13},{i * 5 % 11 + 20},{i},{i * 0.5},{-i}\n" for i in range(300)),
    "header_by_names": "timestamp,source,target,weight\n" + "".join(f"{i},{i % 9},{i % 4 + 100},{i / 3:.4f}\n"
                                                                     for i in range(300)),
    "comments_and_whitespace": "% konect\n# more\n" + "".join(f"{i % 17} {i % 5 + 3} {i * 2}\n" for i in range(300)),
    "float_times": "".join(f"{i % 17},{i % 5 + 3},{i * 0.25}\n" for i in range(300)),
    "negative_ids": "".join(f"{-(i % 17)},{i % 5 + 3},{i}\n" for i in range(300)),
    "unsorted": "".join(f"{i % 17},{i % 5 + 3},{(i * 37) % 300}\n" for i in range(300)),  # the whole-file reader
    "names": "".join(f"n{i % 17},m{i % 5},{i}\n" for i in range(300)),  # the whole-file reader
}


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
@pytest.mark.parametrize("suffix", [".csv", ".csv.gz"])
def test_an_edge_list_read_in_blocks_is_the_graph_read_whole(tmp_path, monkeypatch, case, suffix):
    import gzip
    import warnings

    from tgdist.data.readers import edgelist as edgelist_reader

    text = STREAM_CASES[case].encode()
    path = tmp_path / f"e{suffix}"
    path.write_bytes(gzip.compress(text) if suffix.endswith(".gz") else text)
    with warnings.catch_warnings(record=True) as whole_said:
        warnings.simplefilter("always")
        whole = load_graph(path, cache=False)
    monkeypatch.setattr(edgelist_reader, "STREAM_BYTES", 0)
    monkeypatch.setattr(edgelist_reader, "STREAM_BLOCK", 97)  # a few lines a block: every case crosses many blocks
    streamed_blocks = []
    real = edgelist_reader._stream_edgelist
    monkeypatch.setattr(edgelist_reader, "_stream_edgelist", lambda *a: streamed_blocks.append(r := real(*a)) or r)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = load_graph(path, cache_dir=tmp_path / "cache")
    assert len(streamed_blocks) == 1
    assert (streamed_blocks[0] is None) == (case in ("unsorted", "names"))  # those went to the whole-file reader
    for k in ("src", "dst", "t", "node_map", "edge_feat", "label"):
        a, b = getattr(whole, k), getattr(got, k)
        assert (a is None) == (b is None), k
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a, b), k
    assert (got.num_nodes, got.bipartite) == (whole.num_nodes, whole.bipartite)
    assert [str(w.message) for w in said] == [str(w.message) for w in whole_said]
    with warnings.catch_warnings(record=True) as repeated:
        warnings.simplefilter("always")
        again = load_graph(path, cache_dir=tmp_path / "cache")  # mapped: the stored notes repeated
    assert np.array_equal(again.src, whole.src) and [str(w.message) for w in repeated] == [str(w.message) for w in said]


def test_a_bipartite_edge_list_read_in_blocks(tmp_path, monkeypatch):
    from tgdist.data.readers import edgelist as edgelist_reader

    path = tmp_path / "e.csv"
    path.write_text("".join(f"{i % 7},{i % 7},{i}\n" for i in range(200)))  # the same ids on both sides
    whole = load_graph(path, cache=False, bipartite=True)
    monkeypatch.setattr(edgelist_reader, "STREAM_BYTES", 0)
    monkeypatch.setattr(edgelist_reader, "STREAM_BLOCK", 50)
    got = load_graph(path, cache_dir=tmp_path / "cache", bipartite=True)
    assert got.num_src_nodes == whole.num_src_nodes == 7 and got.num_nodes == 14
    assert np.array_equal(got.src, whole.src) and np.array_equal(got.dst, whole.dst)
    assert np.array_equal(got.node_map, whole.node_map)


def test_a_bad_line_late_in_a_large_file_is_named_by_its_line(tmp_path, monkeypatch):
    from tgdist.data.readers import edgelist as edgelist_reader
    from tgdist.errors import DataError

    path = tmp_path / "e.csv"
    path.write_text("".join(f"{i % 7},{i % 5},{i}\n" for i in range(200)) + "3,4,later\n")
    monkeypatch.setattr(edgelist_reader, "STREAM_BYTES", 0)
    monkeypatch.setattr(edgelist_reader, "STREAM_BLOCK", 64)
    with pytest.raises(DataError, match=r"e\.csv:201: "):
        load_graph(path, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing left behind: no entry, lock or spooled features


def test_host_rows_gather_what_the_table_holds():
    import torch

    from tgdist.runtime.features import HostRows, RelativeTimes

    table = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    rows = HostRows(table, torch.device("cpu"))
    idx = torch.tensor([[3, 1], [0, 9]])
    assert torch.equal(rows[idx], table[idx]) and torch.equal(rows.index_select(0, idx[0]), table[[3, 1]])
    t = np.array([5, 7, 11, 20], dtype=np.int64)
    rel = RelativeTimes(t, 2.0)
    assert rel[1:3].tolist() == [1.0, 3.0] and rel[3] == 7.5 and len(rel) == 4
    assert np.array_equal(rel[:], (t - t[0]).astype(np.float64) / 2.0)


def test_an_unwritable_cache_folder_reads_the_graph_into_memory_with_a_warning(tmp_path, caplog):
    source = events(tmp_path / "e.csv")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="tgdist.data"):
        g = load_graph(source, cache_dir=blocker / "cache")
    assert f"could not write cache {blocker / 'cache'}/e-" in caplog.text
    assert g.mapped is None and g.src.tolist() == load_graph(source, cache=False).src.tolist()


# ---------------------------------------------------------------------------------------------
# A damaged entry is rebuilt, never served (issue 52): the manifest is sealed by its checksum, a
# truncated file is refused by its size, a full disk leaves nothing behind


def two_sided(path: Path) -> Path:
    """200 nodes (100 sources, 100 destinations), not read as bipartite: 200 -> 208 is one bit."""
    path.write_text("".join(f"{i % 100},{100 + (i * 7) % 100},{i},{i % 3}.5\n" for i in range(1000)))
    return path


def _edit_manifest(entry: Path, edit) -> None:
    m = json.loads((entry / "manifest.json").read_text())
    edit(m)
    (entry / "manifest.json").write_text(json.dumps(m, indent=1))  # its checksum kept as it was


def _flip_a_bit(m: dict) -> None:
    """num_nodes 200 -> 208 as one flipped bit of the file would make it: "0" (0x30) -> "8" (0x38)."""
    assert m["meta"]["num_nodes"] == 200
    m["meta"]["num_nodes"] = int(str(200)[:-1] + chr(ord("0") ^ 8))


EDITS = {
    "num_nodes": (_flip_a_bit, "does not match its checksum"),
    "bipartite": (lambda m: m["meta"].update(bipartite=not m["meta"]["bipartite"]), "does not match its checksum"),
    "dtype": (lambda m: m["arrays"]["t"].update(dtype="<f8"), "does not match its checksum"),
    "no_checksum": (lambda m: m.pop("checksum"), "has no checksum \\(written by an older tgdist\\)"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_entry_whose_manifest_was_edited_is_rebuilt_never_served(tmp_path, caplog, edit):
    """The manifest's meta has no file digest: an edited node count (one flipped bit: 200 -> 208) or
    bipartite flag changed training without a word, and an edited dtype was refused on every run,
    never rebuilt. Each is now found by the manifest's checksum and rebuilt, with a warning."""
    source, cache = two_sided(tmp_path / "e.csv"), tmp_path / "cache"
    g = load_graph(source, cache_dir=cache)
    assert (g.num_nodes, g.bipartite, g.t.dtype) == (200, False, np.int64)
    src, t = g.src.tolist(), g.t.tolist()
    (entry,) = entries(cache)
    change, why = EDITS[edit]
    _edit_manifest(entry, change)
    with caplog.at_level("WARNING", logger="tgdist.data.mapped"):
        h = load_graph(source, cache_dir=cache)
    assert (h.num_nodes, h.bipartite, h.t.dtype) == (200, False, np.int64)
    assert h.src.tolist() == src and h.t.tolist() == t
    assert re.search(f"{re.escape(str(entry))}/manifest.json: {why}.*; building it again", caplog.text)
    m = json.loads((entry / "manifest.json").read_text())  # written again, as it was
    assert (m["meta"]["num_nodes"], m["meta"]["bipartite"], m["arrays"]["t"]["dtype"]) == (200, False, "<i8")
    mapped.verify(entry)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tgdist.data.mapped"):
        assert load_graph(source, cache_dir=cache).num_nodes == 200
    assert caplog.text == ""  # intact now: mapped as it is


def test_processes_finding_an_edited_manifest_together_rebuild_it_once(tmp_path):
    """Ranks of one run map the entry at once: one of them rebuilds the damaged entry under the
    lock, the others wait and map what it wrote."""
    source, cache = two_sided(tmp_path / "e.csv"), tmp_path / "cache"
    load_graph(source, cache_dir=cache)
    (entry,) = entries(cache)
    _edit_manifest(entry, EDITS["num_nodes"][0])
    out = load_together(source, cache, 3)
    assert sorted(o["built"] for o in out) == [0, 0, 1] and len({o["inode"] for o in out}) == 1
    assert json.loads((entry / "manifest.json").read_text())["meta"]["num_nodes"] == 200
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == [f".{entry.name}.lock"]


def test_a_truncated_npy_in_an_entry_is_refused_by_its_size_and_rebuilt(tmp_path, monkeypatch):
    """What a truncated file does: ``load`` and ``verify`` raise, naming it and both sizes, before
    any file is hashed (an entry's features may be tens of GB); a run rebuilds the entry from the
    source and maps the new files."""
    source, cache = events(tmp_path / "e.csv"), tmp_path / "cache"
    g = load_graph(source, cache_dir=cache)
    src = g.src.tolist()
    (entry,) = entries(cache)
    path = entry / "src.npy"
    whole = path.stat().st_size
    path.write_bytes(path.read_bytes()[:100])
    hashed = []
    real_digest = mapped.digest_file
    monkeypatch.setattr(mapped, "digest_file", lambda p: hashed.append(Path(p)) or real_digest(p))
    said = f"{entry}: src.npy holds 100 bytes, the manifest says {whole:,}"
    for check in (mapped.verify, mapped.load):
        with pytest.raises(DataError) as err:
            check(entry)
        assert str(err.value) == said
    assert hashed == []
    h = load_graph(source, cache_dir=cache)
    assert h.src.tolist() == src and h.mapped == str(entry) and path.stat().st_size == whole
    assert not [p for p in hashed if p.parent == entry]  # refused by its size; only the new files were hashed
    mapped.verify(entry)


class ShortWrite:
    """``np.save`` as on a full disk: the first ``ok`` arrays written, then half of one and numpy's error."""

    def __init__(self, error: OSError, ok: int = 2):
        self.error, self.ok, self.calls = error, ok, 0

    def __call__(self, path, a, **kw):
        self.calls += 1
        if self.calls > self.ok:
            Path(path).write_bytes(b"\x93NUMPY" + b"\0" * 100)
            raise self.error
        return REAL_SAVE(path, a, **kw)


REAL_SAVE = np.save


@pytest.mark.parametrize("error", [OSError("59835 requested and 5616 written"),
                                   OSError(errno.ENOSPC, "No space left on device")], ids=["numpy", "errno"])
def test_a_full_disk_while_writing_an_entry_leaves_nothing_and_reads_the_graph_into_memory(tmp_path, caplog,
                                                                                           monkeypatch, error):
    """numpy reports a short write as "59835 requested and 5616 written": said as what it is, naming
    the entry, and, as for a cache folder that cannot be written, the graph is read into memory with
    a warning; no part of the entry, no lock file is left."""
    source, cache = events(tmp_path / "e.csv"), tmp_path / "cache"
    monkeypatch.setattr(mapped.np, "save", ShortWrite(error))
    with caplog.at_level("WARNING", logger="tgdist.data"):
        g = load_graph(source, cache_dir=cache)
    monkeypatch.undo()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # (an earlier test may leave INFO on)
    m = re.search(r"no space left on device writing the cache entry at (\S+) \(([\d,]+) bytes needed, "
                  r"([\d,]+) bytes free there\); the graph is read into memory instead$", "\n".join(said))
    assert m, said
    whole = load_graph(source, cache=False)
    assert m.group(1).startswith(f"{cache}/e-") and int(m.group(2).replace(",", "")) > whole.edge_feat.nbytes
    assert not any("requested and" in x for x in said) and len(said) == 1
    assert g.mapped is None and g.src.tolist() == whole.src.tolist() and np.array_equal(g.edge_feat, whole.edge_feat)
    assert list(cache.iterdir()) == []
    assert load_graph(source, cache_dir=cache).mapped is not None  # room again: the entry is written


def test_a_full_disk_while_a_large_edge_list_is_spooled_leaves_nothing(tmp_path, caplog, monkeypatch):
    """A large edge list's columns go to files beside the entry as they are read: a disk that fills
    then is the same warning, and those files are removed."""
    from tgdist.data.readers import edgelist as edgelist_reader

    source, cache = events(tmp_path / "e.csv"), tmp_path / "cache"
    monkeypatch.setattr(edgelist_reader, "STREAM_BYTES", 0)
    monkeypatch.setattr(edgelist_reader, "STREAM_BLOCK", 4096)
    real_append, blocks = mapped.NpyAppender.append, []

    def full(self, block):
        blocks.append(self.path)
        if len(blocks) > 12:
            self.f.write(b"\0" * 10)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, block)

    monkeypatch.setattr(mapped.NpyAppender, "append", full)
    with caplog.at_level("WARNING", logger="tgdist.data"):
        g = load_graph(source, cache_dir=cache)
    assert len(blocks) > 12 and any(p.parent == cache for p in blocks)
    assert re.search(rf"no space left on device writing the cache entry at {re.escape(str(cache))}/e-\w+ "
                     r"\([\d,]+ bytes free there\); the graph is read into memory instead", caplog.text)
    assert g.mapped is None and g.src.tolist() == load_graph(source, cache=False).src.tolist()
    assert list(cache.iterdir()) == []


def test_a_full_disk_in_write_removes_the_files_it_was_to_move_in(tmp_path, monkeypatch):
    """``write`` takes files a builder spooled beside the entry: a write that fails before moving
    them in removes them too, and says how many bytes the entry needed."""
    entry = tmp_path / "g-0123"
    spooled = mapped.spool_path(entry, "edge_feat")
    np.save(spooled, np.ones((10, 4), dtype=np.float32))
    monkeypatch.setattr(mapped.np, "save", ShortWrite(OSError("800 requested and 96 written"), ok=0))
    with pytest.raises(mapped.NoSpaceError) as err:
        mapped.write(entry, {"src": np.arange(100), "edge_feat": spooled}, {})
    assert err.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"no space left on device writing the cache entry at {re.escape(str(entry))} "
                        r"\(928 bytes needed, [\d,]+ bytes free there\)", err.value.strerror)
    assert list(tmp_path.iterdir()) == []
