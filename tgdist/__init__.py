"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

# OpenMP's wait policy is left at the runtime's default (spinning). OMP_WAIT_POLICY=PASSIVE helps
# only on an oversubscribed machine and costs a third of training speed when the cores are free,
# because every torch op then wakes sleeping threads: README, "Threads", and benchmarks/BENCHMARKS.md,
# "OpenMP wait policy".

__version__ = "0.1.0"
