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
from dataclasses import asdict, dataclass, field, fields
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
    def from_json(cls, d) -> "Profile":
        """The profile a JSON value holds; anything else (another version, a missing or ill-typed
        field, a non-finite time) is one ``ConfigError`` naming the field."""
        _check(d)
        d = dict(d)
        d.pop("version", None)
        coll = dict(d.get("collectives") or {})
        if coll.get("bytes_per_s") is None:
            coll["bytes_per_s"] = math.inf
        coll.setdefault("fixed_s", 0.0)
        d["collectives"] = coll
        d["batches"] = [BatchProfile(**b) for b in d["batches"]]
        d["placements"] = [PlacementShare(**p) for p in d.get("placements", [])]
        return cls(**d)


# ------------------------------------------------------------------------------------------------
# What a profile file must hold (``read`` checks it all before any field is used)

def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _number(v, where: str, *, least: float = 0.0, above: bool = False, most: float = math.inf) -> None:
    """A finite JSON number (not a boolean) at least ``least`` (above it with ``above``), at most ``most``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where} is {_kind(v)} ({v!r}), not a number")
    if not math.isfinite(v):
        raise ConfigError(f"{where} is {v}, not a finite number")
    if v < least or (above and v == least) or v > most:
        bound = f"above {least:g}" if above else f"at least {least:g}"
        raise ConfigError(f"{where} is {v:g}: give a number {bound}" + (f" and at most {most:g}" if most < math.inf else ""))


def _integer(v, where: str, least: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where} is {_kind(v)} ({v!r}), not an integer")
    if v < least:
        raise ConfigError(f"{where} is {v}: give an integer of at least {least}")


def _mapping(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{where} is {_kind(v)}, not an object")
    return v


def _fields(d: dict, known, where: str) -> None:
    if unknown := sorted(set(d) - set(known)):
        raise ConfigError(f"{where} has unknown field(s) {', '.join(map(str, unknown))}: not a profile of this tgdist")


def _check(d) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"not a profile: {_kind(d)}, where a profile is an object with data, batches and grad_bytes "
                          f"(tgdist plan --profile writes one)")
    version = d.get("version", VERSION)
    if version != VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise ConfigError(f"profile version {version}, written by a newer tgdist (this one reads version {VERSION}): "
                              f"update tgdist, or take the profile again with this one")
        raise ConfigError(f"profile version {version!r} is not {VERSION}: take the profile again")
    known = {f.name for f in fields(Profile)} | {"version"}
    _fields(d, known, "the profile")
    for key in ("data", "batches", "grad_bytes"):
        if key not in d:
            raise ConfigError(f"not a profile: no {key} (tgdist plan --profile writes data, batches and grad_bytes)")
    data = _mapping(d["data"], "data")
    for key in ("num_nodes", "num_train_events", "mem_dim", "mail_dim"):
        if key not in data:
            raise ConfigError(f"data has no {key}")
        _integer(data[key], f"data.{key}")
    if "mailbox_size" in data:
        _integer(data["mailbox_size"], "data.mailbox_size")
    if "overrides" in data and not (isinstance(data["overrides"], list)
                                    and all(isinstance(o, str) for o in data["overrides"])):
        raise ConfigError("data.overrides is not a list of strings")
    batches = d["batches"]
    if not isinstance(batches, list) or not batches:
        raise ConfigError(f"batches is {'empty' if batches == [] else _kind(batches)}: a profile needs a list of at "
                          f"least one profiled batch size")
    bknown = {f.name for f in fields(BatchProfile)}
    for n, b in enumerate(batches):
        where = f"batches[{n}]"
        _mapping(b, where)
        _fields(b, bknown, where)
        for key in ("batch_size", "seconds", "rows_sampled", "rows_distinct", "roots", "roots_distinct"):
            if key not in b:
                raise ConfigError(f"{where} has no {key}")
        _integer(b["batch_size"], f"{where}.batch_size")
        for key, v in _mapping(b["seconds"], f"{where}.seconds").items():
            _number(v, f"{where}.seconds.{key}")
        for key in ("rows_sampled", "rows_distinct", "roots", "roots_distinct"):
            _number(b[key], f"{where}.{key}")
        if "iterations" in b:
            _integer(b["iterations"], f"{where}.iterations", 0)
        if b.get("val_ap") is not None:
            _number(b["val_ap"], f"{where}.val_ap", most=1.0)
        for key, v in _mapping(b.get("stream_factor", {}), f"{where}.stream_factor").items():
            _number(v, f"{where}.stream_factor.{key}")
        if "step_cv" in b:
            _number(b["step_cv"], f"{where}.step_cv")
    _integer(d["grad_bytes"], "grad_bytes", 0)
    placements = d.get("placements", [])
    if not isinstance(placements, list):
        raise ConfigError(f"placements is {_kind(placements)}, not a list")
    pknown = {f.name for f in fields(PlacementShare)}
    for n, p in enumerate(placements):
        where = f"placements[{n}]"
        _mapping(p, where)
        _fields(p, pknown, where)
        if not isinstance(p.get("method"), str):
            raise ConfigError(f"{where}.method is {_kind(p.get('method'))}, not a partition method's name")
        _integer(p.get("parts"), f"{where}.parts")
        _number(p.get("remote_share"), f"{where}.remote_share", most=1.0)
        if "imbalance" in p:
            _number(p["imbalance"], f"{where}.imbalance", above=True)
    coll = d.get("collectives") or {}
    _mapping(coll, "collectives")
    for key in ("fixed_s", "exchange_s", "gradient_s"):
        if key in coll:
            _number(coll[key], f"collectives.{key}")
    if coll.get("bytes_per_s") is not None:
        _number(coll["bytes_per_s"], "collectives.bytes_per_s", above=True)
    if "graph_bytes" in d:
        _integer(d["graph_bytes"], "graph_bytes", 0)
    for key, v in _mapping(d.get("core_sharing", {}), "core_sharing").items():
        if str(key).isdigit():
            _number(v, f"core_sharing.{key}", above=True)
    overlap = _mapping(d.get("overlap", {}), "overlap")
    if overlap.get("prefetch") is not None:
        _number(overlap["prefetch"], "overlap.prefetch", most=1.0)
    for key in ("largest_batch", "saturation_batch"):
        if d.get(key) is not None:
            _integer(d[key], key)
    if "threads" in d:
        _integer(d["threads"], "threads")
    for key in ("accuracy_source", "machine", "created"):
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"{key} is {_kind(d[key])}, not a string")


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
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a profile (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not a profile (JSON: {e.msg} at line {e.lineno})") from None
    try:
        return Profile.from_json(raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except (TypeError, ValueError) as e:  # (what the checks above let through)
        raise ConfigError(f"{p}: not a profile of this version ({e})") from None
