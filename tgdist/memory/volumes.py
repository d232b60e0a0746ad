"""Sven's communication volumes of one iteration, eqs. (7)-(9) (Appendix C, eqs. (15)-(21)), as
pure functions, and what the backends here count against them.

Terms, for one global batch of a memory group of ``m`` trainers: ``n1`` sampled node occurrences
(roots and neighbours, all trainers) with redundancy ``eta1``, so ``n1 (1 - eta1)`` is the sum over
trainers of their distinct nodes; ``n2`` original node occurrences (sources and destinations) with
``eta2``, so ``n2 (1 - eta2)`` is the sum over trainers of the distinct nodes they write. Sizes in
bytes: ``mem_bytes`` = d_mem C0 (a memory row with its time), ``mail_bytes`` = d_msg C0 (a mail
with its time). A volume counts every byte twice, sent and received (the factor 2).

The paper assumes ideal balance: a share (m - 1) / m of what a trainer needs lives elsewhere.
``remote`` replaces that share by a measured one (rows that crossed a link over rows needed), which
is how a real placement's counts meet the formulas exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


def ideal_remote(m: int) -> float:
    """The share of a trainer's rows on other trainers under ideal balance: ``(m - 1) / m``."""
    return (m - 1) / m


def depcache_volume(n2: int, eta2: float, m: int, mem_bytes: int, mail_bytes: int) -> float:
    """Eq. (7): ``N2 (1 - eta2) (d_msg + d_mem) 2 (M - 1)^2 / M C0`` (the all-gather of writes)."""
    return n2 * (1 - eta2) * (mail_bytes + mem_bytes) * 2 * (m - 1) ** 2 / m


def depcomm_volume(n1: int, n2: int, eta2: float, m: int, mem_bytes: int, mail_bytes: int,
                   remote: tuple[float, float] | None = None) -> tuple[float, float]:
    """Eq. (8), its two all-to-alls: ``(N1 d_mem 2 r1, N2 (1 - eta2) (d_msg + d_mem) 2 r2)``
    with ``r = (M - 1) / M`` unless ``remote`` gives the measured shares."""
    r1, r2 = remote if remote is not None else (ideal_remote(m),) * 2
    return n1 * mem_bytes * 2 * r1, n2 * (1 - eta2) * (mail_bytes + mem_bytes) * 2 * r2


def sven_volume(n1: int, eta1: float, n2: int, eta2: float, m: int, mem_bytes: int, mail_bytes: int,
                remote: tuple[float, float] | None = None) -> tuple[float, float]:
    """Eq. (9), its two all-to-alls: ``(N1 (1 - eta1) (d_msg + d_mem) 2 r1,
    N2 (1 - eta2) (d_msg + d_mem) 2 r2)``, ``r`` as in ``depcomm_volume``."""
    r1, r2 = remote if remote is not None else (ideal_remote(m),) * 2
    row = mail_bytes + mem_bytes
    return n1 * (1 - eta1) * row * 2 * r1, n2 * (1 - eta2) * row * 2 * r2


def sven_beats_depcache(t: float, m: int) -> bool:
    """Eq. (10): with the redundancy-free dispatch ``t`` times the aggregation's vertices
    (N1 (1 - eta1) = T N2 (1 - eta2)), eq. (9) moves less than eq. (7) when ``M > T + 2``."""
    return m > t + 2


def per_trainer(volume: float, m: int) -> float:
    """One trainer's bytes in its busier direction, of a ``volume`` above moved evenly by ``m``
    trainers: each byte is counted sent and received (the factor 2), over m trainers."""
    return volume / (2 * m)


@dataclass(frozen=True)
class TrainerRows:
    """What one trainer's iteration moves, for a store's ``traffic``: ``rows_sampled`` node
    occurrences its batch samples (so N1 = m ``rows_sampled`` for a group of m), ``rows_distinct``
    of them distinct (N1 (1 - eta1) = m ``rows_distinct``), ``roots_distinct`` distinct roots it
    writes (N2 (1 - eta2) = m ``roots_distinct``); ``row_bytes`` a node's memory and mails with
    their times, ``mem_bytes`` its memory and time alone, ``grad_mem_bytes`` the gradient of a
    memory row; ``remote`` the share of rows another trainer of the group owns (``ideal_remote``
    for the paper's balance, a placement's measure otherwise)."""

    rows_sampled: float
    rows_distinct: float
    roots_distinct: float
    row_bytes: float
    mem_bytes: float
    grad_mem_bytes: float
    remote: float

    @property
    def mail_bytes(self) -> float:
        return self.row_bytes - self.mem_bytes
