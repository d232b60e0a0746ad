"""A cluster as the advisor sees it: machines, trainers per machine, the links between trainers of
one machine and of different machines, memory per device and per host, and, for CPU trainers, the
cores they share.

``Cluster`` is a plain value. ``preset(name)`` gives a named one (``PRESETS``); ``load(path)`` reads
the YAML form, whose keys are the fields below:

    name: my-cluster
    machines: 4
    trainers_per_machine: 8
    intra_link: nvlink          # a parallel.link preset (eth10, ib100, nvlink) or BANDWIDTH:LATENCY
    inter_link: ib100
    device_memory_gb: 80        # per trainer (GPU); null: trainers live in host memory (CPU)
    host_memory_gb: 1024        # per machine
    cores_per_machine: null     # CPU trainers: the cores they share; null: a device per trainer
    device: cuda                # cuda or cpu (train.device of the launch line)

``cluster_of(spec)`` takes a preset name or a path. A link is a ``tgdist.distributed.link.Link``, so
the advisor prices communication exactly as ``parallel.link`` models it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tgdist.distributed.link import Link, parse_link
from tgdist.errors import ConfigError

__all__ = ["Cluster", "PRESETS", "MAX_TRAINERS", "preset", "load", "cluster_of"]

MAX_TRAINERS = 10**9  # machines x trainers per machine: far beyond any cluster, and its layouts still count in ms


@dataclass(frozen=True)
class Cluster:
    """``machines`` x ``trainers_per_machine`` trainers (one GPU each, or one CPU process each).

    ``simulated``: the links are ``parallel.link`` models on one machine (this machine's presets):
    the launch line then carries ``parallel.link=`` so the run pays what the prediction assumed."""

    name: str
    machines: int
    trainers_per_machine: int
    intra_link: str
    inter_link: str
    host_memory_gb: float
    device_memory_gb: float | None = None
    cores_per_machine: int | None = None
    device: str = "cuda"
    simulated: bool = False

    def __post_init__(self) -> None:
        for key in ("machines", "trainers_per_machine"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"cluster {self.name}: {key} must be a positive integer, got {v!r}")
        for key in ("host_memory_gb", "device_memory_gb"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ConfigError(f"cluster {self.name}: {key} must be a positive number of GB, got {v!r}")
        if self.trainers > MAX_TRAINERS:
            raise ConfigError(f"cluster {self.name}: {self.machines:,} x {self.trainers_per_machine:,} = {self.trainers:,} "
                              f"trainers, more than the {MAX_TRAINERS:,} the advisor weighs")
        c = self.cores_per_machine
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ConfigError(f"cluster {self.name}: cores_per_machine must be a positive integer or null, got {c!r}")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"cluster {self.name}: device must be cuda or cpu, got {self.device!r}")
        for key in ("intra_link", "inter_link"):
            try:
                link = parse_link(getattr(self, key))
            except ConfigError:
                link = None
            if link is None:
                raise ConfigError(f"cluster {self.name}: {key}={getattr(self, key)!r} must name a link: eth10, ib100, "
                                  f"nvlink or BANDWIDTH:LATENCY such as 25gbps:5us")

    @property
    def trainers(self) -> int:
        return self.machines * self.trainers_per_machine

    def link(self, spans_machines: bool) -> Link:
        """The link a collective pays: the slower inter-machine one when its ranks span machines."""
        return parse_link(self.inter_link if spans_machines else self.intra_link)

    def as_json(self) -> dict:
        return asdict(self)


def _cpu_here(m: int, link: str) -> Cluster:
    """``m`` CPU trainers on this machine's two cores, collectives priced as ``parallel.link=link``."""
    return Cluster(name=f"cpu-{m}-{link}", machines=1, trainers_per_machine=m, intra_link=link, inter_link=link,
                   host_memory_gb=16.0, cores_per_machine=2, device="cpu", simulated=True)


PRESETS: dict[str, Cluster] = {
    **{f"cpu-{m}-{link}": _cpu_here(m, link) for m in (1, 2, 4) for link in ("eth10", "ib100")},
    "gpu-1": Cluster(name="gpu-1", machines=1, trainers_per_machine=1, intra_link="nvlink", inter_link="nvlink",
                     host_memory_gb=128.0, device_memory_gb=80.0),
    "dgx-8": Cluster(name="dgx-8", machines=1, trainers_per_machine=8, intra_link="nvlink", inter_link="nvlink",
                     host_memory_gb=1024.0, device_memory_gb=80.0),
    "gpu-4x8-ib100": Cluster(name="gpu-4x8-ib100", machines=4, trainers_per_machine=8, intra_link="nvlink",
                             inter_link="ib100", host_memory_gb=512.0, device_memory_gb=40.0),
    "gpu-4x8-eth10": Cluster(name="gpu-4x8-eth10", machines=4, trainers_per_machine=8, intra_link="nvlink",
                             inter_link="eth10", host_memory_gb=512.0, device_memory_gb=40.0),
    "gpu-4x4-eth10": Cluster(name="gpu-4x4-eth10", machines=4, trainers_per_machine=4, intra_link="ib100",
                             inter_link="eth10", host_memory_gb=256.0, device_memory_gb=24.0),
}


def preset(name: str) -> Cluster:
    if name not in PRESETS:
        raise ConfigError(f"unknown cluster {name!r}: give a YAML file or one of {', '.join(PRESETS)}")
    return PRESETS[name]


def load(path: str | Path) -> Cluster:
    """The cluster of a YAML file (the module docstring's keys); unknown or missing keys: one line."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the cluster file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a cluster file is a mapping of the keys {', '.join(f.name for f in fields(Cluster))}")
    known = {f.name for f in fields(Cluster)}
    if unknown := sorted(set(raw) - known):
        raise ConfigError(f"{p}: unknown key(s) {', '.join(unknown)}; a cluster has {', '.join(sorted(known))}")
    raw.setdefault("name", p.stem)
    for key in ("intra_link", "inter_link"):
        if key in raw:
            raw[key] = str(raw[key])
    missing = [k for k in ("machines", "trainers_per_machine", "intra_link", "host_memory_gb") if k not in raw]
    if missing:
        raise ConfigError(f"{p}: missing key(s) {', '.join(missing)}")
    raw.setdefault("inter_link", raw["intra_link"])
    return Cluster(**raw)


def cluster_of(spec: str) -> Cluster:
    """A preset name, or the path of a YAML file (ending in .yaml or .yml, or an existing file)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
        return load(spec)
    return preset(spec)
