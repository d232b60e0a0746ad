"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

__version__ = "0.1.0"
