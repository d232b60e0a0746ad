"""Run directories: which directory a run may write into, and what it may remove again.

A run marks its directory with ``.tgdist-run`` (who made it, when) before anything else is written
there. A directory that holds files but no marker belongs to someone else: it is refused, unless
``train.overwrite=true`` says to write into it anyway. A run that ends without a result (bad input,
Ctrl-C before its first checkpoint) removes the entries it created, and the directory itself only
when it made the directory: a user's files, or the working directory given as ``run_dir=.``, are
never removed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tgdist import __version__
from tgdist.config.overrides import resumed_run_dir
from tgdist.errors import ConfigError

MARKER = ".tgdist-run"
# What a run writes into its directory. Only these are removed by clean-up, and only when this run
# created them: whatever else is there (a user's notes beside an old run) stays.
RUN_FILES = frozenset({MARKER, ".hydra", "train.log", "config.yaml", "metrics.jsonl", "summary.json", "checkpoints",
                       ".tgdist-restarts", ".tgdist-requeue"})

# This process's run, named in the markers it writes.
RUN_ID = uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Claim:
    """What a run found in its directory: whether it made the directory, and the entries that were
    there before (an earlier run's, a user's own with ``train.overwrite=true``)."""

    path: Path
    made: bool
    before: frozenset[str]
    # the run files an earlier run left (``snapshot``), put back by ``restore`` when this run is
    # refused before it trains: a resume refused inside the ranks rewrote config.yaml and .hydra/
    files: tuple = ()


# The directories this process claimed, by resolved path.
_claims: dict[Path, Claim] = {}


def is_run_dir(path: Path) -> bool:
    """True for a directory a tgdist run wrote: its marker, or (runs of tgdist before markers)
    Hydra's ``.hydra/config.yaml`` beside a ``train.log``."""
    return (path / MARKER).is_file() or ((path / ".hydra" / "config.yaml").is_file() and (path / "train.log").is_file())


def _is_marker(name: str) -> bool:
    """The marker, or one being written (``_write_marker``'s temporary name)."""
    return name == MARKER or (name.startswith(MARKER + ".") and name.endswith(".tmp"))


def foreign_entries(path: Path) -> list[str]:
    """The entries of an existing ``path`` that are not a tgdist run's (all of them, in a folder
    without a marker); empty for a missing or empty folder and for a run directory.

    The ranks of a parallel run all check the directory rank 0 is claiming, so this must hold
    while that claim (or its clean-up) is under way: a marker being written counts as the marker,
    a run writes its other files only after its marker, and ``release`` removes the marker last.
    The marker is looked for before the folder is listed, so a marker that appears between the
    two is not taken for a foreign file."""
    if is_run_dir(path):
        return []
    try:
        return sorted(name for p in path.iterdir() if not _is_marker(name := p.name))
    except (FileNotFoundError, NotADirectoryError):  # missing, or removed by a run's clean-up meanwhile
        return []


# What a run leaves that shows its results: ``train.overwrite=true`` removes these of an earlier run
# (its TensorBoard events and TGB scores too, never shown beside a new run's).
RESULT_FILES = frozenset({"summary.json", "metrics.jsonl", "checkpoints", "tensorboard", "scores"})


def held_run(path: Path) -> str | None:
    """``"finished"`` or ``"interrupted"`` when ``path`` holds a tgdist run's results (its summary,
    or its metrics or a checkpoint without one), else None: a run folder whose run left nothing
    (stopped before its first checkpoint) holds no run."""
    if not is_run_dir(path):
        return None
    if (path / "summary.json").is_file():
        return "finished"
    if (path / "metrics.jsonl").is_file() or _has_checkpoint(path / "checkpoints"):
        return "interrupted"
    return None


def _resumes(path: Path, resume: str | None) -> bool:
    """True when ``train.resume`` names the run in ``path`` (its folder or a checkpoint there)."""
    return bool(resume) and resumed_run_dir(resume) == path


def check_replace(path: Path, overwrite: bool, resume: str | None = None) -> None:
    """A run never replaces another in its folder: a ``ConfigError`` naming ``train.resume=`` and
    ``train.overwrite=true`` when ``path`` holds a finished or interrupted run that this one does
    not resume, unless ``overwrite`` (the run removes the old one's files with ``clear_old_run``
    once it has passed every check before training)."""
    path = Path(path).absolute()
    state = held_run(path)
    if overwrite or state is None or _resumes(path, resume):
        return
    article = "an" if state[0] in "aeiou" else "a"
    raise ConfigError(f"run_dir={path} holds {article} {state} tgdist run: continue it with {resume_override(path)}, "
                      f"or give train.overwrite=true to remove its files and start afresh there (or another run_dir)")


