"""``tgdist report PATH``: ``report.md`` and PNG plots for a run directory or a sweep directory.

    tgdist report runs/20261126-101500-collegemsg-tgn     # one run
    tgdist report multirun/20261126-101500                # a sweep (tgdist launch -- -m, tgdist train -m)

A run: loss and val/test AP per epoch, the seconds of each training stage per epoch (runs of one
process record them), the summary's numbers and its communication per phase. A sweep: a table of
every point (its numbers are the summaries', also written with full precision to
``report/points.csv``), events/s against processes with each point's global batch, speed-up only
between points of equal global batch (``train.batch_size`` is per trainer, so a point's global batch
is ``i * batch_size``; see ``tgdist.runtime.results``), test AP per point, communication bytes per
phase, and the curves of every point, one colour per point in both panels. A sweep whose points all
ran on the same number of processes has no scaling plot. The plots go to ``PATH/report/``
(``--out DIR`` writes ``DIR/report.md`` and ``DIR/report/`` instead). matplotlib draws them (the
``plot`` extra), without a display.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tgdist.errors import ConfigError
from tgdist.runtime import results
from tgdist.runtime.results import Point, Run

__all__ = ["POINT_COLUMNS", "byte_unit", "main", "run_colours", "scaling_notes", "scaling_series", "stage_series",
           "write_report"]

# the sweep table's columns: (header, how the cell is read from a point)
POINT_COLUMNS = ("#", "settings", "layout", "global batch", "processes", "memory backend", "epochs", "test AP",
                 "val AP", "events/s", "speed-up", "over", "ideal", "wall s", "bytes sent")


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def point_row(p: Point) -> dict:
    """The sweep table's row of point ``p``, exact (for points.csv) before formatting."""
    s = p.run.summary or {}
    i, j, k = p.run.layout
    return {"#": p.num, "settings": " ".join(f"{key}={value}" for key, value in p.settings.items()),
            "layout": f"{i} x {j} x {k}", "global batch": p.global_batch, "processes": p.run.processes,
            "memory backend": s.get("memory_backend"), "epochs": s.get("epochs"), "test AP": s.get("test_ap"),
            "val AP": s.get("val_ap"), "events/s": s.get("train_events_per_s"), "speed-up": p.speedup,
            "over": None if p.baseline is None else f"#{p.baseline}", "ideal": p.run.processes,
            "wall s": s.get("wall_seconds"),
            "bytes sent": sum(results.communication_bytes(p.run).values()) if p.run.summary else None}


_CELL = {"global batch": ",", "test AP": ".4f", "val AP": ".4f", "events/s": ",.0f", "speed-up": ".2f",
         "wall s": ".2f", "bytes sent": ","}


