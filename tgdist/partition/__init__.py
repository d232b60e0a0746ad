"""Node-memory partitioning across trainers (Sven 3.1.2 and 4.1).

Pre-sample an epoch into a trainer-vertex access graph (``access``), assign vertices to trainers by
range, interval, Re-FlexBiCut or a greedy baseline (``methods``), measure the all-to-all each
assignment causes (``measures``), and save it as dual-hash id maps in an artifact directory
(``idmap``, ``artifact``) that the memory backends load. ``tgdist partition`` runs it all.
"""

from tgdist.partition.access import AccessGraph, build_access_graph, from_weights
from tgdist.partition.artifact import Partition, load, save
from tgdist.partition.idmap import DualHashMap
from tgdist.partition.measures import balance_cost, comm_matrix, evaluate, lower_bound, residual
from tgdist.partition.methods import (METHODS, assign, capacity, greedy_partition, interval_partition,
                                      range_partition, reflexbicut_search)

__all__ = ["AccessGraph", "build_access_graph", "from_weights", "Partition", "load", "save", "DualHashMap",
           "balance_cost", "comm_matrix", "evaluate", "lower_bound", "residual", "METHODS", "assign", "capacity",
           "greedy_partition", "interval_partition", "range_partition", "reflexbicut_search"]
