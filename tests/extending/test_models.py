"""A model registered from outside the package (tests/extending/toy_model.py) is picked by
``model.name`` and trains through ``tgdist train``, at the file count docs/architecture.md gives."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["data=synthetic", "data.synthetic.num_events=2000", "train.epochs=1", "model.mem_dim=16", "model.time_dim=8",
        "train.num_neg_eval=4", "train.progress=false"]


def tgdist(*args, cwd, plugins=None, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TGDIST_PLUGINS"}
    environ.update(PYTHONPATH=str(ROOT), **env)
    if plugins:
        environ["TGDIST_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-m", "tgdist", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=300)


def test_a_model_registered_from_outside_trains_through_tgdist_train(tmp_path):
    calls = tmp_path / "calls.txt"
    r = tgdist("train", "model.name=toy", *TINY, f"run_dir={tmp_path / 'run'}", cwd=tmp_path,
               plugins="tests.extending.toy_model", TOY_MODEL_CALLS=str(calls))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["model"] == "toy" and summary["epochs"] == 1 and 0 <= summary["test_ap"] <= 1
    made = calls.read_text().split()
    # built once; its embedding ran for every training batch, and for validation and test
    assert made.count("build") == 1 and made.count("embed") > summary["iterations"]


def test_without_the_extension_its_name_is_refused_in_one_line(tmp_path):
    r = tgdist("train", "model.name=toy", *TINY, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["tgdist train: error: model.name=toy: choose one of tgn, jodie, apan"]
    assert list(tmp_path.iterdir()) == []


def test_the_documented_file_count_is_what_the_toy_needed():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n### A model\n", 1)[1].split("\n#", 1)[0]
    words = {"one": 1, "two": 2, "three": 3}
    got = re.match(r"\s*(\w+) modules?, (\d+) config files?\.", section, re.IGNORECASE)
    assert got, section[:80]
    modules, configs = words.get(got[1].lower(), None) or int(got[1]), int(got[2])
    toy_modules = [p for p in (ROOT / "tests" / "extending").glob("*.py") if p.name.startswith("toy_model")]
    toy_configs = [p for p in (ROOT / "configs").rglob("*.yaml") if "toy" in p.stem]
    assert (modules, configs) == (len(toy_modules), len(toy_configs)) == (1, 0)


def test_the_python_api_composes_with_the_extension_as_the_command_does(tmp_path):
    code = ("from tgdist.runtime.build import compose, validate; cfg = compose(['model.name=toy']); validate(cfg); "
            "print(cfg.model.name)")
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "TGDIST_PLUGINS": "tests.extending.toy_model"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["toy"], r.stderr