def format_row(row: dict) -> list[str]:
    return [_fmt(row[c], _CELL[c]) if c in _CELL else ("-" if row[c] is None else str(row[c])) for c in POINT_COLUMNS]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("tgdist report draws with matplotlib: pip install 'tgdist[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def run_colours(labels: list[str]) -> dict[str, tuple]:
    """One colour (RGBA) per label, distinct for up to 20 labels (tab10, then tab20, then spread
    over viridis), so a run, or a series, has the same colour in every panel of a figure."""
    from matplotlib import colormaps

    labels = list(dict.fromkeys(labels))
    n = len(labels)
    if n <= 10:
        colours = [colormaps["tab10"](x) for x in range(n)]
    elif n <= 20:
        colours = [colormaps["tab20"](x) for x in range(n)]
    else:
        colours = [colormaps["viridis"](x / (n - 1)) for x in range(n)]
    return dict(zip(labels, colours))


def _curves(plt, runs: list[tuple[str, Run]], path: Path) -> bool:
    """Loss, and val (dashed, open markers) / test (solid, filled) AP, per epoch: one colour per
    run in both panels (a parallel run's one metrics line is a lone marker, so the markers, not only
    the line styles, tell val from test)."""
    runs = [(label, r) for label, r in runs if any(m.get("epoch", -1) >= 0 for m in r.metrics)]
    if not runs:
        return False
    colour = run_colours([label for label, _ in runs])
    fig, (ax_loss, ax_ap) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in runs:
        lines = sorted((m for m in run.metrics if m.get("epoch", -1) >= 0), key=lambda m: m["epoch"])
        epochs = [m["epoch"] for m in lines]
        ax_loss.plot(epochs, [m.get("loss") for m in lines], marker="o", color=colour[label], label=label)
        for key, style, face in (("val_ap", "--", "white"), ("test_ap", "-", colour[label])):
            ax_ap.plot(epochs, [m.get(key) for m in lines], style, marker="o", color=colour[label],
                       markerfacecolor=face, label=f"{label} {key[:-3]}" if label else key[:-3])
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax_ap.set(xlabel="epoch", ylabel="AP", title="validation and test AP")
    epochs = [m["epoch"] for _, r in runs for m in r.metrics if m.get("epoch", -1) >= 0]
    lo, hi = min(epochs), max(epochs)
    if hi - lo < 1:  # runs of one epoch: matplotlib would spread a single x over -0.04 .. 0.04
        for ax in (ax_loss, ax_ap):
            ax.set_xlim(lo - 0.5, hi + 0.5)
    _finish_pair(plt, fig, ax_loss, ax_ap, len(runs) > 1, path)
    return True


def _finish_pair(plt, fig, left, right, left_legend: bool, path: Path) -> None:
    """Two panels (or one: ``right`` None) over integer x: grids, the right one's legend (the left
    one's too when it has several series, or when it is alone), saved to ``path``."""
    if right is None:
        right, left, left_legend = left, None, False
    for ax in (left, right):
        if ax is None:
            continue
        ax.grid(alpha=0.3)
        # one tick is enough: an axis one epoch wide would otherwise get fractional epochs
        ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)
    right.legend(fontsize="small")
    if left is not None and left_legend:
        left.legend(fontsize="small")
    _save(plt, fig, path)


COMPILE = "numba compile"  # the stages plot's segment of kernel compilation


def stage_series(run: Run) -> list[tuple[int, dict[str, float]]]:
    """(epoch, seconds) of every epoch with stage times: the stages without numba's compile time,
    which is a part of its own (``COMPILE``); an epoch's parts add up to its recorded stage seconds.

    A kernel compiles inside the stage that first calls it (attention, time encoding and GRU in
    ``compute``, the sampler in ``sample``, organise in ``features``), and only the epoch's total
    (``compile_seconds``) is recorded. So it comes out of each stage in proportion to what the
    stage took over its time in an epoch that compiled nothing (over 0 when every epoch compiled):
    on a fresh install compiling is nearly all of epoch 0 (44 of 45 s on CollegeMsg), and compute
    is left with about its later epochs' time, not with the compiles in it.
    """
    rows = results.stage_seconds(run)
    compiled = {int(m["epoch"]): max(float(m.get("compile_seconds") or 0.0), 0.0) for m in run.metrics
                if isinstance(m.get("stage_seconds"), dict)}
    plain = [secs for e, secs in rows if not compiled.get(e)]
    out = []
    for epoch, secs in rows:
        total = sum(secs.values())
        c = min(compiled.get(epoch, 0.0), total)  # compiles outside the timed stages are not drawn
        excess = {k: max(v - min((q[k] for q in plain), default=0.0), 0.0) for k, v in secs.items()}
        over = sum(excess.values())
        if c <= over:
            taken = {k: c * x / over if over else 0.0 for k, x in excess.items()}
        else:  # more compiling than the excess: the rest in proportion to the remaining seconds
            rest = {k: secs[k] - excess[k] for k in secs}
            taken = {k: excess[k] + (c - over) * rest[k] / (total - over) for k in secs}
        parts = {k: max(v - taken[k], 0.0) for k, v in secs.items()}
        parts[COMPILE] = c
        out.append((epoch, parts))
    return out


