"""``tgdist report``: the tables hold the summaries' numbers, the plots are written, bad paths fail
in one line. Run and sweep directories are built by hand, with the files a run writes."""

from __future__ import annotations

import csv
import json

import pytest

from tgdist.cli import main as cli_main

pytest.importorskip("matplotlib", reason="tgdist report draws with matplotlib (the plot extra)")

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(path, layout=(1, 1, 1), overrides=(), summary=True, rate=1000.0, test_ap=0.75, comm=None, epochs=2):
    """A run directory as tgdist train writes it (a parallel run's metrics have no stage_seconds)."""
    i, j, k = layout
    path.mkdir(parents=True)
    (path / ".tgdist-run").write_text("{}")
    (path / ".hydra").mkdir()
    (path / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in [f"parallel.i={i}", f"parallel.k={k}", *overrides, f"run_dir={path}"]))
    (path / "config.yaml").write_text(f"parallel:\n  i: {i}\n  j: {j}\n  k: {k}\ntrain:\n  lr: {1e-4 * i}\n")
    lines = []
    for e in range(epochs):
        line = {"epoch": e, "loss": 1.5 - 0.1 * e, "train_events": 1000, "events_per_s": rate + e,
                "val_ap": 0.6 + 0.05 * e, "test_ap": test_ap - 0.01 * (epochs - 1 - e)}
        if layout == (1, 1, 1):
            line["compile_seconds"] = 3.0 if e == 0 else 0.0
            line["stage_seconds"] = {"sample": 0.1, "features": 0.2, "memory_read": 0.05, "compute": 1.0 + e,
                                     "memory_write": 0.03}
        lines.append(json.dumps(line))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        s = {"run_dir": str(path), "data": "collegemsg", "model": "tgn", "parallel": f"{i} x {j} x {k}",
             "memory_backend": "local" if i * j == 1 else "depcache", "epochs": epochs, "batch_size": 100,
             "loss": 1.5 - 0.1 * (epochs - 1), "val_ap": 0.6 + 0.05 * (epochs - 1), "test_ap": test_ap,
             "train_events_per_s": rate + 0.5, "traversed_events": 1000 * epochs, "communication": comm or {},
             "wall_seconds": 12.34}
        (path / "summary.json").write_text(json.dumps(s))
    return path


def md_table(text: str) -> list[list[str]]:
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in rows]


