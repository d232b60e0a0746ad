"""Event streams as temporal graphs: readers, the T-CSR and samplers, splits, the on-disk cache,
the synthetic generator and ``tgdist data``. Imports only ``tgdist.kernels`` and ``tgdist.errors``."""
