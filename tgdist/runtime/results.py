"""What run and sweep directories hold, as numbers for ``tgdist report``.

A run directory (``tgdist train``, one ``tgdist launch``) holds ``config.yaml``, ``metrics.jsonl``
(one line per evaluation) and ``summary.json``; a sweep directory (``-m``: ``multirun/<time>`` or
``RUN_DIR``) holds one run directory per job, named by its number. Nothing here draws: these are
plain functions over those files, so the report's tables can be checked against the summaries.

``train.batch_size`` is per trainer: the i trainers of a subgroup split a *global batch* of
``i * batch_size`` events (the events of one memory update), so a sweep over ``parallel.i`` at one
batch size trains its points on different global batches. Speed-up is therefore a point's training
events/s over that of the 1 x 1 x 1 point with the same global batch and the same other settings
(the keys that vary across the sweep, ``parallel.*`` and ``train.batch_size`` aside): a 2 x 1 x 1
point of batch size 200 is held against a 1 x 1 x 1 point of batch size 400. Ideal is the number of
processes i*j*k. A point without such a baseline has no speed-up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tgdist.errors import ConfigError

__all__ = ["Run", "Point", "read_run", "is_run_dir", "read_sweep", "sweep_points", "layout_of", "batch_size_of",
           "flatten", "STAGES", "BATCH_KEY"]

STAGES = ("sample", "features", "memory_read", "compute", "memory_write")
SWEEP_RECORD = "sweep.json"  # tgdist launch's list of a sweep's jobs
_RUN_FILES = (".tgdist-run", "summary.json", "metrics.jsonl", "config.yaml")
# keys that differ between the jobs of any sweep without being a setting of it
_NOT_SETTINGS = ("run_dir", "train.resume", "train.overwrite", "train.progress")
BATCH_KEY = "train.batch_size"  # events per trainer; a point's global batch is i times it


@dataclass
class Run:
    """One run directory's files, read (``summary`` None when the run did not finish)."""

    path: Path
    config: dict  # flattened: {"train.epochs": 2, ...}
    metrics: list[dict]
    summary: dict | None
    overrides: dict | None = None  # the command line's ``key=value``s (Hydra's .hydra/overrides.yaml)

    @property
    def layout(self) -> tuple[int, int, int]:
        return layout_of(self)

    @property
    def processes(self) -> int:
        i, j, k = self.layout
        return i * j * k


@dataclass
class Point:
    """One job of a sweep: its number, run, the settings that vary across the sweep, and its
    speed-up over point ``baseline`` (None without a 1 x 1 x 1 point of the same global batch and
    the same other settings, or without a summary)."""

    num: int
    run: Run
    settings: dict = field(default_factory=dict)
    speedup: float | None = None
    baseline: int | None = None  # the number of the point the speed-up is over

    @property
    def global_batch(self) -> int | None:
        """``i * train.batch_size`` events (None when the batch size is not known)."""
        b = batch_size_of(self.run)
        return None if b is None else self.run.layout[0] * b

    @property
    def other_settings(self) -> dict:
        """The settings besides the batch size (which the global batch stands for in comparisons)."""
        return {k: v for k, v in self.settings.items() if k != BATCH_KEY}

    @property
    def label(self) -> str:
        i, j, k = self.run.layout
        rest = " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.settings.items())
        return f"#{self.num} {i}x{j}x{k}" + (f" {rest}" if rest else "")


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in _RUN_FILES)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable as JSON ({e})") from None


def read_run(path: Path) -> Run:
    """The files of run directory ``path``; a metrics line that is not JSON is refused in one line."""
    import yaml

    config = {}
    if (path / "config.yaml").exists():
        config = flatten(yaml.safe_load((path / "config.yaml").read_text()) or {})
    metrics = []
    if (path / "metrics.jsonl").exists():
        for n, line in enumerate((path / "metrics.jsonl").read_text().splitlines(), 1):
            if line.strip():
                try:
                    metrics.append(json.loads(line))
                except ValueError:
                    raise ConfigError(f"{path / 'metrics.jsonl'}: line {n} is not JSON") from None
    overrides = None
    if (path / ".hydra" / "overrides.yaml").exists():
        lines = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
        overrides = {key.lstrip("+~"): value for key, _, value in (str(o).partition("=") for o in lines)}
    return Run(path=path, config=config, metrics=metrics, summary=_read_json(path / "summary.json"),
               overrides=overrides)


