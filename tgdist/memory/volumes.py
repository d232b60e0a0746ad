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
