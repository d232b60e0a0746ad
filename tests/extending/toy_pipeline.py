"""A toy pipeline strategy registered from outside tgdist (``TGDIST_PLUGINS=tests.extending.toy_pipeline``),
picked by ``pipeline.mode=toy``: the plain loop that counts its iterations into the file
``$TGDIST_TOY_PIPELINE_LOG`` (if set) and prices itself its own way for the advisor (every stage in
turn, nothing overlapped, whatever the levels, and a fixed ``OVERHEAD_S`` an iteration for its count)."""

from __future__ import annotations

import os

from tgdist.runtime.pipelines import register
from tgdist.runtime.pipelines.base import IterationCosts, Price
from tgdist.runtime.pipelines.plain import Plain


@register("toy")
class ToyPipeline(Plain):
    name = "toy"
    OVERHEAD_S = 0.001  # what its count costs an iteration, as it prices itself

    def __init__(self, ctx):
        super().__init__(ctx)
        self.iterations_seen = 0

    @classmethod
    def price(cls, pipe, c: IterationCosts) -> Price:
        return Price(c.sample + c.features + c.memory_read + c.dispatch + c.compute + c.memory_write + c.aggregation
                     + c.allreduce + c.collective_cpu + cls.OVERHEAD_S)

    def after_iteration(self, t: int, seconds: float) -> None:
        super().after_iteration(t, seconds)
        self.iterations_seen += 1
        if os.environ.get("TGDIST_TOY_PIPELINE_LOG"):
            with open(os.environ["TGDIST_TOY_PIPELINE_LOG"], "w") as f:
                f.write(f"{self.iterations_seen}\n")
