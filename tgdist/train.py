"""``tgdist train`` / ``python -m tgdist.train``: compose the config, build, train, report.

The final JSON summary is the last line of stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import tgdist.config  # noqa: F401  (registers the typed schema before Hydra composes)
from tgdist.config import config_dir, precheck_overrides
from tgdist.errors import TgdistError

# Files a run directory holds before any training happened; such a directory is removed when the
# run fails at start-up, so bad input leaves nothing behind.
_STARTUP_ONLY = {"train.log", ".hydra", "config.yaml"}


def _remove_if_empty_run(run_dir: Path) -> None:
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= _STARTUP_ONLY:
        shutil.rmtree(run_dir, ignore_errors=True)


@hydra.main(version_base=None, config_path=config_dir(), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from tgdist.runtime.run import run

    from tgdist.launcher.world import detect

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = detect().rank
    try:
        summary = run(cfg, run_dir)
    except TgdistError as e:
        _remove_if_empty_run(run_dir)
        print(f"tgdist train{f' [rank {rank}]' if rank else ''}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == 0:
        print(json.dumps(summary), flush=True)
    elif Path(summary["run_dir"]).resolve() != run_dir.resolve():
        _remove_if_empty_run(run_dir)  # rank 0's run directory holds the results


def main() -> None:
    precheck_overrides("tgdist train", "train", sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
