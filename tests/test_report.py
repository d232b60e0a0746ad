"""``tgdist report``: the tables hold the summaries' numbers, the plots are written, bad paths fail
in one line. Run and sweep directories are built by hand, with the files a run writes."""

from __future__ import annotations

import csv
import json

import pytest

from tgdist.cli import main as cli_main

pytest.importorskip("matplotlib", reason="tgdist report draws with matplotlib (the plot extra)")

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(path, layout=(1, 1, 1), overrides=(), summary=True, rate=1000.0, test_ap=0.75, comm=None, epochs=2,
             batch=100):
    """A run directory as tgdist train writes it (a parallel run's metrics have no stage_seconds);
    ``batch`` is train.batch_size, per trainer."""
    i, j, k = layout
    path.mkdir(parents=True)
    (path / ".tgdist-run").write_text("{}")
    (path / ".hydra").mkdir()
    (path / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in [f"parallel.i={i}", f"parallel.k={k}", *overrides, f"run_dir={path}"]))
    (path / "config.yaml").write_text(f"parallel:\n  i: {i}\n  j: {j}\n  k: {k}\ntrain:\n  lr: {1e-4 * i}\n"
                                      f"  batch_size: {batch}\n")
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
             "memory_backend": "local" if i * j == 1 else "depcache", "epochs": epochs, "batch_size": batch,
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
    assert header == ["#", "settings", "layout", "global batch", "processes", "memory backend", "epochs", "test AP",
                      "val AP", "events/s", "speed-up", "over", "ideal", "wall s", "bytes sent"]
    summaries = {n: json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(3)}
    base = summaries[0]["train_events_per_s"]
    # batch size 100 per trainer: 2 x 1 x 1 trains a global batch of 200, which no 1 x 1 x 1 point has
    speedup = {0: f"{1.0:.2f}", 1: "-", 2: f"{summaries[2]['train_events_per_s'] / base:.2f}"}
    for n, s in summaries.items():
        row = dict(zip(header, rows[n]))
        sent = sum(c["bytes_sent"] for c in s["communication"].values())
        assert row == {"#": str(n), "settings": "memory.backend=auto", "layout": s["parallel"],
                       "global batch": {0: "100", 1: "200", 2: "100"}[n],
                       "processes": str({0: 1, 1: 2, 2: 2}[n]), "memory backend": s["memory_backend"],
                       "epochs": "2", "test AP": f"{s['test_ap']:.4f}", "val AP": f"{s['val_ap']:.4f}",
                       "events/s": f"{s['train_events_per_s']:,.0f}", "speed-up": speedup[n],
                       "over": "-" if n == 1 else "#0", "ideal": row["processes"],
                       "wall s": "12.34", "bytes sent": f"{sent:,}"}
    assert rows[3][:4] == ["3", "memory.backend=daemon", "2 x 1 x 1", "200"] and rows[3][7:12] == ["-"] * 5
    assert "Without a summary (failed, stopped or still running): `#3 2x1x1 backend=daemon`." in text
    with open(sweep / "report" / "points.csv") as f:
        exact = list(csv.DictReader(f))
    for n, s in summaries.items():
        assert float(exact[n]["test AP"]) == s["test_ap"] and float(exact[n]["events/s"]) == s["train_events_per_s"]
    assert [float(exact[n]["speed-up"]) for n in (0, 2)] == [1.0, summaries[2]["train_events_per_s"] / base]
    assert exact[1]["speed-up"] == "" and exact[1]["global batch"] == "200"
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
    assert [r[:5] for r in rows] == [["0", "model=tgn", "1 x 1 x 1", "100", "1"],
                                     ["1", "model=jodie", "2 x 1 x 1", "-", "2"]]  # its batch size is not known
    assert rows[1][7:12] == ["-"] * 5 and "Without a summary (failed, stopped or still running): `#1 2x1x1 model=jodie`" in text


@pytest.fixture
def drawn(monkeypatch):
    """The figures tgdist report saves, by file name (still inspectable after they are closed)."""
    from tgdist.cli import report

    figures, save = {}, report._save

    def keep(plt, fig, path):
        fig.canvas.draw()  # ticks and labels as they are in the PNG
        figures[path.name] = fig
        save(plt, fig, path)

    monkeypatch.setattr(report, "_save", keep)
    return figures


