"""Pipelines: strategies of the one loop, chosen by ``pipeline.mode`` from a registry
(DESIGN.md "Pipelines"). ``base`` holds the hooks every strategy gives the loop and the levels any
strategy may switch on (prefetch, asynchronous all-reduce); ``plain`` is the plain loop with
Sven's levels, micro-batches among them; ``mspipe`` is MSPipe's stage pipeline with its staleness
bound. A new strategy is one module that registers its ``Pipeline`` subclass (``registry.register``)
and one file in ``configs/pipeline/``."""

from tgdist.runtime.pipelines.base import GradientHooks, Pipeline, PipelineContext, StepHooks, count_of
from tgdist.runtime.pipelines.registry import names, pipeline_class, register
# the built-in strategies register themselves, the plain loop first (the options are named in this order)
from tgdist.runtime.pipelines import plain  # noqa: E402,F401,I001
from tgdist.runtime.pipelines import mspipe  # noqa: E402,F401,I001
from tgdist.runtime.pipelines.plain import fit_eta, micro_count  # noqa: E402  (eq. (12)'s, which the advisor prices with)

__all__ = ["GradientHooks", "Pipeline", "PipelineContext", "StepHooks", "count_of", "names", "pipeline_class",
           "register", "create", "fit_eta", "micro_count"]


def create(ctx: PipelineContext) -> Pipeline:
    """The strategy ``ctx.cfg.pipeline.mode`` names, for this rank."""
    return pipeline_class(ctx.cfg.pipeline.mode)(ctx)
