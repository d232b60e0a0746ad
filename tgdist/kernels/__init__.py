"""Numba kernels over plain arrays, each with a NumPy reference (``reference.py``) for the tests:
T-CSR filling, temporal sampling, Sven's organize (unique ids, Psi, Phi), the synthetic generator's
draws, fused attention and CPU ops with their autograd functions; the numba compile watch and
Ctrl-C holding (``jit``, ``interrupts``). The bottom layer: imports nothing else of tgdist but
``tgdist.errors``."""
