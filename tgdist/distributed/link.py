"""A simulated interconnect: what a collective would cost on a real network (``parallel.link``).

On one machine the ranks' collectives travel through shared memory or loopback and are nearly
free, so a run there says nothing about what its communication would cost between machines.
``collectives`` therefore delays every collective by the time this module models for it, sleeping
(not spinning: the cores stay free for the ranks' computation). The numbers are a model, the
alpha-beta (Hockney) cost ``latency + bytes / bandwidth`` with one latency per collective, not a
measurement of any network.

Presets (``parallel.link=NAME``), per rank, per direction:

============  ===============================  ===========  ========
name          models                           bandwidth    latency
============  ===============================  ===========  ========
``none``      no delay (the default)           -            -
``eth10``     10 Gbit/s Ethernet (TCP)         1.25 GB/s    50 us
``ib100``     100 Gbit/s InfiniBand (EDR)      12.5 GB/s    5 us
``nvlink``    NVLink 3 between GPUs            300 GB/s     2 us
============  ===============================  ===========  ========

or ``BANDWIDTH:LATENCY`` with units, e.g. ``25gbps:5us`` (gigabits per second) or
``300GB/s:2us`` (gigabytes per second); bandwidth units ``gbps``, ``mbps`` (bits) or ``gb/s``,
``mb/s`` (bytes), latency units ``ns``, ``us``, ``ms``, ``s`` (case does not matter).

Importing this module does not import torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tgdist.errors import ConfigError

__all__ = ["Link", "PRESETS", "KINDS", "parse_link", "link_seconds", "wire_bytes"]


@dataclass(frozen=True)
class Link:
    """One rank's connection to the others: ``bandwidth`` bytes per second in each direction,
    ``latency`` seconds per collective. ``name``: the preset or spec it was read from."""

    bandwidth: float
    latency: float
    name: str = "custom"

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"a link needs a positive bandwidth and a latency >= 0, not {self}")

    def describe(self) -> str:
        """``eth10 (1.25 GB/s, 50 us per collective)`` for logs."""
        return f"{self.name} ({self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us per collective)"


PRESETS: dict[str, Link] = {
    "eth10": Link(bandwidth=10e9 / 8, latency=50e-6, name="eth10"),
    "ib100": Link(bandwidth=100e9 / 8, latency=5e-6, name="ib100"),
    "nvlink": Link(bandwidth=300e9, latency=2e-6, name="nvlink"),
}

_BANDWIDTH_UNITS = {"gbps": 1e9 / 8, "mbps": 1e6 / 8, "gb/s": 1e9, "mb/s": 1e6}  # -> bytes per second
_LATENCY_UNITS = {"ns": 1e9, "us": 1e6, "ms": 1e3, "s": 1.0}  # per second (divided by: 5us is 5e-6 exactly)
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_SPEC = re.compile(rf"({_NUMBER})\s*({'|'.join(map(re.escape, _BANDWIDTH_UNITS))})\s*:\s*({_NUMBER})\s*"
                   rf"({'|'.join(_LATENCY_UNITS)})", re.IGNORECASE)


def parse_link(spec: str | None) -> Link | None:
    """The ``Link`` that ``parallel.link=spec`` names: a preset, ``BANDWIDTH:LATENCY``, or None
    for ``none`` (and for None). Anything else: a one-line ``ConfigError`` naming the options."""
    if spec is None or str(spec).strip().lower() == "none":
        return None
    text = str(spec).strip()
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    m = _SPEC.fullmatch(text)
    if m is not None:
        bandwidth = float(m.group(1)) * _BANDWIDTH_UNITS[m.group(3).lower()]
        latency = float(m.group(4)) / _LATENCY_UNITS[m.group(6).lower()]
        if bandwidth > 0:
            return Link(bandwidth=bandwidth, latency=latency, name=text)
    raise ConfigError(f"parallel.link={spec!r}: choose none, {', '.join(PRESETS)}, or BANDWIDTH:LATENCY "
                      f"such as 25gbps:5us or 300GB/s:2us (bandwidth in gbps, mbps, GB/s or MB/s; latency in "
                      f"ns, us, ms or s)")


# What a collective puts on one rank's link, as a multiple of the ``nbytes`` it is given (see
# ``wire_bytes``); ``n`` is the group's size.
KINDS = {
    # ring all-reduce (reduce-scatter, then all-gather): each rank sends and receives 2 (n-1)/n of
    # the buffer, whatever n, which is why it is the bandwidth-optimal algorithm
    "all_reduce": lambda n: 2 * (n - 1) / n,
    # the rest move what they are given once: nbytes is this rank's larger direction already
    "all_gather": lambda n: 1.0,
    "all_to_all": lambda n: 1.0,
    "broadcast": lambda n: 1.0,
    "barrier": lambda n: 1.0,  # nbytes = 0: latency only
}


def wire_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes that a collective of ``kind`` over ``group_size`` ranks puts through one rank's
    link, given ``nbytes``: for ``all_reduce`` the size of the reduced buffer, for the others
    the larger of what the rank sends and what it receives (its link is full duplex, so the busier
    direction sets the time; an all-gather's or all-to-all's ranks may pay different times)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(KINDS)}")
    return KINDS[kind](group_size) * nbytes


def link_seconds(kind: str, nbytes: int, group_size: int, link: Link | None) -> float:
    """Modelled seconds a collective of ``kind`` with ``nbytes`` (see ``wire_bytes``) over
    ``group_size`` ranks takes on ``link``: ``latency + wire_bytes / bandwidth``, one latency per
    collective (the several steps of a ring are folded into it). 0 without a link or for a group
    of one, whose collectives never leave the process."""
    if link is None or group_size <= 1:
        return 0.0
    return link.latency + wire_bytes(kind, nbytes, group_size) / link.bandwidth
