"""TGB's evaluation (``train.eval=tgb``) in a parallel run: rank 0 evaluates on memory group 0's
copy, and its MRR is what one process gets evaluating the same trained model and memory, under
each memory backend."""

import json
import re

import pytest

from tests.data.tgb_files import write_wiki
from tests.runtime.test_parallel import torchrun
from tgdist.runtime import checkpoint
from tgdist.runtime.build import build_trainer, compose

pytestmark = pytest.mark.distributed

COMMON = ["data=tgb", "data.name=tgbl-wiki", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=50",
          "train.num_threads=1", "sampler.num_threads=1", "train.eval=tgb", "train.lr=1e-3",
          "train.epochs=2"]


def load_whole(path, tr) -> None:
    """The checkpoint's model and memory group 0's node memory into the one-process trainer
    ``tr``, the shards of a partitioned store (sven: each with the global ids it owns) put together."""
    state = checkpoint.read(path, map_location="cpu")
    tr.model.load_state_dict(state["model"])
    whole = {k: v.clone() for k, v in tr.memory.state_dict().items()}
    for name in (p for p in state["parts"] if p.startswith("memory-0")):
        part = checkpoint.read_part(path.parent / state["dir"] / name)
        if "owned" not in part:
            whole = part
            continue
        for key in whole:
            whole[key][part["owned"]] = part[f"shard.{key}"]
    tr.memory.load_state_dict(whole)


@pytest.mark.parametrize("layout, backend", [("2,1,1", "depcache"),
                                             pytest.param("2,1,1", "sven", marks=pytest.mark.slow),
                                             pytest.param("2,1,1", "daemon", marks=pytest.mark.slow),
                                             pytest.param("2,1,1", "depcomm", marks=pytest.mark.slow),
                                             pytest.param("1,2,1", "depcache", marks=pytest.mark.slow),
                                             pytest.param("1,1,2", "local", marks=pytest.mark.slow)])
def test_parallel_tgb_mrr_equals_one_process_evaluating_its_model_and_memory(tmp_path, layout, backend):
    write_wiki(tmp_path)
    common = [*COMMON, f"data.root={tmp_path}"]
    i, j, k = layout.split(",")
    shown = backend == "depcache"  # (one case shows rank 0's progress lines)
    para = [*common, f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}", f"memory.backend={backend}",
            f"train.progress={str(shown).lower()}"]
    r = torchrun(2, "-m", "tgdist.train", *para, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    done = json.loads(r.stdout.strip().splitlines()[-1])
    for part in ("val", "test"):  # the evaluation after training prints its progress as one process's does
        assert (re.search(rf"^  {part}: ([\d,]+)/\1 events \(100.0%\)", r.stderr, re.M) is not None) == shown, r.stderr
    assert done["parallel"] == f"{i} x {j} x {k}" and done["memory_backend"] == backend and done["replicas_identical"]
    assert 0 < done["test_mrr"] <= 1 and 0 < done["val_mrr"] <= 1
    tr = build_trainer(compose([*common, "train.progress=false"]))
    load_whole(tmp_path / "run" / "checkpoints" / "last.pt", tr)
    alone = {**tr.evaluate("val"), **tr.evaluate("test")}
    for key in ("val_mrr", "test_mrr", "val_hits@10", "test_hits@10"):
        assert done[key] == pytest.approx(alone[key], rel=1e-12, abs=0), key
