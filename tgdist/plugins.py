"""Extensions from outside the package: a module that registers a memory store, a pipeline, a
model or a data reader with tgdist's registries is imported here, before a config is composed, so
its name is a choice like the built-in ones (``memory.backend=mine``).

Two ways to name such modules, both read once per process:
- the environment variable ``TGDIST_PLUGINS``: module names separated by commas
  (``TGDIST_PLUGINS=mylab.stores,mylab.models``); every process of a run inherits it, so the ranks
  that ``torchrun`` or ``srun`` start import them too;
- the entry points of the group ``tgdist.plugins`` of installed distributions
  (``[project.entry-points."tgdist.plugins"] mine = "mylab.stores"`` in a pyproject.toml).

A module that cannot be imported is one line naming it and the reason.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

from tgdist.errors import ConfigError

ENV = "TGDIST_PLUGINS"
GROUP = "tgdist.plugins"

_loaded: set[str] = set()


_entry_points: list[str] | None = None  # read once: the installed distributions do not change in a run


def names() -> list[str]:
    """The modules to import: those of ``TGDIST_PLUGINS``, then the entry points', in order."""
    global _entry_points
    if _entry_points is None:
        try:
            _entry_points = [ep.value.split(":", 1)[0].strip() for ep in metadata.entry_points(group=GROUP)]
        except Exception:  # a broken distribution's metadata: the environment variable still serves
            _entry_points = []
    out = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    return list(dict.fromkeys(out + _entry_points))


def load() -> list[str]:
    """Import every extension module not imported yet (cheap when there is none); returns their names."""
    for name in names():
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{ENV}/{GROUP}: cannot import extension module {name!r} ({e})") from None
        _loaded.add(name)
    return sorted(_loaded)