def test_compile_time_is_its_own_part_of_the_stages(tmp_path, drawn):
    """Epoch 0's stage seconds hold numba's compiling, nearly all in compute: stages.png draws it
    apart, taken from each stage in proportion to its time over an epoch that compiled nothing."""
    from tgdist.cli import report
    from tgdist.runtime import results

    run = make_run(tmp_path / "run", epochs=3)
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    # over the smallest of the epochs that compiled nothing (compute 2.0 s, sample 0.1 s): 2.7 s and 0.6 s
    lines[0]["stage_seconds"].update(compute=4.7, sample=0.7)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    series = dict(report.stage_series(results.read_run(run)))
    assert series[0][report.COMPILE] == 3.0 and series[1][report.COMPILE] == series[2][report.COMPILE] == 0.0
    assert series[0]["compute"] == pytest.approx(4.7 - 3.0 * 2.7 / 3.3)
    assert series[0]["sample"] == pytest.approx(0.7 - 3.0 * 0.6 / 3.3)
    assert series[0]["features"] == 0.2 and series[1]["compute"] == 2.0  # no excess, no compiling
    for e, raw in results.stage_seconds(results.read_run(run)):
        assert sum(series[e].values()) == pytest.approx(sum(raw.values()))
    assert cli_main(["report", str(run)]) == 0
    ax = drawn["stages.png"].axes[0]
    parts = {c.get_label(): [b.get_height() for b in c] for c in ax.containers}
    assert parts[report.COMPILE] == pytest.approx([3.0, 0.0, 0.0])
    assert parts["compute"] == pytest.approx([series[e]["compute"] for e in range(3)])
    assert report.COMPILE in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "numba's compile time (compile s) is inside the stage seconds" in (run / "report.md").read_text()


def test_compiling_more_than_the_stages_grew_comes_out_of_all_of_them(tmp_path):
    """A run of one epoch has no epoch without compiling: the compile seconds come out of every
    stage in proportion to its seconds, never below 0, and never more than the stages took."""
    from tgdist.cli import report
    from tgdist.runtime import results

    run = make_run(tmp_path / "run", epochs=1)
    (_, secs), = report.stage_series(results.read_run(run))
    total = 0.1 + 0.2 + 0.05 + 1.0 + 0.03
    assert secs[report.COMPILE] == pytest.approx(min(3.0, total)) and all(v >= 0 for v in secs.values())
    assert sum(secs.values()) == pytest.approx(total)


def test_a_sweep_of_one_epoch_runs_draws_points_over_whole_epochs(tmp_path, drawn):
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", (1, 1, 1), ["model=tgn"], epochs=1)
    make_run(sweep / "1", (1, 1, 1), ["model=jodie"], epochs=1)
    assert cli_main(["report", str(sweep)]) == 0
    for ax in drawn["curves.png"].axes:
        lo, hi = ax.get_xlim()
        assert hi - lo >= 1 and lo < 0 < hi
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks == [0]
        assert all(line.get_marker() == "o" for line in ax.get_lines())


def test_test_ap_bars_start_at_0_with_their_values(tmp_path, drawn):
    sweep = tmp_path / "sweep"
    for n, ap in enumerate([0.81, 0.79, 0.77]):
        make_run(sweep / str(n), (n + 1, 1, 1), test_ap=ap)
    assert cli_main(["report", str(sweep)]) == 0
    ax = drawn["test_ap.png"].axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1
    assert [b.get_y() for b in ax.containers[0]] == [0, 0, 0]
    assert [t.get_text() for t in ax.texts] == ["0.8100", "0.7900", "0.7700"]


