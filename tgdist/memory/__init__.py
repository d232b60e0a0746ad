"""Node memory stores behind one interface (DESIGN.md "Memory stores"): ``store`` (the interface,
``MemoryRead`` and the in-process ``LocalMemory``), ``daemon`` (DistTGL's memory daemon with its
client) over ``shm`` (shared-memory segments and doorbells)."""