def clear_old_run(path: Path, resume: str | None = None) -> list[str]:
    """Remove the earlier run a run given ``train.overwrite=true`` replaces in ``path``, once the
    new run is past its checks (bad input leaves the old run whole): its results
    (``RESULT_FILES``), its lines at the head of ``train.log`` and its ``.hydra/`` where the new run
    has not rewritten them, and its marker, written anew. A user's own files stay. Returns the
    names removed."""
    path = Path(path).absolute()
    if held_run(path) is None or _resumes(path, resume):
        return []
    c = claimed(path)
    old = dict(c.files) if c is not None else {}
    removed = []
    for p in path.iterdir():
        if p.name in RESULT_FILES:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    hydra = sorted(n for n in old if n.startswith(".hydra/"))
    if hydra and all(isinstance(old[n], bytes) and (path / n).is_file() and (path / n).read_bytes() == old[n]
                     for n in hydra):  # the old run's own (a Python caller's run writes none)
        shutil.rmtree(path / ".hydra", ignore_errors=True)
        removed.append(".hydra")
    log_file, was = path / "train.log", old.get("train.log")
    if was is not None and log_file.is_file():  # the new run's lines follow the old run's: keep those alone
        size = len(was) if isinstance(was, bytes) else was  # (a long log's snapshot keeps its length only)
        text = log_file.read_bytes()
        if not isinstance(was, bytes) or text[:size] == was:
            log_file.write_bytes(text[size:])
    made = c.made if c is not None else False
    _write_marker(path, made)
    if c is not None:  # nothing of the old run is left to put back; the new run's files are its own
        _claims[path.resolve()] = Claim(c.path, c.made, c.before - RESULT_FILES - {"train.log", ".hydra"}, ())
    return sorted(removed)