@pytest.mark.parametrize("sent, unit", [(390_000_000, "MB"), (2_500_000_000, "GB"), (185_088, "kB"), (512, "bytes")])
def test_communication_is_drawn_in_a_unit_the_label_names(tmp_path, drawn, sent, unit):
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", (1, 1, 1))
    make_run(sweep / "1", (2, 1, 1), comm={"gradients": {"calls": 6, "bytes_sent": sent - sent // 3},
                                           "aggregation.payload": {"calls": 6, "bytes_sent": sent // 3}})
    assert cli_main(["report", str(sweep)]) == 0
    ax = drawn["communication.png"].axes[0]
    assert ax.get_ylabel() == f"{unit} sent by rank 0"
    assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e8" in the corner
    scale = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    top = sum(b.get_height() for c in ax.containers for b in c)
    assert top == pytest.approx(sent / scale) and 1 <= top < 1000


# ------------------------------------------------------------------ the plots answer their question


def _sweep(root, points):
    """A sweep of hand-built runs: (layout, batch size per trainer, events/s, extra overrides)."""
    for n, (layout, batch, rate, extra) in enumerate(points):
        make_run(root / str(n), layout, [f"train.batch_size={batch}", *extra], rate=rate, batch=batch)
    return root


def _speedup_panel(fig):
    ups = [ax for ax in fig.axes if ax.get_title().startswith("speed-up")]
    return ups[0] if ups else None


def test_speed_up_compares_equal_global_batches_only(tmp_path, drawn):
    """train.batch_size is per trainer: 2 x 1 x 1 at batch 100 trains a global batch of 200, so its
    speed-up is over the 1 x 1 x 1 point of batch 200, never over the one of batch 100."""
    from tgdist.cli import report
    from tgdist.runtime import results

    sweep = _sweep(tmp_path / "sweep", [((1, 1, 1), 100, 1000.0, []), ((1, 1, 1), 200, 1500.0, []),
                                        ((2, 1, 1), 100, 2100.0, []), ((2, 1, 1), 200, 3000.0, [])])
    points = results.sweep_points(results.read_sweep(sweep))
    assert [p.global_batch for p in points] == [100, 200, 200, 400]
    assert [(p.speedup, p.baseline) for p in points] == [(1.0, 0), (1.0, 1), ((2100.5) / 1500.5, 1), (None, None)]
    series = report.scaling_series(points)
    assert [(s.name, [p.num for p in s.points]) for s in series] == [
        ("global batch 100", [0]), ("global batch 200", [1, 2]), ("global batch 400", [3])]
    assert cli_main(["report", str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    assert "`train.batch_size` is per trainer: a point's global batch is i x batch_size events" in text
    assert "the same global batch and the same other settings" in text
    assert ("Without a 1 x 1 x 1 point of the same global batch, so on the throughput panel only: "
            "`#3 2x1x1 batch_size=200` (global batch 400; a 1 x 1 x 1 point with `train.batch_size=400` would "
            "be its baseline).") in text
    fig = drawn["scaling.png"]
    up = _speedup_panel(fig)
    drawn_up = sorted((x, y) for line in up.get_lines() if line.get_label() != "ideal"
                      for x, y in zip(line.get_xdata(), line.get_ydata()))
    assert drawn_up == [(1, 1.0), (2, pytest.approx(2100.5 / 1500.5))]  # no lone baseline, no point #3
    rate = fig.axes[0]
    assert sorted(t.get_text() for t in rate.texts) == ["1x1x1, 100", "1x1x1, 200", "2x1x1, 200", "2x1x1, 400"]
    assert [t.get_text() for t in rate.get_legend().get_texts()] == [s.name for s in series]


def test_a_sweep_over_i_at_one_batch_size_draws_no_speed_up(tmp_path, drawn):
    """The issue's case: parallel.i=1,2 at one batch size drew a speed-up of 2.10 "above ideal"."""
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", (1, 1, 1), rate=1000.0)
    make_run(sweep / "1", (2, 1, 1), rate=2100.0)
    assert cli_main(["report", str(sweep)]) == 0
    fig = drawn["scaling.png"]
    assert len(fig.axes) == 1 and _speedup_panel(fig) is None
    assert "no speed-up" in " ".join(t.get_text() for t in fig.axes[0].texts)
    rows = md_table((sweep / "report.md").read_text())
    assert [r[3] for r in rows[1:]] == ["100", "200"] and [r[10] for r in rows[1:]] == ["1.00", "-"]


@pytest.mark.parametrize("layouts", [[(1, 1, 1), (1, 1, 1)], [(2, 1, 1), (1, 1, 2)]])
def test_no_scaling_plot_without_a_parallel_axis(tmp_path, drawn, layouts):
    from tgdist.cli import report
    from tgdist.runtime import results

    sweep = tmp_path / "sweep"
    for n, (layout, model) in enumerate(zip(layouts, ["tgn", "jodie"])):
        make_run(sweep / str(n), layout, [f"model={model}"])
    assert report.scaling_series(results.sweep_points(results.read_sweep(sweep))) is None
    assert cli_main(["report", str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    procs = layouts[0][0] * layouts[0][2]
    assert f"No scaling.png: every point with a throughput ran on {procs} process(es)" in text
    assert "scaling.png" not in drawn and not (sweep / "report" / "scaling.png").exists()
    assert "](report/scaling.png)" not in text and "](report/curves.png)" in text


def test_scaling_axes_start_at_0(tmp_path, drawn):
    """A ratio is read off both panels (twice the events/s, twice the processes): no axis is cut."""
    sweep = _sweep(tmp_path / "sweep", [((1, 1, 1), 200, 3000.0, []), ((2, 1, 1), 100, 3400.0, []),
                                        ((1, 1, 2), 200, 3500.0, [])])
    assert cli_main(["report", str(sweep)]) == 0
    fig = drawn["scaling.png"]
    assert len(fig.axes) == 2
    for ax in fig.axes:
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        xs = [x for line in ax.get_lines() for x in line.get_xdata()]
        assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
        assert ax.get_ylim()[1] > max(ys) and ax.get_xlim()[1] > max(xs)


def test_one_colour_per_run_in_both_curve_panels(tmp_path, drawn):
    """Each run is one colour in the loss panel and in the AP panel (val and test alike, told apart
    by open and filled markers), and no two runs share one."""
    from matplotlib.colors import to_rgba

    sweep = tmp_path / "sweep"
    for n in range(3):
        make_run(sweep / str(n), (n + 1, 1, 1))
    make_run(sweep / "3", (2, 1, 1), epochs=1)  # a parallel run: one metrics line, lone markers
    assert cli_main(["report", str(sweep)]) == 0
    loss, ap = drawn["curves.png"].axes
    colour = {line.get_label(): to_rgba(line.get_color()) for line in loss.get_lines()}
    assert len(colour) == 4 and len(set(colour.values())) == 4
    for line in ap.get_lines():
        run, kind = line.get_label().rsplit(" ", 1)
        assert to_rgba(line.get_color()) == colour[run]
        face = to_rgba(line.get_markerfacecolor())
        assert face == (to_rgba("white") if kind == "val" else colour[run])
    assert len(ap.get_lines()) == 8


def test_run_colours_stay_distinct_past_ten():
    from tgdist.cli.report import run_colours

    for n in (1, 10, 11, 20, 25):
        colours = run_colours([f"run {x}" for x in range(n)])
        assert len(colours) == n and len(set(colours.values())) == n
