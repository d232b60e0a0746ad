"""Data, sampling, models, memory stores, trainer and pipelines."""
