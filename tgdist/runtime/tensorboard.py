"""``train.tensorboard=true``: every metrics line of a run also as TensorBoard scalars, for those
who watch runs live (``tensorboard --logdir RUN_DIR/tensorboard``). Rank 0 writes, one step per
epoch, through ``torch.utils.tensorboard`` (the ``tensorboard`` package, extra ``tensorboard``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["TensorBoardLog", "missing"]


def missing() -> str | None:
    """Why ``train.tensorboard=true`` cannot write here, or None."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return "train.tensorboard=true needs the tensorboard package: pip install 'tgdist[tensorboard]'"
    return None


def scalars(line: dict) -> dict[str, float]:
    """The tags and values of one metrics line: ``val/ap``, ``test/mrr``, ``train/loss``,
    ``train/events_per_s``, ``train/events`` (a ``train_*`` key), ``stage_seconds/compute``... (the epoch is the step, not a scalar)."""
    out = {}
    for key, value in line.items():
        if key == "epoch":
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            split, _, rest = key.partition("_")
            out[f"{split}/{rest}" if split in ("val", "test", "train") else f"train/{key}"] = float(value)
    return out


class TensorBoardLog:
    """A run's event file under ``RUN_DIR/tensorboard``, flushed after every line. ``fresh``: the
    event files of an earlier run in the same directory go (a resumed run keeps them: its steps
    continue theirs)."""

    def __init__(self, run_dir: Path, fresh: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(run_dir) / "tensorboard"
        if fresh and folder.is_dir():
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, line: dict) -> None:
        for tag, value in scalars(line).items():
            self.writer.add_scalar(tag, value, global_step=int(line["epoch"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
