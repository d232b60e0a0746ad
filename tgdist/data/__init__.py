"""Event streams as temporal graphs: readers, the T-CSR and samplers, splits, the on-disk cache
and the synthetic generator (``tgdist data`` is ``tgdist.cli.data``). Imports only
``tgdist.kernels``, ``tgdist.checksum`` and ``tgdist.errors``."""
