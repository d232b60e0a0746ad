"""``synthetic``: the seeded generator of ``tgdist.data.synthetic`` (``data.synthetic.*``), no file.
With ``data.cache`` (the default) the stream is generated once per machine into a mapped cache
entry keyed by the generator's parameters, which every rank then maps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tgdist.data import cache
from tgdist.data.readers import Reader, register
from tgdist.errors import ConfigError


@register
class Synthetic(Reader):
    name = "synthetic"
    describes = "the seeded generator"
    takes_path = False
    from_config = True

    def check(self, cfg) -> None:
        if cfg.columns is not None:
            raise ConfigError(f"data.columns={cfg.columns!r} names the fields of an edge list; data.format=synthetic "
                              f"reads no file: leave data.columns unset")

    def load(self, cfg):
        from tgdist.data.synthetic import generate  # numba's start-up: paid by the runs that generate only

        params = vars(cfg.synthetic) if not hasattr(cfg.synthetic, "_metadata") else dict(cfg.synthetic)
        if not cfg.cache:
            return generate(**params)
        key = hashlib.blake2b(json.dumps({"v": cache.CACHE_VERSION, "synthetic": params}, sort_keys=True).encode(),
                              digest_size=16).hexdigest()
        folder = Path(cfg.cache_dir or cache.default_cache_dir()) / f"synthetic-{key}"
        return cache.cached_graph(folder, lambda: (generate(**params), []))
