"""Where a run executes and how its processes are organised (DESIGN.md "Launch", "Parallel training").

- ``schedule``: the pure i x j x k schedule of DistTGL (which events, negatives, memory copy and
  write duty for every rank and iteration) and learning-rate scaling;
- ``world``: the launcher's environment read once (torchrun, srun, MPI or a single process), the
  layout checked against it, and the named process groups;
- ``collectives``: the collective helpers that count the bytes they send (the only callers of
  ``torch.distributed`` collectives), synchronous and asynchronous (``Handle``);
- ``link``: the simulated interconnect's pure cost model (``parallel.link``), which the
  collectives pay once a run installs it (``collectives.set_link``).

Importing this package does not import torch.
"""

from tgdist.distributed.schedule import Layout, Step, num_global_batches, num_iterations, scaled_lr, step
from tgdist.distributed.world import ProcessGroups, WorldInfo, detect, get_group, validate

__all__ = [
    "Layout",
    "Step",
    "num_global_batches",
    "num_iterations",
    "scaled_lr",
    "step",
    "ProcessGroups",
    "WorldInfo",
    "detect",
    "get_group",
    "validate",
]