def _stages(plt, run: Run, path: Path) -> bool:
    """Seconds per training stage, stacked, per epoch, with numba's compile time its own part on
    top (hatched grey) and each epoch's total written over its bar: epoch 0 compiles for tens of
    seconds on a fresh install, which would otherwise hide inside ``compute`` and flatten the
    later epochs' bars to nothing."""
    rows = stage_series(run)
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    epochs = [e for e, _ in rows]
    bottom = [0.0] * len(rows)
    for stage in rows[0][1]:
        values = [secs[stage] for _, secs in rows]
        if stage == COMPILE and not any(values):
            continue
        style = {"color": "0.7", "hatch": "//", "edgecolor": "0.4"} if stage == COMPILE else {}
        ax.bar(epochs, values, bottom=bottom, label=stage, **style)
        bottom = [b + v for b, v in zip(bottom, values)]
    for (e, secs), total in zip(rows, bottom):
        note = f"{total:.3g} s" + (f" ({secs[COMPILE]:.3g} compiling)" if secs[COMPILE] else "")
        ax.annotate(note, (e, total), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize="x-small")
    ax.set(xlabel="epoch", ylabel="seconds", title="training time per stage")
    ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)
    ax.legend(fontsize="small")
    _save(plt, fig, path)
    return True


@dataclass
class Series:
    """The points of a scaling plot drawn in one colour: those of one global batch and the same
    other settings (the only points a speed-up may compare)."""

    name: str  # the legend's: "global batch 400" and the other settings
    points: list[Point]  # by processes


def scaling_series(points: list[Point]) -> list[Series] | None:
    """The points with events/s, grouped by (global batch, other settings), in order of appearance;
    None when they all ran on the same number of processes: such a sweep has no parallel axis,
    and its scaling plot would be one column of dots."""
    done = [p for p in points if (p.run.summary or {}).get("train_events_per_s")]
    if len({p.run.processes for p in done}) < 2:
        return None
    series: dict[str, list[Point]] = {}
    for p in done:
        g = "?" if p.global_batch is None else f"{p.global_batch:,}"
        rest = " ".join(f"{k}={v}" for k, v in p.other_settings.items())
        series.setdefault(f"global batch {g}" + (f" {rest}" if rest else ""), []).append(p)
    return [Series(name, sorted(ps, key=lambda p: (p.run.processes, p.run.layout))) for name, ps in series.items()]


def _scaling(plt, points: list[Point], path: Path) -> bool:
    """events/s against processes, every point labelled with its layout and global batch; beside
    it, where some parallel point has a 1 x 1 x 1 point of its global batch, speed-up against
    processes with the ideal line. One colour per series (global batch and other settings) in both
    panels; both axes of both panels from 0, since a ratio is read from them."""
    series = scaling_series(points)
    if series is None:
        return False
    with_up = any(p.speedup is not None and p.run.processes > 1 for s in series for p in s.points)
    if with_up:
        fig, (ax_rate, ax_up) = plt.subplots(1, 2, figsize=(11, 4.4))
    else:
        fig, ax_rate = plt.subplots(figsize=(6.5, 4.4))
        ax_up = None
    colour = run_colours([s.name for s in series])
    for s in series:
        rates = [p.run.summary["train_events_per_s"] for p in s.points]
        ax_rate.plot([p.run.processes for p in s.points], rates, "o-", lw=1, color=colour[s.name], label=s.name)
        for p, rate in zip(s.points, rates):
            note = "{}x{}x{}".format(*p.run.layout) + ("" if p.global_batch is None else f", {p.global_batch:,}")
            ax_rate.annotate(note, (p.run.processes, rate), fontsize="x-small", xytext=(3, 3),
                             textcoords="offset points")
        up = [p for p in s.points if p.speedup is not None]
        if ax_up is not None and any(p.run.processes > 1 for p in up):  # not a lone baseline at 1.0
            ax_up.plot([p.run.processes for p in up], [p.speedup for p in up], "o-", lw=1, color=colour[s.name],
                       label=s.name)
    if ax_up is None:  # said on the figure too, which may be read without report.md
        ax_rate.text(0.98, 0.02, "no speed-up: no 1 x 1 x 1 point has a\nparallel point's global batch (report.md)",
                     transform=ax_rate.transAxes, ha="right", va="bottom", fontsize="x-small", color="0.3")
    most = max(p.run.processes for s in series for p in s.points)
    top = max(p.run.summary["train_events_per_s"] for s in series for p in s.points)
    ax_rate.set(xlabel="processes (i x j x k)", ylabel="training events/s",
                title="throughput (labels: layout, global batch)", xlim=(0, most + 0.5), ylim=(0, top * 1.15))
    if ax_up is not None:
        ax_up.plot([1, most], [1, most], "k:", label="ideal")
        best = max(p.speedup for s in series for p in s.points if p.speedup is not None)
        ax_up.set(xlabel="processes (i x j x k)", ylabel="speed-up over 1 x 1 x 1, same global batch",
                  title="speed-up at equal global batch", xlim=(0, most + 0.5), ylim=(0, max(most, best) * 1.1))
    _finish_pair(plt, fig, ax_rate, ax_up, True, path)
    return True


