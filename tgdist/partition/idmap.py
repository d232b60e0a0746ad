"""Dual-hash id maps (Sven 4.1, Fig. 10): global id -> trainer (lambda_1), global id -> local slot
(lambda_2), and each trainer's local slot -> global id.

Global ids are dense (0..N-1, ``TemporalGraph`` remaps them), so each "hash map" is a plain array
indexed by the id: a perfect hash with O(1), vectorised lookups for a whole batch of ids, in NumPy
or torch (on the ids' device). Local slots follow Sven's construction: the global ids that share a
trainer are gathered in increasing order, and a vertex's slot is its rank among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

from tgdist.errors import ConfigError

Ids = Union[np.ndarray, torch.Tensor]


@dataclass
class DualHashMap:
    """``trainer_of`` (lambda_1) and ``local_of`` (lambda_2): int64 ``[num_nodes]``;
    ``offsets`` int64 ``[num_parts + 1]`` and ``global_of`` int64 ``[num_nodes]``: trainer j's
    vertices, by local slot, are ``global_of[offsets[j]:offsets[j + 1]]`` (increasing global ids).
    """

    trainer_of: np.ndarray
    local_of: np.ndarray
    offsets: np.ndarray
    global_of: np.ndarray
    _torch: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_assignment(cls, owner: np.ndarray, num_parts: int) -> "DualHashMap":
        """Build the maps from ``owner[v]`` in ``[0, num_parts)``; O(N) after a stable sort."""
        owner = np.ascontiguousarray(owner, dtype=np.int64)
        if owner.ndim != 1:
            raise ConfigError(f"an assignment is one trainer per vertex, got shape {owner.shape}")
        if num_parts < 1:
            raise ConfigError(f"num_parts must be >= 1, got {num_parts}")
        if owner.size and (owner.min() < 0 or owner.max() >= num_parts):
            raise ConfigError(f"assignment values must lie in [0, {num_parts}), found {owner.min()}..{owner.max()}")
        global_of = np.argsort(owner, kind="stable").astype(np.int64)  # by trainer, then by global id
        offsets = np.zeros(num_parts + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=num_parts), out=offsets[1:])
        local_of = np.empty_like(owner)
        local_of[global_of] = np.arange(owner.size, dtype=np.int64) - offsets[owner[global_of]]
        return cls(owner, local_of, offsets, global_of)

    @property
    def num_nodes(self) -> int:
        return int(self.trainer_of.shape[0])

    @property
    def num_parts(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def sizes(self) -> np.ndarray:
        """int64 ``[num_parts]``: how many node memories each trainer stores."""
        return np.diff(self.offsets)

    def globals_of(self, trainer: int) -> np.ndarray:
        """lambda_2^-1 of one trainer: its global ids by local slot, int64 ``[sizes()[trainer]]`` (a view)."""
        if not 0 <= trainer < self.num_parts:
            raise ConfigError(f"trainer {trainer} out of range [0, {self.num_parts})")
        return self.global_of[self.offsets[trainer]:self.offsets[trainer + 1]]

    def _arrays(self, ids: Ids):
        if isinstance(ids, torch.Tensor):
            key = str(ids.device)
            if key not in self._torch:
                self._torch[key] = tuple(torch.from_numpy(a).to(ids.device) for a in
                                         (self.trainer_of, self.local_of, self.offsets, self.global_of))
            return self._torch[key]
        return self.trainer_of, self.local_of, self.offsets, self.global_of

    def lookup(self, ids: Ids) -> tuple[Ids, Ids]:
        """``(trainer, local)`` of a batch of global ids, same shape and library as ``ids``."""
        trainer_of, local_of, _, _ = self._arrays(ids)
        return trainer_of[ids], local_of[ids]

    def trainer(self, ids: Ids) -> Ids:
        """lambda_1 for a batch of global ids."""
        return self._arrays(ids)[0][ids]

    def local(self, ids: Ids) -> Ids:
        """lambda_2 for a batch of global ids (each id's slot on the trainer that owns it)."""
        return self._arrays(ids)[1][ids]

    def to_global(self, trainer: Ids, local: Ids) -> Ids:
        """The inverse: global ids of ``(trainer, local slot)`` pairs (same shapes, same library)."""
        _, _, offsets, global_of = self._arrays(local)
        return global_of[offsets[trainer] + local]

    def check(self) -> None:
        """Raise ConfigError unless the maps are mutually consistent (used when loading an artifact)."""
        n, m = self.num_nodes, self.num_parts
        ok = (self.local_of.shape == (n,) and self.global_of.shape == (n,) and self.offsets[0] == 0
              and self.offsets[-1] == n and np.all(np.diff(self.offsets) >= 0))
        if ok and n:
            ok = self.trainer_of.min() >= 0 and self.trainer_of.max() < m
            ok = ok and bool(np.all((self.local_of >= 0) & (self.local_of < self.sizes()[self.trainer_of])))
            ok = ok and np.array_equal(self.global_of[self.offsets[self.trainer_of] + self.local_of], np.arange(n))
        if not ok:
            raise ConfigError("partition maps are inconsistent "
                              "(lambda_2 is not the inverse of the local -> global map)")
