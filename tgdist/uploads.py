"""Host arrays to the compute device without the host waiting for it (issue 53, point 5).

A copy from pageable host memory to a GPU is made by torch as a copy followed by a synchronisation
of the stream: the host waits until the device has run everything queued before it, so every
upload of a step's index tables cost a round trip. ``upload`` copies the array into pinned memory
first and queues the copy ``non_blocking``: the host goes on at once and the stream orders the
copy before the kernels that read it. torch's caching host allocator keeps the pinned buffer until
the copy has run, so the buffer may be dropped at once. On the CPU (and on the tests' shim device)
it is ``.to(device)``, a no-op on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``a`` (a NumPy array or a host tensor) on ``device``, queued without waiting."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if torch.device(device).type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
