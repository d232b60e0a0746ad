"""Training in three steps, for Python and for ``python -m tgdist.train`` (torchrun's entry point):
compose the config, run it (``tgdist.runtime.driver.run`` builds the run of any layout, trains,
evaluates and closes it in ``finally``), report the summary.

    from tgdist.train import train
    summary = train(["data=collegemsg", "model=jodie", "train.epochs=2"], run_dir="runs/jodie")

The command line (``tgdist train``: checks before Hydra starts, the run directory's ownership,
one-line errors, signals) is ``tgdist.cli.train``.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def train(config: list[str] | DictConfig, run_dir: str | Path | None = None) -> dict:
    """Train as ``config`` says (Hydra overrides, or a composed config) in ``run_dir`` (default:
    the config's ``run_dir``); returns the summary. Under torchrun / SLURM / MPI every rank calls
    it; rank 0's ``run_dir`` is the run's."""
    from tgdist.runtime.build import compose
    from tgdist.runtime.driver import run

    cfg = config if isinstance(config, DictConfig) else compose(list(config))
    return run(cfg, run_dir if run_dir is not None else cfg.run_dir)


def main() -> None:
    """``tgdist train`` (``tgdist.cli.train.main``)."""
    from tgdist.cli.train import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