def batch_size_of(run: Run) -> int | None:
    """``train.batch_size`` (events per trainer) from the summary, else the config, else the
    command line's overrides (a job that left no directory)."""
    for value in ((run.summary or {}).get("batch_size"), run.config.get(BATCH_KEY),
                  (run.overrides or {}).get(BATCH_KEY)):
        try:
            if value is not None and not isinstance(value, bool) and int(value) > 0:
                return int(value)
        except (TypeError, ValueError):
            continue
    return None


def layout_of(run: Run) -> tuple[int, int, int]:
    """(i, j, k) from the summary (``"2 x 1 x 1"``), else from the config."""
    text = (run.summary or {}).get("parallel")
    if text:
        i, j, k = (int(x) for x in str(text).split(" x "))
        return i, j, k
    return tuple(int(run.config.get(f"parallel.{x}", 1)) for x in "ijk")  # type: ignore[return-value]


def read_sweep(path: Path) -> list[tuple[int, Run]]:
    """The numbered run directories of sweep directory ``path``, in job order, and the jobs that
    ``tgdist launch``'s record (``sweep.json``) names but that left no run directory (a run that
    fails removes its own), as runs without files."""
    found = {int(p.name): read_run(p) for p in path.iterdir() if p.is_dir() and p.name.isdigit() and is_run_dir(p)}
    record = _read_json(path / SWEEP_RECORD) or {}
    for point in record.get("points", []):  # its overrides are the command line's, for every job
        num = int(point["num"])
        overrides = {key.lstrip("+~"): value for key, _, value in (str(o).partition("=")
                                                                  for o in point.get("overrides", []))}
        if num in found:
            found[num].overrides = overrides
        else:
            layout = point.get("layout") or [1, 1, 1]
            found[num] = Run(path=path / str(num), config={f"parallel.{x}": n for x, n in zip("ijk", layout)},
                             metrics=[], summary=None, overrides=overrides)
    return sorted(found.items())


def sweep_points(runs: list[tuple[int, Run]]) -> list[Point]:
    """The points of a sweep with the settings that vary across it and their speed-ups. The
    settings are the command-line overrides that differ between points (``.hydra/overrides.yaml``),
    else the config values that do, save those a layout changes by itself (a scaled ``train.lr``).
    A point's speed-up is over the 1 x 1 x 1 point of its global batch and other settings."""
    typed = all(r.overrides is not None for _, r in runs)
    values = [(r.overrides if typed else r.config) for _, r in runs]
    keys = [k for k in dict.fromkeys(k for v in values for k in v)
            if k != "parallel" and not k.startswith(("parallel.", "hydra")) and k not in _NOT_SETTINGS
            and (typed or k != "train.lr")]
    varying = [k for k in keys if len({json.dumps(v.get(k), sort_keys=True, default=str) for v in values}) > 1]
    points = [Point(num, run, {k: v.get(k) for k in varying}) for (num, run), v in zip(runs, values)]
    for p in points:
        rate = _rate(p.run)
        if rate is None:
            continue
        if p.global_batch is None:
            continue
        base = [q for q in points if q.run.layout == (1, 1, 1) and q.global_batch == p.global_batch
                and q.other_settings == p.other_settings and _rate(q.run)]
        if base:
            p.speedup, p.baseline = rate / _rate(base[0].run), base[0].num
    return points


def _rate(run: Run) -> float | None:
    value = (run.summary or {}).get("train_events_per_s")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def communication_bytes(run: Run) -> dict[str, int]:
    """Bytes sent per named exchange (rank 0's counts, as the summary holds them)."""
    comm = (run.summary or {}).get("communication") or {}
    return {name: int(c.get("bytes_sent", 0)) for name, c in comm.items()}


def stage_seconds(run: Run) -> list[tuple[int, dict[str, float]]]:
    """(epoch, seconds per stage) of every metrics line that has them (runs of one process)."""
    lines = [m for m in run.metrics if isinstance(m.get("stage_seconds"), dict)]
    names = list(STAGES) + sorted({s for m in lines for s in m["stage_seconds"]} - set(STAGES))
    return [(int(m["epoch"]), {s: float(m["stage_seconds"].get(s, 0.0)) for s in names}) for m in lines]
