"""The built-in models, TGN, JODIE and APAN: each is the parts of ``modules.py`` it is given
(STYLE.md 5) and the capabilities the run reads from its class (``registry.ModelSpec``)."""

from __future__ import annotations

from tgdist.models.modules import (
    AttentionEmbedding,
    GRUUpdater,
    IdentityEmbedding,
    MailboxAttentionUpdater,
    RNNUpdater,
    TemporalModel,
    TimeProjectionEmbedding,
)
from tgdist.models.registry import ModelSpec, register


@register("tgn")
class TGN(ModelSpec):
    """A GRU memory updater and ``num_layers`` temporal attention layers over as many hops of
    sampled neighbours (two: TGAT-style, ``model=tgat2``, whose inner embeddings may be cached)."""

    neighbour_hops = None
    max_layers = 2
    embedding_cache = True

    @classmethod
    def build(cls, *, num_nodes, mem_dim, time_dim, edge_dim, node_dim, num_layers, num_heads, dropout,
              mailbox_size, static_memory, time_scale):
        mail_dim = 2 * mem_dim + edge_dim
        return TemporalModel(num_nodes, mem_dim, edge_dim, node_dim, GRUUpdater(mem_dim, mail_dim, time_dim),
                             AttentionEmbedding(mem_dim, edge_dim, time_dim, num_layers, num_heads, dropout),
                             1, static_memory)


@register("jodie")
class JODIE(ModelSpec):
    """A tanh RNN memory updater and the time projection of the memory: no neighbours, no
    attention; the projection's time gaps are divided by the data's time scale."""

    neighbour_hops = 0
    uses_time_scale = True
    attention_heads = False

    @classmethod
    def build(cls, *, num_nodes, mem_dim, time_dim, edge_dim, node_dim, num_layers, num_heads, dropout,
              mailbox_size, static_memory, time_scale):
        mail_dim = 2 * mem_dim + edge_dim
        return TemporalModel(num_nodes, mem_dim, edge_dim, node_dim, RNNUpdater(mem_dim, mail_dim, time_dim),
                             TimeProjectionEmbedding(mem_dim, time_scale), 1, static_memory)


@register("apan")
class APAN(ModelSpec):
    """Attention over a mailbox of ``mailbox_size`` mails, the memory as the embedding, and each
    event's mails delivered to one hop of sampled neighbours."""

    neighbour_hops = 1
    delivers_to_neighbours = True
    mailbox = True

    @classmethod
    def build(cls, *, num_nodes, mem_dim, time_dim, edge_dim, node_dim, num_layers, num_heads, dropout,
              mailbox_size, static_memory, time_scale):
        mail_dim = 2 * mem_dim + edge_dim
        return TemporalModel(num_nodes, mem_dim, edge_dim, node_dim,
                             MailboxAttentionUpdater(mem_dim, mail_dim, time_dim, num_heads), IdentityEmbedding(),
                             mailbox_size, static_memory, deliver_to_neighbors=True)