def _test_ap(plt, points: list[Point], path: Path) -> bool:
    done = [p for p in points if (p.run.summary or {}).get("test_ap") is not None]
    if not done:
        return False
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(done) + 2), 4))
    bars = ax.bar(range(len(done)), [p.run.summary["test_ap"] for p in done])
    # each bar's value written on it: the bars start at 0 (a bar's length is its value; an axis cut
    # at 0.77 makes 0.78 look twice 0.775), so differences of a point show in the numbers
    ax.bar_label(bars, fmt="%.4f", label_type="edge", padding=2, fontsize="x-small",
                 rotation=90 if len(done) > 8 else 0)
    ax.set_xticks(range(len(done)), [p.label for p in done], rotation=30, ha="right", fontsize="small")
    ax.set(ylabel="test AP", title="test AP per point")
    ax.set_ylim(0.0, 1.1 if len(done) > 8 else 1.05)  # AP lies in [0, 1]; the margin holds the labels
    ax.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    _save(plt, fig, path)
    return True


def _communication(plt, points: list[Point], path: Path) -> bool:
    per_point = [(p, results.communication_bytes(p.run)) for p in points]
    per_point = [(p, c) for p, c in per_point if c]
    if not per_point:
        return False
    phases = sorted({name for _, c in per_point for name in c})
    unit, scale = byte_unit(max(sum(c.values()) for _, c in per_point))
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(per_point) + 3), 4))
    bottom = [0.0] * len(per_point)
    for phase in phases:
        values = [c.get(phase, 0) / scale for _, c in per_point]
        ax.bar(range(len(per_point)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(per_point)), [p.label for p, _ in per_point], rotation=30, ha="right", fontsize="small")
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)  # the unit is in the label, not a 1e8 corner
    ax.set(ylabel=f"{unit} sent by rank 0", title="communication per phase")
    ax.legend(fontsize="x-small")
    _save(plt, fig, path)
    return True


BYTE_UNITS = (("bytes", 1), ("kB", 10 ** 3), ("MB", 10 ** 6), ("GB", 10 ** 9), ("TB", 10 ** 12))


def byte_unit(largest: float) -> tuple[str, int]:
    """(name, bytes) of the largest decimal unit that ``largest`` bytes fill at least once, so an
    axis reads 0 .. 390 MB rather than 0 .. 4 with a "1e8" in its corner."""
    return next(((name, size) for name, size in reversed(BYTE_UNITS) if largest >= size), BYTE_UNITS[0])


