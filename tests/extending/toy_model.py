"""A model registered from outside the package (``TGDIST_PLUGINS=tests.extending.toy_model``):
TGN's GRU memory updater with a plain linear map of the updated memory as its embedding, no
neighbours. It is the whole of what a new model needs (docs/architecture.md, "A model"): this
one module. Each build and each embedding call appends a line to the file ``$TOY_MODEL_CALLS``
(when set), so a test can tell the toy really trained."""

from __future__ import annotations

import os

from torch import nn

from tgdist.models import ModelSpec, register
from tgdist.models.modules import GRUUpdater, TemporalModel


def _note(what: str) -> None:
    path = os.environ.get("TOY_MODEL_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


class LinearEmbedding(nn.Module):
    """h(root) = W s'(root) + b: the updated memory of each root through one linear layer."""

    num_hops = 0

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        _note("embed")
        return self.linear(x.h.index_select(0, x.root))


@register("toy")
class Toy(ModelSpec):
    """No neighbours (``sampler.fanouts`` unread), no attention heads, one node's latest mail."""

    neighbour_hops = 0
    attention_heads = False

    @classmethod
    def build(cls, *, num_nodes, mem_dim, time_dim, edge_dim, node_dim, num_layers, num_heads, dropout,
              mailbox_size, static_memory, time_scale):
        _note("build")
        return TemporalModel(num_nodes, mem_dim, edge_dim, node_dim, GRUUpdater(mem_dim, 2 * mem_dim + edge_dim, time_dim),
                             LinearEmbedding(mem_dim), 1, static_memory)
