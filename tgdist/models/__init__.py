"""M-TGNN building blocks (updaters, embeddings, predictors, ``modules``) and the models made of
them, by name (``registry``: ``register``, ``model_class``, ``ModelSpec``; the built-in TGN, JODIE
and APAN in ``zoo``). A new model is one module: a ``ModelSpec`` subclass registered under the name
``model.name`` gives, whose ``build`` assembles the parts and whose attributes say what it reads."""

from tgdist.models.registry import MODELS, ModelSpec, model_class, names, register, unregister
from tgdist.models import zoo  # noqa: F401,E402  (the built-in models register themselves on import)

__all__ = ["MODELS", "ModelSpec", "model_class", "names", "register", "unregister"]