def test_sweep_report_holds_the_summaries_numbers(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    comm = {"gradients": {"calls": 6, "bytes_sent": 123312, "bytes_received": 123312},
            "aggregation.payload": {"calls": 6, "bytes_sent": 61776, "bytes_received": 56160}}
    make_run(sweep / "0", (1, 1, 1), ["memory.backend=auto"], rate=1000.0, test_ap=0.71)
    make_run(sweep / "1", (2, 1, 1), ["memory.backend=auto"], rate=1700.0, test_ap=0.7234567, comm=comm)
    make_run(sweep / "2", (1, 1, 2), ["memory.backend=auto"], rate=1900.0, test_ap=0.69, comm={
        "gradients": {"calls": 6, "bytes_sent": 1000, "bytes_received": 1000}})
    make_run(sweep / "3", (2, 1, 1), ["memory.backend=daemon"], rate=1500.0, summary=False)  # failed
    (sweep / ".submitit").mkdir()  # not a point
    assert cli_main(["report", str(sweep)]) == 0
    assert capsys.readouterr().out.strip() == str(sweep / "report.md")
    text = (sweep / "report.md").read_text()
    header, *rows = md_table(text)
    assert header == ["#", "settings", "layout", "processes", "memory backend", "epochs", "test AP", "val AP",
                      "events/s", "speed-up", "ideal", "wall s", "bytes sent"]
    summaries = {n: json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(3)}
    base = summaries[0]["train_events_per_s"]
    for n, s in summaries.items():
        row = dict(zip(header, rows[n]))
        sent = sum(c["bytes_sent"] for c in s["communication"].values())
        assert row == {"#": str(n), "settings": "memory.backend=auto", "layout": s["parallel"],
                       "processes": str({0: 1, 1: 2, 2: 2}[n]), "memory backend": s["memory_backend"],
                       "epochs": "2", "test AP": f"{s['test_ap']:.4f}", "val AP": f"{s['val_ap']:.4f}",
                       "events/s": f"{s['train_events_per_s']:,.0f}",
                       "speed-up": f"{s['train_events_per_s'] / base:.2f}", "ideal": row["processes"],
                       "wall s": "12.34", "bytes sent": f"{sent:,}"}
    assert rows[3][:3] == ["3", "memory.backend=daemon", "2 x 1 x 1"] and rows[3][6:10] == ["-"] * 4
    assert "Without a summary (failed, stopped or still running): `#3 2x1x1 backend=daemon`." in text
    with open(sweep / "report" / "points.csv") as f:
        exact = list(csv.DictReader(f))
    for n, s in summaries.items():
        assert float(exact[n]["test AP"]) == s["test_ap"] and float(exact[n]["events/s"]) == s["train_events_per_s"]
        assert float(exact[n]["speed-up"]) == s["train_events_per_s"] / base
    assert exact[3]["test AP"] == "" and exact[3]["speed-up"] == ""
    for name in ("scaling.png", "test_ap.png", "communication.png", "curves.png"):
        assert (sweep / "report" / name).read_bytes()[:8] == PNG and f"](report/{name})" in text


def test_run_report_has_curves_and_the_stage_breakdown(tmp_path):
    run = make_run(tmp_path / "run", epochs=3)
    out = tmp_path / "elsewhere"
    assert cli_main(["report", str(run), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert not (run / "report.md").exists()
    per_epoch = [r for r in md_table(text) if r[0].isdigit()]
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r[:5] for r in per_epoch] == [[str(m["epoch"]), f"{m['loss']:.4f}", f"{m['val_ap']:.4f}",
                                           f"{m['test_ap']:.4f}", f"{m['events_per_s']:,.0f}"] for m in metrics]
    assert per_epoch[2][9] == f"{metrics[2]['stage_seconds']['compute']:.3f}"
    assert "| test AP | 0.7500 |" in text
    for name in ("curves.png", "stages.png"):
        assert (out / "report" / name).read_bytes()[:8] == PNG


@pytest.mark.parametrize("case", ["missing", "empty", "bad metrics"])
def test_a_path_that_is_no_run_fails_in_one_line(tmp_path, capsys, case):
    path = tmp_path / "x"
    if case != "missing":
        path.mkdir()
    if case == "bad metrics":
        (path / "metrics.jsonl").write_text('{"epoch": 0}\nnot json\n')
    assert cli_main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("tgdist report: error: "), err
    assert {"missing": "no such directory", "empty": "neither a run directory",
            "bad metrics": "metrics.jsonl: line 2 is not JSON"}[case] in err
    assert not (tmp_path / "x" / "report.md").exists() and not (tmp_path / "x" / "report").exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    (tmp_path / "file").write_text("")
    assert cli_main(["report", str(run), "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tgdist report: error: ") and "cannot write the report" in err and err.count("\n") == 1


def test_a_sweep_record_names_the_points_that_left_no_directory(tmp_path):
    """tgdist launch lists a sweep's jobs in sweep.json; a run that fails removes its own directory."""
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", (1, 1, 1), ["model=tgn"])
    (sweep / "sweep.json").write_text(json.dumps({"points": [
        {"num": n, "swept": f"parallel.i={i} model={m}", "layout": [i, 1, 1],
         "overrides": [f"parallel.i={i}", "parallel.k=1", f"model={m}", f"run_dir={sweep}/{n}"]}
        for n, (i, m) in enumerate([(1, "tgn"), (2, "jodie")])]}))
    assert cli_main(["report", str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    rows = md_table(text)[1:]
    assert [r[:4] for r in rows] == [["0", "model=tgn", "1 x 1 x 1", "1"], ["1", "model=jodie", "2 x 1 x 1", "2"]]
    assert rows[1][6:10] == ["-"] * 4 and "Without a summary (failed, stopped or still running): `#1 2x1x1 model=jodie`" in text
