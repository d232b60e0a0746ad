"""A data format added from outside the package (``tests/extending/toy_reader.py``, imported by
``TGDIST_PLUGINS``) is a choice like the built-in ones: picked by ``data.format=toy`` and by its
sniffing rule under ``format=auto``, trained on by ``tgdist train``, described by ``tgdist data``;
and the config layer reads no data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tgdist.errors import ConfigError
from tgdist.runtime.build import compose, validate

ROOT = Path(__file__).resolve().parents[2]
TOY = "tests.extending.toy_reader"
QUICK = ["model.mem_dim=16", "model.time_dim=8", "train.epochs=1", "train.batch_size=100", "train.num_neg_eval=4",
         "train.progress=false"]


def toy_file(path: Path, num_events: int = 600) -> Path:
    """Events in the toy format: ``TOY``, then ``SRC > DST @ TIME`` lines among 30 nodes."""
    lines = ["TOY"] + [f"{(7 * i) % 30} > {(11 * i + 3) % 30} @ {10 * i}" for i in range(num_events)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tgdist(*args: str, cwd: Path, log: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TGDIST_PLUGINS": TOY, "PYTHONPATH": str(ROOT)}
    if log is not None:
        env["TOY_READER_LOG"] = str(log)
    return subprocess.run([sys.executable, "-m", "tgdist", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("how", ["data.format=toy", "format=auto"])
def test_a_reader_registered_from_outside_trains_picked_by_name_or_by_its_sniffing_rule(tmp_path, how):
    # under format=auto the name says nothing (a .txt, which the edge-list reader would refuse):
    # only the toy's rule, its first line, can pick it
    path = toy_file(tmp_path / ("events.toy" if how.startswith("data.") else "events.txt"))
    log = tmp_path / "toy.log"
    chosen = [how] if how.startswith("data.") else []
    r = tgdist("train", "data=file", f"data.path={path}", *chosen, *QUICK, f"run_dir={tmp_path / 'run'}",
               cwd=tmp_path, log=log)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["data"] == path.name.removesuffix(".txt") and 0 <= summary["test_ap"] <= 1  # (.toy is no data suffix)
    assert log.read_text() == f"parsed {path}\n"  # the toy read it, once (the ranks map the cache entry)


def test_tgdist_data_describes_a_file_the_toy_reader_reads(tmp_path):
    path = toy_file(tmp_path / "events.txt", num_events=50)
    log = tmp_path / "toy.log"
    for args in (["data", "info", str(path), "--no-cache"], ["data", "info", str(path), "--format", "toy", "--no-cache"]):
        r = tgdist(*args, cwd=tmp_path, log=log)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("events: 50 events, 30 nodes (general), t 0 .. 490 (int64)")
    assert log.read_text() == f"parsed {path}\n" * 2
    r = tgdist("data", "info", str(path), "--format", "edgelist", "--no-cache", cwd=tmp_path)  # not the toy's rule
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_an_unknown_format_is_one_line_naming_the_registered_readers(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose(["data.format=parquet"]))
    assert str(e.value) == "data.format=parquet: choose one of auto, edgelist, jodie, tgl, native, collegemsg, synthetic, tgb"
    r = tgdist("train", "data.format=parquet", *QUICK, cwd=tmp_path)  # the toy is among the choices there
    assert r.returncode == 2
    assert r.stderr == ("tgdist train: error: data.format=parquet: choose one of auto, edgelist, jodie, tgl, native, "
                        "collegemsg, synthetic, tgb, toy\n")


def test_the_config_layer_imports_no_data_module():
    """DESIGN: the config schema is ground that loads no data: importing it imports no
    ``tgdist.data`` module, and composing a run's config, data settings included, imports none
    beyond those the strategies' own modules import as they register (``load_strategies``, which
    composition needs first: each store and pipeline brings its config class)."""
    code = ("import sys; import tgdist.config.overrides; "
            "alone = sorted(m for m in sys.modules if m.startswith('tgdist.data')); "
            "from tgdist.runtime.build import load_strategies; load_strategies(); loaded = set(sys.modules); "
            "from tgdist.config.overrides import checked_compose; "
            "cfg = checked_compose(['data=file', 'data.path=events.toy', 'data.format=toy', 'data.max_events=10']); "
            "assert cfg.data.format == 'toy'; "
            "print(alone, sorted(m for m in set(sys.modules) - loaded if m.startswith('tgdist.data')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] []"


def test_the_documented_cost_of_a_new_reader_is_what_the_toy_needed():
    """docs/architecture.md's "A data reader" gives the files a new format needs; the toy is that."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("### A data reader", 1)[1].split("\n#", 1)[0]
    found = re.search(r"\*\*(\w+) modules?, (\d+) config files?\*\*", section)
    assert found, "the subsection names its file count as **N module(s), M config files**"
    words = {"one": 1, "two": 2, "three": 3}
    modules, configs = words.get(found.group(1), found.group(1)), int(found.group(2))
    toy_modules = [p for p in (ROOT / "tests" / "extending").glob("toy_reader*.py")]
    toy_configs = [p for p in (ROOT / "configs").rglob("*.yaml") if "toy" in p.read_text()]
    assert (int(modules), configs) == (len(toy_modules), len(toy_configs)) == (1, 0)
    assert "tests/extending/test_readers.py" in section
