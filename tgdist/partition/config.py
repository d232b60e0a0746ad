"""Typed schema of ``tgdist partition`` (registered with Hydra's ConfigStore by ``register_schemas``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tgdist.config import DataConfig, SamplerConfig, register


@dataclass
class PartitionConfig:
    """How node memory is assigned to trainers (Sven 3.1.2) and where the artifact goes.

    Batches: a global batch of ``batch_size`` events is split chronologically into ``num_parts``
    chunks, chunk t going to trainer t (mini-batch parallelism, DESIGN.md); the model's sampling
    comes from ``sampler`` (fanouts ``[K] * L``).
    """

    method: str = "reflexbicut"  # range | interval | reflexbicut | greedy
    num_parts: int = 8  # M, the trainers that share node memory
    batch_size: int = 1200  # global batch (events); trainer t gets its t-th chronological chunk
    num_neg: int = 1  # negative destinations per event (roots too)
    neighbors: bool = True  # false for models that read no neighbour memory (JODIE): roots only
    weights: str = "dedup"  # what Re-FlexBiCut / greedy balance: dedup (once per batch) | raw
    imbalance: float = 0.05  # a trainer owns at most ceil((1 + imbalance) N / M) vertices
    seed: int = 0  # negatives and tie-breaking
    tolerance: float = 0.001  # relative bracket at which the binary search on the load bound stops
    per_batch: bool = True  # also measure each batch's all-to-all (memory: one id per unique access)
    plot: bool = True  # residual heatmap PNG (needs matplotlib, the `plot` extra)
    out_dir: Optional[str] = None  # null: partitions/<data.name>-<method>-M<num_parts>
    overwrite: bool = False  # replace an existing artifact directory
    progress: bool = True  # progress lines on stderr


@dataclass
class PartitionJob:
    """The whole ``tgdist partition`` config: which data, how the model samples, how to partition."""

    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)


def register_schemas() -> None:
    """Register the schemas the YAML under ``configs/`` refers to (idempotent)."""
    register("partition_job_schema", PartitionJob)
    register("partition_schema", PartitionConfig, group="partition")
