"""Node memory stores behind one interface (DESIGN.md "Memory stores"), chosen by name from a
registry (``registry``): ``store`` (the interface, ``MemoryRead`` and the in-process
``LocalMemory``), ``depcache`` (Sven's DepCache replicas), ``daemon`` (DistTGL's memory daemon and
its client, over ``shm``'s shared-memory segments), ``sven`` and ``depcomm`` (memory partitioned
among a group's trainers, placed by ``placement``). A new backend is one module that registers its
factory and class (``register(name, Class)``), whose capability attributes say what the run and
its validation may do with it, and one file in ``configs/memory/``."""

from tgdist.memory.registry import STORES, StoreContext, create, names, register, resolve, store_class

__all__ = ["STORES", "StoreContext", "create", "names", "register", "resolve", "store_class"]
