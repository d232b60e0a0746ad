"""``tgdist train`` / ``python -m tgdist.train``: compose the config, build, train, report.

The final JSON summary is the last line of stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import json
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import tgdist.config  # noqa: F401  (registers the typed schema before Hydra composes)
from tgdist.config import config_dir
from tgdist.errors import TgdistError


@hydra.main(version_base=None, config_path=config_dir(), config_name="train")
def main(cfg: DictConfig) -> None:
    from tgdist.runtime.run import run

    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except TgdistError as e:
        print(f"tgdist train: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
