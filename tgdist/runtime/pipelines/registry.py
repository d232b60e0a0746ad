"""The pipelines by name (``pipeline.mode``): each strategy's module registers its class here
(``@register("name")``; the package imports the built-in ones, so importing this module, which
imports the package first, finds them registered). The run asks for one by the name its config
gives and never asks which it holds (DESIGN.md "Pipelines")."""

from __future__ import annotations

from tgdist import plugins
from tgdist.config import register_option
from tgdist.errors import ConfigError

PIPELINES: dict[str, type] = {}  # name -> Pipeline subclass
ALIASES: dict[str, str] = {}  # another name -> the name it stands for


def register(name: str, *aliases: str):
    """Register a ``Pipeline`` subclass under ``name`` (and ``aliases``: older names of it), with its
    config class (``cls.Config``: ``tgdist.config.PipelineConfig`` or a subclass holding the keys
    only it reads), which composition gives ``pipeline`` when ``pipeline.mode`` names it."""
    def add(cls):
        PIPELINES[name] = cls
        ALIASES.update(dict.fromkeys(aliases, name))
        for n in (name, *aliases):
            register_option("pipeline", n, getattr(cls, "Config", None))
        return cls
    return add


def pipeline_class(name: str) -> type:
    """The strategy ``pipeline.mode=name`` picks; another name is a ``ConfigError`` naming the options."""
    plugins.load()  # the extensions' strategies, as ``tgdist train`` sees them
    name = ALIASES.get(str(name), str(name))
    if name not in PIPELINES:
        raise ConfigError(f"pipeline.mode={name}: give one of {', '.join(names())}")
    return PIPELINES[name]


def names() -> list[str]:
    """The registered strategies, extensions included (``tgdist.plugins``)."""
    plugins.load()
    return list(PIPELINES)
