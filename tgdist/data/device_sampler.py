"""The recent sampler as tensor operations on the trainer's device (issue 53).

``TemporalSampler`` runs numba kernels on the host: on a GPU every batch then waits for the host
to sample, organise and upload its tables, and evaluation with 49 negatives a event (50 roots an
event, ten neighbours each) spends most of its time there. ``DeviceSampler`` keeps the T-CSR on
the device and finds each root's latest neighbours with two ``searchsorted`` calls and a gather:
fixed-size ``[num_roots, K]`` tables, no value read back, no upload but the batch's roots.

Each root ``u`` at time ``t`` needs the entries of ``u``'s segment with a time below ``t``. The
T-CSR is sorted by (node, time), so one key per entry, ``node * span + rank(time)`` (``rank``: the
time's position among the distinct times, ``span`` their count plus one), is ascending over the
whole array, and ``searchsorted(key, u * span + rank(t))`` is the end of ``u``'s entries before
``t``, where ``rank(t)`` counts the distinct times below ``t``: an entry's time is below ``t``
exactly when its rank is below ``rank(t)``. The latest ``K`` are the positions before that end
that are still in ``u``'s segment, newest first: what ``kernels.sample_recent`` writes, slot for
slot (``tests/runtime/test_device_sampler.py`` compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tgdist.data.sampler import TCSR


@dataclass
class DeviceHop:
    """One hop of sampled neighbours on the device, ``[num_roots, K]`` each: as ``SampledHop``
    (``nbr`` and ``eid`` -1, ``t`` 0 and ``dt`` 0 where ``mask`` is False)."""

    nbr: torch.Tensor
    eid: torch.Tensor
    t: torch.Tensor
    mask: torch.Tensor
    dt: torch.Tensor


class DeviceSampler:
    """``fanouts[l]`` latest neighbours per root at each hop (``sampler.strategy=recent``), as
    tensor operations on ``device``. Hop l+1's roots are hop l's neighbours at their event's time,
    as ``TemporalSampler``'s; a root below 0 (an empty slot of the previous hop) gets an empty row."""

    def __init__(self, tcsr: TCSR, fanouts: list[int], device: torch.device | str):
        dev = torch.device(device)
        times = torch.from_numpy(np.array(tcsr.t))  # a copy: a mapped graph's arrays are read-only
        distinct = torch.unique(times)  # ascending
        self.span = distinct.numel() + 1
        num_nodes = tcsr.indptr.shape[0] - 1
        if num_nodes * self.span >= 2 ** 62:  # the keys are int64
            raise ValueError(f"the device sampler's keys overflow: {num_nodes:,} nodes x {self.span:,} distinct times")
        indptr = torch.from_numpy(np.array(tcsr.indptr, dtype=np.int64))
        node = torch.repeat_interleave(torch.arange(num_nodes, dtype=torch.int64), indptr.diff())
        key = node * self.span + torch.searchsorted(distinct, times)
        self.fanouts = [int(k) for k in fanouts]
        self.device = dev
        self.distinct, self.key, self.indptr = distinct.to(dev), key.to(dev), indptr.to(dev)
        self.nbr = torch.from_numpy(np.array(tcsr.nbr, dtype=np.int64)).to(dev)
        self.eid = torch.from_numpy(np.array(tcsr.eid, dtype=np.int64)).to(dev)
        self.t = times.to(dev)
        # empty slots read entry 0; a graph without entries gets one of its own (masked everywhere)
        if self.nbr.numel() == 0:
            self.nbr, self.eid = (torch.full((1,), -1, dtype=torch.int64, device=dev) for _ in range(2))
            self.t = torch.zeros(1, dtype=times.dtype, device=dev)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.distinct, self.key, self.indptr, self.nbr, self.eid,
                                                          self.t))

    def sample(self, roots: torch.Tensor, root_t: torch.Tensor) -> list[DeviceHop]:
        """``roots`` int64 ``[num_roots]`` and ``root_t`` (the graph's time dtype) on the device."""
        hops = []
        for k in self.fanouts:
            hop = self.hop(roots, root_t, k)
            hops.append(hop)
            roots, root_t = hop.nbr.reshape(-1), hop.t.reshape(-1)
        return hops

    def hop(self, roots: torch.Tensor, root_t: torch.Tensor, k: int) -> DeviceHop:
        u = roots.clamp(min=0)
        end = torch.searchsorted(self.key, u * self.span + torch.searchsorted(self.distinct, root_t))
        pos = end.unsqueeze(1) - 1 - torch.arange(k, device=roots.device)  # newest first
        mask = (pos >= self.indptr.index_select(0, u).unsqueeze(1)) & (roots >= 0).unsqueeze(1)
        at = pos.clamp(min=0).reshape(-1)
        nbr = torch.where(mask, self.nbr.index_select(0, at).view(pos.shape), -1)
        eid = torch.where(mask, self.eid.index_select(0, at).view(pos.shape), -1)
        t = torch.where(mask, self.t.index_select(0, at).view(pos.shape), 0)
        dt = torch.where(mask, (root_t.unsqueeze(1) - t).to(torch.float32), 0.0)
        return DeviceHop(nbr, eid, t, mask, dt)
