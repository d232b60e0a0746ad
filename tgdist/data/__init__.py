"""Event streams as temporal graphs: the graph type and split (``graph``), the readers of each
format behind a registry (``readers``), reading a source through its reader and the on-disk cache
(``load``, ``cache``, ``mapped``), the T-CSR and samplers, and the synthetic generator (``tgdist
data`` is ``tgdist.cli.data``). Imports only ``tgdist.kernels``, ``tgdist.checksum``,
``tgdist.errors``, ``tgdist.progress``, ``tgdist.plugins`` and the config schema (``load_data``
reads a ``DataConfig``)."""