def _save(plt, fig, path: Path) -> None:
    import warnings

    with warnings.catch_warnings():  # long point labels: the layout is tightened as far as it goes
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ reports


def _run_markdown(run: Run, images: list[str]) -> str:
    s = run.summary or {}
    out = [f"# Run {run.path.name}", ""]
    if not s:
        out += ["This run has no summary.json: it did not finish (its metrics lines are below).", ""]
    else:
        out += [f"{s.get('data')} / {s.get('model')}, layout {s.get('parallel')}, memory backend "
                f"{s.get('memory_backend')}, {s.get('epochs')} epoch(s) of batch {s.get('batch_size')}.", ""]
        keys = [("test AP", "test_ap", ".4f"), ("val AP", "val_ap", ".4f"), ("best epoch (val AP)", "best_epoch", ""),
                ("test AP at best val", "test_ap_at_best_val", ".4f"), ("test MRR", "test_mrr", ".4f"),
                ("training events/s", "train_events_per_s", ",.0f"), ("traversed events", "traversed_events", ","),
                ("wall seconds", "wall_seconds", ".2f")]
        out += [_table(["", "value"], [[name, _fmt(s.get(key), spec)] for name, key, spec in keys if key in s]), ""]
    if run.metrics:
        stages = dict(results.stage_seconds(run))
        names = list(next(iter(stages.values()))) if stages else []
        rows = []
        for m in run.metrics:
            secs = stages.get(m.get("epoch"), {})
            rows.append([str(m.get("epoch")), _fmt(m.get("loss"), ".4f"), _fmt(m.get("val_ap"), ".4f"),
                         _fmt(m.get("test_ap"), ".4f"), _fmt(m.get("events_per_s"), ",.0f"),
                         _fmt(m.get("compile_seconds"), ".2f")] + [_fmt(secs.get(n), ".3f") for n in names])
        out += ["## Per epoch", "", _table(["epoch", "loss", "val AP", "test AP", "events/s", "compile s"]
                                          + [f"{n} s" for n in names], rows), ""]
        if any(m.get("compile_seconds") for m in run.metrics):
            out += ["numba's compile time (compile s) is inside the stage seconds of the epochs that compiled, "
                    "nearly all of it in `compute`, and left out of their events/s; stages.png draws it as its own "
                    "part.", ""]
    comm = (s or {}).get("communication") or {}
    if comm:
        out += ["## Communication (rank 0)", "",
                _table(["phase", "calls", "bytes sent", "bytes received"],
                       [[name, str(c.get("calls")), _fmt(c.get("bytes_sent"), ","), _fmt(c.get("bytes_received"), ",")]
                        for name, c in comm.items()]), ""]
    out += [f"![{name}](report/{name})" for name in images]
    return "\n".join(out) + "\n"


def _sweep_markdown(path: Path, points: list[Point], images: list[str]) -> str:
    done = [p for p in points if p.run.summary]
    out = [f"# Sweep {path.name}", "", f"{len(points)} point(s), {len(done)} with a summary."
           + (" Settings that vary across the sweep besides the layout: "
              + ", ".join(f"`{k}`" for k in points[0].settings) + "." if points and points[0].settings else ""), ""]
    failed = [p for p in points if not p.run.summary]
    if failed:
        out += ["Without a summary (failed, stopped or still running): "
                + ", ".join(f"`{p.label}`" for p in failed) + ".", ""]
    out += [_SPEEDUP_RULE + " Bytes are those rank 0 sent, summed over the phases. Full precision: "
            "[report/points.csv](report/points.csv).", "",
            _table(list(POINT_COLUMNS), [format_row(point_row(p)) for p in points]), ""]
    out += scaling_notes(points, "scaling.png" in images)
    out += [f"![{name}](report/{name})" for name in images]
    return "\n".join(out) + "\n"


_SPEEDUP_RULE = ("`train.batch_size` is per trainer: a point's global batch is i x batch_size events, so points "
                 "of one batch size but different i train different global batches. Speed-up is events/s over "
                 "the 1 x 1 x 1 point (column `over`) of the same global batch and the same other settings; ideal "
                 "is the number of processes.")