def resume_override(run_dir: Path) -> str:
    """``train.resume=RUN_DIR`` as one shell word that Hydra reads back as the path: quoted for
    Hydra when the path holds more than plain characters (a space, a comma, brackets), then for
    the shell, so the hint can be pasted."""
    value = str(run_dir)
    if not re.fullmatch(r"[\w./+-]+", value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return shlex.quote(f"train.resume={value}")


def check_foreign(path: Path, overwrite: bool, key: str = "run_dir") -> None:
    """A ``ConfigError`` naming the files when ``path`` holds files that are not a tgdist run's,
    unless ``overwrite``."""
    if overwrite or not (names := foreign_entries(path)):
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ConfigError(f"{key}={path} holds files that are not a tgdist run's ({shown}); give a new or empty "
                      f"directory, or train.overwrite=true to write into it (its config.yaml, metrics.jsonl, "
                      f"summary.json, train.log and checkpoints/ would be replaced)")


def claim(path: str | Path, overwrite: bool = False, made: bool | None = None,
          before: frozenset[str] | None = None) -> Claim:
    """Take ``path`` for this process's run: refuse it when it holds another's files (unless
    ``overwrite``), make it, and write the marker if it has none. ``made``: the caller made the
    directory just before (a claimed default name); by default, whether it did not exist.
    ``before``: what the directory held before the caller's own writes (a sweep's job folder,
    checked with its sweep); by default, what it holds now. A directory claimed before by this
    process keeps its first claim."""
    path = Path(path).absolute()
    if (known := _claims.get(path.resolve())) is not None:
        return known
    exists = path.is_dir()
    if before is None:
        check_foreign(path, overwrite)
        before = frozenset(p.name for p in path.iterdir()) if exists and not made else frozenset()
    if made is None:
        made = not exists
    path.mkdir(parents=True, exist_ok=True)
    c = Claim(path, made, before, snapshot(path) if exists and not made else ())
    _claims[path.resolve()] = c
    if not (path / MARKER).exists():
        _write_marker(path, made)
    return c


def claimed(path: Path) -> Claim | None:
    return _claims.get(Path(path).absolute().resolve())


def _write_marker(path: Path, made: bool) -> None:
    info = {"tgdist": __version__, "run": RUN_ID, "made_dir": made, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = path / f"{MARKER}.{RUN_ID}.tmp"
    tmp.write_text(json.dumps(info) + "\n")
    os.replace(tmp, path / MARKER)


def release(path: Path) -> bool:
    """Remove what this process's run created in ``path`` when that is no result: the run files it
    created, then the directory if it made it and it is empty. A directory this process never
    claimed, or whose new entries include a result, is left as it is. True when ``path`` is gone."""
    c = claimed(path)
    if c is None or not c.path.is_dir():
        return c is not None and not c.path.exists()
    created = {p.name: p for p in c.path.iterdir() if p.name not in c.before}
    if set(created) - RUN_FILES:  # something else appeared: not ours to judge
        return False
    if "summary.json" in created or _has_checkpoint(created.get("checkpoints")):
        return False
    # the marker last: until the others are gone, another rank's check must still see a run here
    for p in sorted(created.values(), key=lambda p: p.name == MARKER):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if c.made:
        try:
            c.path.rmdir()
        except OSError:
            return False
        return True
    return False


# Files a refused run may have rewritten, and up to what size their bytes are kept (a longer one,
# train.log say, is appended to only: it is cut back to its length).
_REWRITTEN = ("config.yaml", "train.log", "metrics.jsonl", "summary.json", MARKER)
_KEEP_BYTES = 1 << 20


def snapshot(path: Path) -> tuple:
    """The run files of ``path`` as they are: ``(relative name, bytes or length)`` for the files a
    run rewrites and every file of ``.hydra/``, and ``checkpoints/last.pt``'s size and time (a
    run that wrote a checkpoint is never put back)."""
    names = [n for n in _REWRITTEN if (path / n).is_file()]
    if (path / ".hydra").is_dir():
        names += [f".hydra/{p.name}" for p in sorted((path / ".hydra").iterdir()) if p.is_file()]
    out = []
    for name in names:
        f = path / name
        size = f.stat().st_size
        out.append((name, f.read_bytes() if size <= _KEEP_BYTES else size))
    last = path / "checkpoints" / "last.pt"
    if last.is_file():
        st = last.stat()
        out.append(("checkpoints/last.pt", (st.st_size, st.st_mtime_ns)))
    return tuple(out)


def restore(path: Path) -> bool:
    """Put the run files of a directory this process claimed back as they were before its run
    (``Claim.files``), for a run refused before it trained: each file's bytes (or its length, cut
    back to), and no ``.hydra/`` file it did not hold. Nothing is put back once the run has
    written a checkpoint. True when the files were put back."""
    c = claimed(path)
    if c is None or c.made or not c.files:
        return False
    kept = dict(c.files)
    last = c.path / "checkpoints" / "last.pt"
    if last.is_file():
        st = last.stat()
        if kept.get("checkpoints/last.pt") != (st.st_size, st.st_mtime_ns):
            return False
    for name, was in kept.items():
        f = c.path / name
        if name.startswith("checkpoints/"):
            continue
        if isinstance(was, bytes):
            if not f.is_file() or f.read_bytes() != was:
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(was)
        elif f.is_file() and f.stat().st_size > was:
            os.truncate(f, was)
    hydra = c.path / ".hydra"
    if hydra.is_dir() and ".hydra" not in c.before:  # made by this run
        shutil.rmtree(hydra, ignore_errors=True)
    elif hydra.is_dir():
        for p in hydra.iterdir():
            if p.is_file() and f".hydra/{p.name}" not in kept:
                p.unlink()
    for name in _REWRITTEN:  # a run file this run created beside the earlier run's
        if name not in kept and name not in c.before and (c.path / name).is_file():
            (c.path / name).unlink()
    return True


def _has_checkpoint(folder: Path | None) -> bool:
    """A committed checkpoint (``last.pt``); an iteration directory alone is a save cut short."""
    return folder is not None and folder.is_dir() and any(p.suffix == ".pt" for p in folder.iterdir())


def claim_directory(path: Path) -> Path:
    """Make ``path``, or ``path-2``, ``-3``... where it exists, and return the one made. Default
    run and sweep directories name the second they start, so runs started together (``for s in 0 1
    2; do tgdist train train.seed=$s & done``) would share one and overwrite each other's files;
    making a directory is atomic, so each gets its own. Directories the user names are used as
    given, not through this."""
    from tgdist.errors import ConfigError

    made = [p for p in path.parents if not p.exists()]  # deepest first, removed again on failure
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
    except OSError as e:  # a read-only working directory, a name too long for the file system
        remove_empty_dirs(made)
        raise ConfigError(f"cannot make the directory {path} ({e.strerror or e}); name another with run_dir= "
                          f"(hydra.sweep.dir= for a sweep)") from None
    raise ConfigError(f"{path}: 10,000 directories of this name exist; name one yourself")


def remove_empty_dirs(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) that a command made and left empty; stops at the first
    that holds something (another run may have started in it meanwhile)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


# Restarts. A run started again in its folder by torchrun (``--max-restarts``: TORCHELASTIC_RESTART_COUNT)
# or SLURM (``--requeue``: SLURM_RESTART_COUNT), or after it was stopped by the preemption signal
# (``REQUEUE_MARKER``, which it wrote then), continues from the folder's checkpoint on its own.
# ``RESTARTS`` lists every restart and the iteration it resumed from, so that a run which fails at
# once after each restart is stopped (``check_restart_loop``) instead of restarting for ever.
RESTARTS = ".tgdist-restarts"
REQUEUE_MARKER = ".tgdist-requeue"
MAX_IDLE_RESTARTS = 3  # restarts in a row from one iteration (no checkpoint between): the next is refused
_RESTART_COUNTS = (("SLURM_RESTART_COUNT", "SLURM requeue"), ("TORCHELASTIC_RESTART_COUNT", "torchrun restart"))


@dataclass(frozen=True)
class Restart:
    """A start of the run in ``path`` after an earlier one: which (``key``, the same on every rank
    of this start; ``by``, who restarted it), its ``number`` among the run's restarts, and the
    checkpoint it resumes from with that checkpoint's iteration (None: none written yet, so the
    run starts afresh in the folder)."""

    path: Path
    key: str
    by: str
    number: int
    checkpoint: Path | None
    iteration: int | None

    def line(self) -> str:
        if self.checkpoint is None:
            return (f"restart {self.number} ({self.by}): {self.path} holds no checkpoint yet, so the run "
                    f"starts afresh there")
        return f"restart {self.number} ({self.by}) resumed from {self.checkpoint} at iteration {self.iteration}"


def _restart_key(env) -> tuple[str, str] | None:
    """(key, by) of this start when torchrun or SLURM counts it as a restart, else None."""
    counts = []
    for var, by in _RESTART_COUNTS:
        try:
            n = int(env.get(var) or 0)
        except ValueError:
            n = 0
        if n > 0:
            counts.append((var, by, n))
    if not counts:
        return None
    job = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or ""
    return f"{job}:" + ",".join(f"{var}={n}" for var, _, n in counts), counts[-1][1]


def _records(path: Path) -> list[dict]:
    try:
        lines = (path / RESTARTS).read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:  # a line cut short by a kill: the others still count
            continue
    return out


def restarted(path: Path, env=None) -> Restart | None:
    """This start as a restart of the run in ``path``, or None: not restarted (no restart count,
    no requeue marker), or ``path`` holds no run (the earlier start ended before it claimed it)."""
    from tgdist.runtime import checkpoint

    env = os.environ if env is None else env
    path = Path(path).absolute()
    found = _restart_key(env)
    marker = path / REQUEUE_MARKER
    try:
        if (found is None and not marker.is_file()) or not is_run_dir(path):
            return None
    except OSError:  # a name too long for the file system, say: the run's own checks say it in one line
        return None
    if found is None:  # started by hand (or by a scheduler that counts nothing) after a preemption
        try:
            key = "requeue:" + marker.read_text().strip()
        except OSError:
            return None
        by = "after the preemption signal"
    else:
        key, by = found
    number = len([r for r in _records(path) if r.get("key") != key]) + 1
    last = path / "checkpoints" / "last.pt"
    if not last.is_file():
        return Restart(path, key, by, number, None, None)
    try:
        iteration = int(checkpoint.read(last, map_location="cpu", mmap=True)["iteration"])
    except Exception:  # (the resume's own check names what is wrong with it)
        iteration = None
    return Restart(path, key, by, number, last, iteration)


def check_restart_loop(r: Restart) -> None:
    """A ``ConfigError`` when the ``MAX_IDLE_RESTARTS`` restarts before this one all resumed from
    the checkpoint this one would (none wrote another): the run fails at once after each."""
    earlier = [rec for rec in _records(r.path) if rec.get("key") != r.key]
    idle = 0
    for rec in reversed(earlier):
        if rec.get("iteration") != r.iteration:
            break
        idle += 1
    if idle >= MAX_IDLE_RESTARTS:
        where = f"iteration {r.iteration}" if r.iteration is not None else "the start (no checkpoint)"
        raise ConfigError(f"restart {r.number} of the run in {r.path} refused: the {idle} restarts before it all "
                          f"resumed from {where} and ended before the next checkpoint (a run that fails at once "
                          f"after each restart); train.log says why, then continue by hand with "
                          f"{resume_override(r.path)}")


def record_restart(r: Restart) -> None:
    """Add ``r`` to the run's ``RESTARTS`` (rank 0, before the ranks meet; a line per restart)."""
    line = json.dumps({"key": r.key, "number": r.number, "by": r.by, "iteration": r.iteration,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    with open(r.path / RESTARTS, "a") as f:
        f.write(line + "\n")


def mark_requeue(path: Path, iteration: int) -> None:
    """``REQUEUE_MARKER``: the run in ``path`` stopped on the preemption signal after checkpointing
    at ``iteration``; its next start in the folder resumes it (``restarted``)."""
    tmp = path / f"{REQUEUE_MARKER}.{RUN_ID}.tmp"
    tmp.write_text(f"{RUN_ID}@{iteration}\n")
    os.replace(tmp, path / REQUEUE_MARKER)
