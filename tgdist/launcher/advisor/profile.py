"""What a profile holds: the measurements the advisor's formulas need, as one JSON file.

A profile is taken once per data set and machine (``tgdist plan --profile``, ``measure.py``) and read
by ``model.predict`` for any cluster. Times are of one trainer process (``threads`` threads) on the
machine that took it; the cluster's trainers are assumed as fast (a profile of a GPU for a GPU
cluster).

- ``batches``: per profiled local batch size, the seconds per iteration of each stage of the step
  (``STAGES``, the trainer's ``StageTimer``) and the rows of Sven 3.2, over the whole training
  range (``stream_factor``: what the first batches' stages were scaled by), how much the step
  time varies (``step_cv``); the rows: ``rows_sampled`` N1 (roots and sampled neighbours),
  ``rows_distinct`` N1 (1 - eta1), ``roots`` N2 (sources and destinations), ``roots_distinct`` N2
  (1 - eta2); ``val_ap`` where accuracy was swept.
- ``placements``: per partition method and trainer count M, the share of a trainer's distinct rows
  that another trainer owns (``remote_share``) and the busiest trainer's load over the mean
  (``imbalance``), from the access graph of one pre-sampled epoch (``tgdist.partition.measures``).
- ``collectives``: this machine's cost of a collective between processes apart from any modelled
  link (gloo on loopback): idle, ``fixed_s`` per collective and ``bytes_per_s``; and as two training
  processes pay it (``measure.paid_costs``), ``gradient_s`` for the gradients' all-reduce and
  ``exchange_s`` for one of a partitioned store's collectives, with the runs they came from
  (``paid``; absent where they were not measured: a GPU profile, ``--no-collectives``).
- ``core_sharing``: how much slower R single-threaded processes run side by side here than one
  alone (the cores, and whatever else ran on them when the profile was taken);
- ``overlap``: ``prefetch``, the share of the ideal saving that prefetching measured at S (the loop
  with a background sampling thread against the plain loop): what overlap of stages running in
  threads of one process buys here; absent, the model assumes the papers' perfect overlap;
- ``largest_batch`` L and ``saturation_batch`` S of DistTGL 3.2.4, with ``accuracy_source``
  (``given``, ``measured``, or ``none``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgdist.errors import ConfigError

__all__ = ["STAGES", "BatchProfile", "PlacementShare", "Profile", "read", "write"]

STAGES = ("sample", "features", "memory_read", "compute", "memory_write")  # tgdist.runtime.trainer.STAGES
VERSION = 1


@dataclass(frozen=True)
class BatchProfile:
    batch_size: int
    seconds: dict  # stage -> seconds per iteration
    rows_sampled: float
    rows_distinct: float
    roots: float
    roots_distinct: float
    iterations: int = 0
    val_ap: float | None = None
    # stage -> what the Run loop's seconds in the stream's first batches were scaled by: the stage
    # over batches spread over the training range over the same first batches (measure._over_the_stream)
    stream_factor: dict = field(default_factory=dict)
    step_cv: float = 0.0  # the step time's standard deviation over its mean, over the training range

    @property
    def eta1(self) -> float:
        """Sven eq. (1): the redundant share of the sampled rows (dispatch)."""
        return 1.0 - self.rows_distinct / max(self.rows_sampled, 1e-12)

    @property
    def eta2(self) -> float:
        """Sven eq. (1): the redundant share of the roots (aggregation)."""
        return 1.0 - self.roots_distinct / max(self.roots, 1e-12)


@dataclass(frozen=True)
class PlacementShare:
    method: str
    parts: int
    remote_share: float
    imbalance: float = 1.0


@dataclass(frozen=True)
class Profile:
    data: dict  # name, overrides, num_nodes, num_train_events, mem_dim, mail_dim, mailbox_size, model
    batches: list
    grad_bytes: int
    placements: list = field(default_factory=list)
    collectives: dict = field(default_factory=lambda: {"fixed_s": 0.0, "bytes_per_s": math.inf})
    graph_bytes: int = 0
    core_sharing: dict = field(default_factory=dict)  # "R" -> slowdown of R processes side by side
    overlap: dict = field(default_factory=dict)  # "prefetch": the share of the ideal overlap a stage thread buys
    largest_batch: int | None = None
    saturation_batch: int | None = None
    accuracy_source: str = "none"
    threads: int = 1
    machine: str = ""
    created: str = ""

    def __post_init__(self) -> None:
        if not self.batches:
            raise ConfigError("a profile needs at least one profiled batch size")
        for key in ("num_nodes", "num_train_events", "mem_dim", "mail_dim"):
            if key not in self.data:
                raise ConfigError(f"a profile's data needs {key}")

    def batch_sizes(self) -> list[int]:
        return sorted(b.batch_size for b in self.batches)

    def placement(self, method: str, parts: int) -> PlacementShare | None:
        for p in self.placements:
            if p.method == method and p.parts == parts:
                return p
        return None

    def methods(self) -> list[str]:
        return sorted({p.method for p in self.placements})

    def as_json(self) -> dict:
        d = asdict(self)
        d["version"] = VERSION
        bps = d["collectives"].get("bytes_per_s")
        if bps is not None and not math.isfinite(bps):
            d["collectives"]["bytes_per_s"] = None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        d = dict(d)
        if d.pop("version", VERSION) != VERSION:
            raise ConfigError(f"profile version {d.get('version')} is not {VERSION}: take the profile again")
        coll = dict(d.get("collectives") or {})
        if coll.get("bytes_per_s") is None:
            coll["bytes_per_s"] = math.inf
        coll.setdefault("fixed_s", 0.0)
        d["collectives"] = coll
        d["batches"] = [BatchProfile(**b) for b in d["batches"]]
        d["placements"] = [PlacementShare(**p) for p in d.get("placements", [])]
        return cls(**d)


def write(profile: Profile, path: str | Path) -> None:
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(profile.as_json(), indent=1) + "\n")
    tmp.replace(p)


def read(path: str | Path) -> Profile:
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the profile ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not a profile (JSON: {e.msg} at line {e.lineno})") from None
    try:
        return Profile.from_json(raw)
    except TypeError as e:
        raise ConfigError(f"{p}: not a profile of this version ({e})") from None