def scaling_notes(points: list[Point], drawn: bool) -> list[str]:
    """report.md's lines on the scaling plot: what it compares, or why there is none, and which
    parallel points have no speed-up, with the batch size a 1 x 1 x 1 point would need."""
    done = [p for p in points if (p.run.summary or {}).get("train_events_per_s")]
    if not drawn:
        if not done:
            return []
        counts = sorted({p.run.processes for p in done})
        return [f"No scaling.png: every point with a throughput ran on {counts[0]} process(es), so the sweep "
                "has no parallel axis.", ""]
    out = ["scaling.png: training events/s of every point against its processes, one colour per global batch "
           "(and other settings), each point labelled with its layout and global batch; the speed-up panel "
           "holds only the points of the table's speed-up column (equal global batches), against the ideal "
           "line. Both axes of both panels start at 0."]
    alone = [p for p in done if p.speedup is None and p.run.processes > 1]
    if alone:
        out[0] += (" Without a 1 x 1 x 1 point of the same global batch, so on the throughput panel only: "
                   + ", ".join(f"`{p.label}` (global batch {_fmt(p.global_batch, ',')}"
                               + (f"; a 1 x 1 x 1 point with `train.batch_size={p.global_batch}` would be its "
                                  "baseline)" if p.global_batch is not None else ")") for p in alone) + ".")
    return out + [""]


def write_report(path: Path, out: Path | None = None) -> Path:
    """Write ``report.md`` and its plots for run or sweep directory ``path``; returns report.md."""
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory (give a run directory or a sweep directory)")
    out = out or path
    if results.is_run_dir(path):
        run, points = results.read_run(path), None
    else:
        found = results.read_sweep(path)
        if not found:
            raise ConfigError(f"{path}: neither a run directory (config.yaml, metrics.jsonl, summary.json) nor a "
                              f"sweep directory (numbered run directories)")
        run, points = None, results.sweep_points(found)
    plt = _pyplot()
    try:
        return _write(path, out, run, points, plt)
    except OSError as e:
        raise ConfigError(f"{e.filename or out}: cannot write the report ({e.strerror or e})") from None


def _write(path: Path, out: Path, run: Run | None, points: list[Point] | None, plt) -> Path:
    figures = out / "report"
    figures.mkdir(parents=True, exist_ok=True)
    images = []
    if points is None:
        for name, draw in (("curves.png", lambda p: _curves(plt, [("", run)], p)),
                           ("stages.png", lambda p: _stages(plt, run, p))):
            if draw(figures / name):
                images.append(name)
        text = _run_markdown(run, images)
    else:
        for name, draw in (("scaling.png", lambda p: _scaling(plt, points, p)),
                           ("test_ap.png", lambda p: _test_ap(plt, points, p)),
                           ("communication.png", lambda p: _communication(plt, points, p)),
                           ("curves.png", lambda p: _curves(plt, [(q.label, q.run) for q in points], p))):
            if draw(figures / name):
                images.append(name)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(POINT_COLUMNS), lineterminator="\n")
        writer.writeheader()
        for p in points:
            writer.writerow({k: ("" if v is None else repr(v) if isinstance(v, float) else v)
                             for k, v in point_row(p).items()})
        (figures / "points.csv").write_text(buf.getvalue())
        text = _sweep_markdown(path, points, images)
    report = out / "report.md"
    report.write_text(text)
    return report


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tgdist report",
                                 description="Write report.md and PNG plots for a run directory or a sweep directory.",
                                 epilog="example: tgdist report multirun/20261126-101500")
    ap.add_argument("path", type=Path, help="a run directory, or a sweep directory of numbered runs")
    ap.add_argument("--out", type=Path, default=None, help="write DIR/report.md and DIR/report/ (default: PATH)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    report = write_report(args.path, args.out)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
