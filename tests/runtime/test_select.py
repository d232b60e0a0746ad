"""Model selection (train.select, best.pt, train.patience) and evaluation during training
(train.eval_every, train.val_mrr, train.test_every_epoch): what a run reports is what its selected
epoch's model and memory give, as a run stopped there would, across resumes."""


import pytest
import torch

from tgdist.errors import ConfigError
from tgdist.runtime import checkpoint
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.run import Run

from tests.runtime import runs
from tests.runtime.runs import lines

SMALL = [*runs.SMALL, "train.lr=0.003"]
# The validation AP these tests see, by epoch: it peaks at epoch 1, then falls. Scripted, because
# the real curve of a small run is a trajectory that floating-point order changes (another CPU's
# kernels peaked at epoch 0); every other metric is the run's own.
VAL_AP = [0.80, 0.90, 0.85, 0.84, 0.83]


@pytest.fixture(autouse=True)
def scripted_val_ap(monkeypatch):
    """``val_ap`` of an epoch's validation is ``VAL_AP[epoch]``, whatever the model scored."""
    from tgdist.runtime.trainer import Trainer

    epoch = []
    end_epoch, evaluate = Run._end_epoch, Trainer.evaluate

    def in_epoch(self, ep, next_iteration):
        epoch.append(ep.index)
        try:
            return end_epoch(self, ep, next_iteration)
        finally:
            epoch.pop()

    def scripted(self, part, *a, **k):
        res = evaluate(self, part, *a, **k)
        if part == "val" and epoch:
            res["val_ap"] = VAL_AP[epoch[-1]]
        return res

    monkeypatch.setattr(Run, "_end_epoch", in_epoch)
    monkeypatch.setattr(Trainer, "evaluate", scripted)


def run(tmp_path, name, extra=()):
    return runs.run(tmp_path, name, extra, base=SMALL)



def final_test(summary_or_line):
    return {k: v for k, v in summary_or_line.items() if k.startswith("test_") and k != "test_ap_at_best_val"}


def test_best_val_reports_what_a_run_stopped_at_its_best_epoch_reports(tmp_path):
    cfg = compose(SMALL + ["train.epochs=3", f"run_dir={tmp_path / 'best'}"])
    r = Run(cfg, tmp_path / "best")
    best, d = r.train(), tmp_path / "best"
    # the run ends holding the selected epoch's model: the node and edge tasks embed with it
    kept = checkpoint.read(d / "checkpoints" / "best.pt")["model"]
    assert all(torch.equal(v, kept[k]) for k, v in r.trainer.model.state_dict().items())
    assert best["best_epoch"] == best["selected_epoch"] == 1 and best["select"] == "best_val"
    assert best["checkpoint"] == str(d / "checkpoints" / "best.pt")
    stopped, _ = run(tmp_path, "stopped", ["train.epochs=2", "train.select=last"])
    assert stopped["selected_epoch"] == 1 and len(final_test(best)) == 4  # ap, auc, mrr, inductive ap
    assert final_test(best) == final_test(stopped) and best["val_ap"] == stopped["val_ap"] == best["best_val_ap"]
    assert best["test_ap_at_best_val"] == best["test_ap"]
    last, _ = run(tmp_path, "last", ["train.epochs=3", "train.select=last"])
    assert last["selected_epoch"] == 2 and last["test_ap"] != best["test_ap"]
    assert last["test_ap_at_best_val"] is None  # its best epoch was not tested
    # only the selected epoch's line holds the complete test; every line holds training's numbers
    ln = lines(d)
    assert [h["epoch"] for h in ln] == [0, 1, 2] and [bool(h.get("selected")) for h in ln] == [False, True, False]
    assert final_test(ln[1]) == final_test(best) and "test_ap" not in ln[0] and "val_mrr" not in ln[1]
    # the checkpoints hold their epoch's model and the memory after validation: testing from them
    # gives the runs' test metrics
    for path, summary in ((d / "checkpoints" / "best.pt", best), (d / "checkpoints" / "last.pt", last)):
        tr = build_trainer(compose(SMALL + ["train.epochs=3"]))
        checkpoint.load(path, tr, compose(SMALL + ["train.epochs=3"]))
        assert final_test(tr.evaluate("test")) == final_test(summary)


