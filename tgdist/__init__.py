"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

import os as _os

# OpenMP worker threads (numba's sampler and torch share one libgomp) sleep between parallel regions
# instead of spinning. libgomp reads this once, when it loads, so it is set here, before torch or a
# numba parallel kernel can load it; an explicit user setting wins. On a shared 2-core machine with
# one core busy, 2-thread 2-hop sampling measured ~75k events/s spinning vs ~480k sleeping
# (benchmarks/BENCHMARKS.md, "Sampler and data").
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
