"""The models by name (``model.name``): each model is a ``ModelSpec`` subclass registered here
(``@register("name")``; the package imports the built-in ones, ``zoo.py``, so importing this
module, which imports the package first, finds them registered). A model builds itself from the
parts of ``modules.py`` (``build``) and says on its class what the run may do with it: how many
hops of neighbours it samples, whether it delivers mails to them, whether it keeps a mailbox,
reads a time scale, stacks attention layers, allows the embedding cache or only some memory
stores. The validation, the trainer's build and the advisor read these attributes, never the
name (STYLE.md 15).

A model registered from outside the package (``tgdist.plugins``) becomes an option of
``model.name`` as the built-in ones are: ``register`` adds its name to the schema's
``ModelName``, which the config is checked against when it is composed.
"""

from __future__ import annotations

import re

from tgdist import plugins
from tgdist.config import ModelName
from tgdist.errors import ConfigError


class ModelSpec:
    """A model ``model.name`` can pick: its capabilities (class attributes) and ``build``.

    ``neighbour_hops``: the hops of temporal neighbours it samples (0: none, and
    ``sampler.fanouts`` may be empty); None: one per attention layer (``model.num_layers``).
    ``delivers_to_neighbours``: each event's mail also goes to the sampled neighbours of its
    nodes (APAN), in rounds the memory stores apply in order. ``mailbox``: it reads several mails
    per node (``model.mailbox_size``); otherwise each node keeps its latest mail.
    ``uses_time_scale``: its embedding reads the data's time scale (JODIE's median gap between a node's events).
    ``attention_heads``: it splits ``mem_dim`` into ``model.num_heads`` heads, which must divide
    it. ``max_layers``: the attention layers it can stack (``model.num_layers``).
    ``embedding_cache``: with two layers, its inner-layer embeddings may be cached (FreshGNN,
    ``cache.enabled``). ``stores``: the memory backends it runs with (None: every registered one).
    """

    name: str = ""  # set by ``register``
    neighbour_hops: int | None = 1
    delivers_to_neighbours: bool = False
    mailbox: bool = False
    uses_time_scale: bool = False
    attention_heads: bool = True
    max_layers: int = 1
    embedding_cache: bool = False
    stores: tuple[str, ...] | None = None

    @classmethod
    def samples_neighbours(cls) -> bool:
        """Whether a run of this model samples temporal neighbours at all."""
        return cls.neighbour_hops != 0

    @classmethod
    def num_hops(cls, num_layers: int) -> int:
        """The hops of neighbours sampled for ``num_layers`` attention layers."""
        return num_layers if cls.neighbour_hops is None else cls.neighbour_hops

    @classmethod
    def build(cls, *, num_nodes: int, mem_dim: int, time_dim: int, edge_dim: int, node_dim: int, num_layers: int,
              num_heads: int, dropout: float, mailbox_size: int, static_memory: bool, time_scale: float):
        """The ``TemporalModel`` of these sizes (``modules.build_model``'s arguments); a model
        uses those it reads (``time_scale`` is 1.0 unless the class reads one, ``uses_time_scale``)."""
        raise NotImplementedError


MODELS: dict[str, type[ModelSpec]] = {}  # name -> its class


def register(name: str):
    """Register a ``ModelSpec`` subclass under ``name``, the value of ``model.name`` that picks it."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", name):
        raise ConfigError(f"model name {name!r}: give a word of letters, digits, '_' or '-' (model.name=NAME)")

    def add(cls: type[ModelSpec]) -> type[ModelSpec]:
        if not (isinstance(cls, type) and issubclass(cls, ModelSpec)):
            raise ConfigError(f"model {name!r}: register a subclass of tgdist.models.ModelSpec, not {cls!r}")
        cls.name = name
        MODELS[name] = cls
        ModelName.add(name)  # an option of model.name from now on, checked when a config is composed
        return cls
    return add


def unregister(name: str) -> None:
    """Undo ``register`` (a test's model): ``model.name=name`` is refused again."""
    MODELS.pop(name, None)
    ModelName.drop(name)


def model_class(name: str) -> type[ModelSpec]:
    """The class of model ``name`` (its capabilities); an unknown name is a ``ConfigError``."""
    plugins.load()
    name = str(name)
    if name not in MODELS:
        raise ConfigError(f"model.name={name}: choose one of {', '.join(MODELS)}")
    return MODELS[name]


def names() -> list[str]:
    """The registered models, the built-in ones first, in the order they were registered."""
    plugins.load()
    return list(MODELS)
