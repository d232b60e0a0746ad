"""Where a trainer reads edge and node features from, and its times relative to the first event.

A mapped graph (``tgdist.data.mapped``) holds its features in a read-only file map shared by every
process of the machine. On the CPU the trainer gathers a batch's rows straight from that map (a
torch tensor over the mapped pages: no private copy). On a GPU the whole table is copied to the
device when it fits (the fast path: a gather on the device); otherwise it stays in the map and
each batch's rows are gathered on the host into pinned memory and copied over (``HostRows``).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

log = logging.getLogger(__name__)

# A table goes to the GPU when it takes at most this share of the device's free memory.
DEVICE_SHARE = 0.5


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A torch view of a NumPy array, read-only ones (maps) included: torch warns that it cannot
    protect such memory from writes; tgdist never writes features."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class HostRows:
    """A feature table left in host memory (a map) for a GPU trainer: ``index_select`` and indexing
    gather the rows on the host into a pinned buffer and copy them to ``device``."""

    def __init__(self, table: torch.Tensor, device: torch.device):
        self.table, self.device = table, device
        self.shape, self.dtype = table.shape, table.dtype

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        rows = torch.index_select(self.table, dim, index.cpu())
        if self.device.type != "cuda":  # (tests drive it on the CPU)
            return rows.to(self.device)
        return rows.pin_memory().to(self.device, non_blocking=True)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return self.index_select(0, index.reshape(-1)).reshape(*index.shape, *self.shape[1:])


def stays_on_host(a: np.ndarray | None, device: torch.device) -> bool:
    """Whether a GPU trainer leaves the feature table ``a`` in host memory (``HostRows``): it
    takes more than ``DEVICE_SHARE`` of the device's free memory."""
    if a is None or torch.device(device).type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return a.nbytes > DEVICE_SHARE * free


def feature_table(a: np.ndarray | None, device: torch.device, what: str):
    """The table a trainer gathers rows of ``a`` from (None for no features)."""
    if a is None:
        return None
    table = host_tensor(a)
    if device.type != "cuda":
        return table
    if not stays_on_host(a, device):
        return table.to(device)
    free, _ = torch.cuda.mem_get_info(device)
    log.info("%s features (%.1f GiB) stay in host memory (the device has %.1f GiB free): each batch's rows are "
             "gathered into pinned memory", what, a.nbytes / 2**30, free / 2**30)
    return HostRows(table, device)


class RelativeTimes:
    """Event times as float64 seconds since the first event, computed per slice when asked: a
    mapped stream's times stay in the map (a table of all of them would be 8 bytes per event per
    process). Element by element the same values as converting the whole array."""

    def __init__(self, t: np.ndarray, units_per_second: float):
        self.t, self.units_per_second = t, float(units_per_second)
        self.t0 = t[0] if t.shape[0] else t.dtype.type(0)

    def __getitem__(self, key):
        dt = np.asarray(self.t[key] - self.t0).astype(np.float64)
        dt = dt if self.units_per_second == 1.0 else dt / self.units_per_second
        return dt if dt.ndim else dt[()]

    def __len__(self) -> int:
        return int(self.t.shape[0])
