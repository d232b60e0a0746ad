"""A memory store and a pipeline strategy added from outside the package (issue 54, points 1 and 5):
each is one module registered through ``TGDIST_PLUGINS``, picked by config, trains through
``tgdist train``, and is priced by its own class in the advisor and ``tgdist plan``'s table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOYS = "tests.extending.toy_store,tests.extending.toy_pipeline"
PROFILE = ROOT / "tests" / "launcher" / "advisor_profile.json"


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TGDIST_PLUGINS": TOYS, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def toys(monkeypatch):
    """The two toys registered in this process as ``tgdist`` registers them (``plugins.load``), and
    taken out of the registries again after the test, so other tests see the built-in ones only."""
    from tgdist import memory, plugins
    from tgdist.launcher.advisor import model
    from tgdist.runtime.pipelines import registry

    monkeypatch.setenv(plugins.ENV, TOYS)
    model.pipeline_options.cache_clear()
    plugins.load()
    yield
    memory.STORES.pop("toy", None)
    registry.PIPELINES.pop("toy", None)
    for name in TOYS.split(","):
        plugins._loaded.discard(name)
        sys.modules.pop(name, None)
    model.pipeline_options.cache_clear()


def test_toys_are_priced_by_their_own_classes(toys):
    """The advisor weighs the toys without knowing them: the toy store's memory stages are its own
    ``price_memory`` (twice local memory's), the toy pipeline's iteration its own ``price`` (every
    stage in turn plus its fixed cost, where the plain loop's is the stages in turn)."""
    from tests.extending.toy_pipeline import ToyPipeline
    from tgdist.launcher.advisor import cluster as clusters
    from tgdist.launcher.advisor import model
    from tgdist.launcher.advisor.profile import read

    assert "toy" in model.store_names() and "toy" in model.pipeline_options()
    assert model.pipeline_options()["toy"].overrides == ("pipeline.mode=toy",)
    got = {(c.backend, c.pipeline): c for c in model.predict(read(PROFILE), clusters.preset("gpu-1"), batch_sizes=[300],
                                                            backends=["local", "toy"], pipelines=["none", "toy"])}
    assert all(c.refused is None for c in got.values())
    local, toy = got[("local", "none")], got[("toy", "none")]
    for stage in ("memory_read", "memory_write"):
        assert toy.stages[stage] == pytest.approx(2 * local.stages[stage], rel=1e-12)
    assert toy.epoch_s > local.epoch_s
    assert got[("local", "toy")].iteration_s == pytest.approx(local.iteration_s + ToyPipeline.OVERHEAD_S, rel=1e-9)
    assert "memory.backend=toy" in toy.overrides() and "pipeline.mode=toy" in got[("local", "toy")].overrides()


def test_toys_appear_priced_in_the_plan_table(tmp_path):
    """``tgdist plan --from-profile`` (the quickest table: no measuring) lists the toy store and the
    toy pipeline with their predicted epoch times."""
    r = subprocess.run([sys.executable, "-m", "tgdist", "plan", "--from-profile", str(PROFILE), "--cluster",
                        "cpu-2-ib100", "--backends", "toy", "local", "--pipelines", "toy", "none", "--top", "8"],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if re.match(r"\s*\d+ \d+x\d+x\d+ ", ln)]
    priced = {(row[2], row[3]): float(row[5]) for row in rows}  # (memory, pipeline) -> epoch s
    assert {("toy", "toy"), ("toy", "none"), ("local", "toy")} <= set(priced), r.stdout
    assert priced[("toy", "none")] > priced[("local", "none")] > 0  # the toy store's own, dearer, memory stages


@pytest.mark.slow
def test_toys_train_through_tgdist_train(tmp_path):
    """``tgdist train memory.backend=toy pipeline.mode=toy`` on 2,000 synthetic events: the run's
    summary names both, and each toy counted its own calls (the store its reads and writes, the
    pipeline its iterations), so each was really used."""
    store_log, pipe_log = tmp_path / "store.log", tmp_path / "pipe.log"
    r = subprocess.run([sys.executable, "-m", "tgdist", "train", "data=synthetic", "data.synthetic.num_events=2000",
                        "data.synthetic.num_nodes=200", "model.mem_dim=16", "model.time_dim=8", "train.epochs=1",
                        "train.batch_size=200", "train.num_neg_eval=4", "train.progress=false", "memory.backend=toy",
                        "pipeline.mode=toy", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                       env=env(TGDIST_TOY_STORE_LOG=str(store_log), TGDIST_TOY_PIPELINE_LOG=str(pipe_log)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"memory_backend": "toy"' in r.stdout and '"mode": "toy"' in r.stdout
    iterations = int(re.search(r'"iterations": (\d+)', r.stdout).group(1))
    reads, writes = map(int, store_log.read_text().split())
    assert reads >= iterations and writes >= iterations > 0
    assert int(pipe_log.read_text()) == iterations


def test_architecture_page_counts_the_files_a_toy_needed():
    """docs/architecture.md's "Extending tgdist" gives the files a new store and a new pipeline need;
    the toys needed exactly that many (one module each, no config file: ``memory.backend=toy`` and
    ``pipeline.mode=toy`` pick them)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    words = {"one": 1, "two": 2, "three": 3, "0": 0, "no": 0}
    for kind, toy in (("A memory store", "toy_store"), ("A pipeline strategy", "toy_pipeline")):
        section = text.split(f"### {kind}\n", 1)[1].split("\n#", 1)[0]
        m = re.search(r"\b(one|two|three) modules?, (\d+|no) config files?\b", section, re.I)
        assert m, section
        modules, configs = words[m.group(1).lower()], words[m.group(2).lower()]
        assert modules == len([p for p in HERE.glob(f"{toy}*.py")]) == 1
        assert configs == len(list(HERE.glob(f"{toy}*.yaml"))) == 0
        assert f"tests/extending/{toy}.py" in section and "tests/extending/test_strategies.py" in section


def test_registries_see_extensions_without_the_command_line(tmp_path):
    """The Python API's registry lookups load the extensions themselves (``tgdist.plugins.load``):
    with ``TGDIST_PLUGINS`` set, ``memory.names()`` and the pipeline registry list the toys."""
    code = ("from tgdist import memory; from tgdist.runtime import pipelines; "
            "print('toy' in memory.names(), 'toy' in pipelines.names(), pipelines.pipeline_class('toy').__name__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "ToyPipeline"]
