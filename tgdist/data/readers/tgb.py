"""``tgb``: a TGB link-prediction data set (``data=tgb data.name=tgbl-...``), its files under
``data.root`` as TGB downloads them, read by ``tgdist.data.tgb`` with TGB's split; no path."""

from __future__ import annotations

from tgdist.data import tgb
from tgdist.data.readers import Reader, register


@register
class TGB(Reader):
    name = "tgb"
    describes = "a TGB data set"
    takes_path = False
    from_config = True
    carries_protocol = True  # TGB's split and its negatives for the val and test events

    def check(self, cfg) -> None:
        tgb.check_name(cfg.name)
        if not cfg.download:
            tgb.check_files(cfg.name, tgb.root_of(cfg))

    def load(self, cfg):
        if cfg.download and tgb.missing(tgb.files(cfg.name, tgb.root_of(cfg))) is not None:
            tgb.fetch(cfg.name, tgb.root_of(cfg))
        return tgb.read(cfg.name, tgb.root_of(cfg), cache=cfg.cache, cache_dir=cfg.cache_dir)