def test_patience_stops_early_and_resumes_exactly(tmp_path):
    full, _ = run(tmp_path, "full", ["train.epochs=5"])
    stopped, d = run(tmp_path, "p2", ["train.epochs=5", "train.patience=2"])
    assert stopped["stopped_early"] and stopped["epochs"] == 4 and not full["stopped_early"]
    assert [h["epoch"] for h in lines(d)] == [0, 1, 2, 3]  # 2 and 3 below epoch 1's val AP
    assert final_test(stopped) == final_test(full) and stopped["selected_epoch"] == full["selected_epoch"] == 1
    # stopped mid-way by a crash (checkpoints every 4 batches; 11 per epoch), resumed: the same end
    part, dp = run(tmp_path, "part", ["train.epochs=5", "train.patience=2", "train.checkpoint_every=4",
                                      "train.stop_after_batches=30"])
    assert part["stopped"]
    resumed, dr = run(tmp_path, "resumed", ["train.epochs=5", "train.patience=2", f"train.resume={dp}"])
    assert {k: v for k, v in resumed.items() if k not in ("run_dir", "checkpoint", "train_events_per_s",
                                                          "train_seconds", "train_cpu_seconds", "eval_seconds")} == \
        {k: v for k, v in stopped.items() if k not in ("run_dir", "checkpoint", "train_events_per_s",
                                                       "train_seconds", "train_cpu_seconds", "eval_seconds")}
    assert resumed["checkpoint"] == str(dr / "checkpoints" / "best.pt")
    # the stopped run resumed: nothing to train, the same test; with more patience it trains on to
    # what the run without patience gives
    again, _ = run(tmp_path, "again", ["train.epochs=5", "train.patience=2", f"train.resume={d}"])
    assert final_test(again) == final_test(stopped) and again["epochs"] == 4
    on, _ = run(tmp_path, "on", ["train.epochs=5", "train.patience=0", f"train.resume={d}"])  # (else the run's 2)
    assert final_test(on) == final_test(full) and on["epochs"] == 5 and not on["stopped_early"]


def test_validating_every_other_epoch_and_testing_every_epoch(tmp_path):
    s, d = run(tmp_path, "a", ["train.epochs=3", "train.eval_every=2", "train.test_every_epoch=true",
                               "train.val_mrr=true"])
    ln = lines(d)
    assert ["val_ap" in h for h in ln] == [False, True, True]  # epoch 1, and the last
    assert "val_mrr" in ln[1] and "test_mrr" in ln[1] and s["selected_epoch"] == 1
    # testing along the way leaves the memory where validation left it: the same final test
    plain, _ = run(tmp_path, "b", ["train.epochs=3"])
    assert final_test(s) == final_test(plain) and s["test_ap_at_best_val"] == plain["test_ap"]
    assert s["val_mrr"] is not None and "val_mrr" not in plain
    # a per-epoch test against one negative gives the AP and ROC-AUC of one against 49 (run a)
    cheap, dc = run(tmp_path, "c", ["train.epochs=3", "train.test_every_epoch=true"])
    assert "test_mrr" not in lines(dc)[2] and final_test(cheap) == final_test(plain)
    assert lines(dc)[2]["test_ap"] == ln[2]["test_ap"] and lines(dc)[2]["test_auc"] == ln[2]["test_auc"]


def test_best_pt_is_not_a_place_to_resume_from(tmp_path):
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    cfg = compose(SMALL + ["train.epochs=2", f"train.resume={d / 'checkpoints' / 'best.pt'}"])
    with pytest.raises(ConfigError, match=r"best.pt: the best validated epoch's model and memory, to use "
                                          r"\(checkpoint.load\), not to resume from; resume with the run directory"):
        checkpoint.check_resume(cfg)


@pytest.mark.parametrize("override, message", [
    ("train.patience=-1", "train.patience=-1: must be at least 0"),
    ("train.eval_every=0", "train.eval_every=0: must be at least 1"),
    ("train.select=best", "train.select"),
])
def test_selection_settings_are_checked(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, "x", ["train.epochs=1", override])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("override", ["train.patience=2", "train.eval_every=2"])
def test_a_parallel_run_refuses_what_it_cannot_do(override):
    from tgdist.runtime.build import validate

    with pytest.raises(ConfigError, match=f"{override}: a parallel run validates once, at its end"):
        validate(compose(SMALL + ["train.epochs=2", "parallel.i=2", override]))
