"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

# OpenMP's wait policy is left at the runtime's default. OMP_WAIT_POLICY=PASSIVE helps only on an
# oversubscribed machine (sampling: ~48k -> ~263k events/s with one core busy elsewhere), and costs
# a third of training speed when the cores are free (TGN on Wikipedia, batch 600: 11,076 ->
# 7,187 events/s), because every torch op then wakes sleeping threads. See README, "Performance".

__version__ = "0.1.0"
