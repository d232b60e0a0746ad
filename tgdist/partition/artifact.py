"""Partition artifacts: one directory per partition, written atomically, checked when loaded.

Layout of ``<out_dir>/``:
  * ``metadata.json``: format, data set (name, ``source_hash``, nodes, events), M, method, batch
    size, sampling (fanouts, strategy, negatives), seed, weights, imbalance, timings, versions;
  * ``maps.npz``: the dual-hash maps (``trainer_of``, ``local_of``, ``offsets``, ``global_of``);
  * ``comm.npz``: C (``comm_dedup``, ``comm_raw``, ``[M, M]``) and the residuals R of the method;
  * ``measures.json``: ``measures.evaluate`` of the method, of range and interval for comparison,
    and the lower bound of the balance cost;
  * ``residual.png``: the residual heatmaps (when matplotlib is installed).

Everything is written into a hidden sibling directory first and renamed at the end, so a failed
run leaves nothing half-written. ``metadata.json`` records the SHA-256 of every data file (the PNG
aside) and of its own content under ``sha256``; ``load`` refuses a file that does not match in one
line. An artifact written before checksums has no ``sha256`` and loads unchecked, as before.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np

from tgdist import checksum
from tgdist.errors import ConfigError, DataError
from tgdist.partition.idmap import DualHashMap

FORMAT = "tgdist-partition"
FORMAT_VERSION = 1
MAP_KEYS = ("trainer_of", "local_of", "offsets", "global_of")
CHECKED = ("maps.npz", "comm.npz", "measures.json")  # the files whose SHA-256 metadata.json records
_AGAIN = "re-run tgdist partition to make the artifact again"


@dataclass
class Partition:
    """A loaded artifact: the maps every memory backend uses, with its metadata and measures."""

    path: Path
    metadata: dict
    maps: DualHashMap
    measures: dict

    @property
    def num_parts(self) -> int:
        return self.maps.num_parts


def check_out_dir(out: Path, overwrite: bool) -> None:
    """One line when ``out`` cannot take an artifact: something is there (``overwrite`` replaces
    only an earlier artifact, never a data file or a folder of other things) or its folder cannot
    be written. ``tgdist partition`` checks before the long work, ``save`` again before writing."""
    from tgdist.data.graph import unwritable

    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ConfigError(f"{out} already exists; pass partition.overwrite=true to replace it")
        try:
            is_artifact = json.loads((out / "metadata.json").read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            is_artifact = False
        if out.is_symlink() or not is_artifact:
            raise ConfigError(f"{out} is not a partition artifact (no {FORMAT} metadata.json): partition.overwrite=true "
                              f"replaces only an earlier artifact; choose another partition.out_dir")
    why = unwritable(out.parent)
    if why:
        raise ConfigError(f"partition.out_dir={out}: cannot write ({why})")


def save(out_dir: str | Path, *, maps: DualHashMap, metadata: dict, measures: dict,
         arrays: Mapping[str, np.ndarray], residuals: Optional[Mapping[str, np.ndarray]] = None,
         overwrite: bool = False, warn: Optional[Callable[[str], None]] = None) -> Path:
    """Write the artifact directory atomically; returns its path.

    ``arrays`` go to ``comm.npz``; ``residuals`` (method name -> R) to ``residual.png`` when given
    and matplotlib is importable (otherwise ``warn`` is told and the PNG is skipped).
    """
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the artifact is an ordinary directory
        np.savez(tmp / "maps.npz", **{k: getattr(maps, k) for k in MAP_KEYS})
        np.savez(tmp / "comm.npz", **arrays)
        (tmp / "measures.json").write_text(json.dumps(measures, indent=1) + "\n")
        if residuals:
            try:
                from tgdist.partition.plot import residual_heatmaps
                weights = measures.get("weights") or metadata.get("weights")
                title = (f"{metadata['data']['name']}, M={metadata['num_parts']}"
                         + (f", {weights} weights" if weights else ""))
                residual_heatmaps(residuals, tmp / "residual.png", title=title,
                                  costs=_balance_costs(measures, weights, residuals))
            except ImportError:
                if warn is not None:
                    warn("matplotlib is not installed (pip install 'tgdist[plot]'): no residual.png")
        # metadata last: an artifact with metadata.json is complete
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata}
        sums = {name: checksum.sha256_file(tmp / name) for name in CHECKED}
        meta["sha256"] = {**sums, "metadata.json": _content_digest(json.loads(json.dumps(meta)))}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _balance_costs(measures: Mapping, weights: Optional[str], names) -> Optional[dict]:
    """Method -> balance cost under ``weights``, from ``measures.json``'s method and baselines, for
    the heatmaps' titles (the number tgdist partition ranks by); None when one of ``names`` has none."""
    evals = {measures.get("method"): measures.get("measures"), **(measures.get("baselines") or {})}
    try:
        return {name: int(evals[name][weights]["balance_cost"]) for name in names}
    except (KeyError, TypeError):
        return None


def load(path: str | Path, *, source_hash: Optional[str] = None, num_nodes: Optional[int] = None,
         num_parts: Optional[int] = None, graph=None) -> Partition:
    """Read an artifact, refusing one made for another data set or another number of trainers.

    ``graph`` (a ``TemporalGraph``) supplies ``source_hash`` and ``num_nodes`` when given.
    """
    p = Path(path)
    if graph is not None:
        source_hash, num_nodes = graph.source_hash, graph.num_nodes
    meta_file = p / "metadata.json"
    if not p.is_dir():
        what = "a file, not a partition directory" if p.exists() else "no such partition directory"
        raise DataError(f"{p}: {what} (make one with `tgdist partition`)")
    if not meta_file.exists():
        raise DataError(f"{p}: not a partition artifact (no metadata.json)")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{meta_file}: unreadable ({e})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{meta_file}: not a {FORMAT} v{FORMAT_VERSION} artifact "
                        f"(format {meta.get('format')!r} v{meta.get('format_version')!r})")
    sums = _recorded_sums(meta, meta_file)
    check_metadata(meta, p, source_hash=source_hash, num_nodes=num_nodes, num_parts=num_parts)
    # each file is read once; what its own checks find wrong (cut short, inconsistent) is named
    # first, and the checksum catches the rest (a changed id that still makes consistent maps)
    try:
        data = (p / "maps.npz").read_bytes()
        with np.load(io.BytesIO(data)) as z:
            maps = DualHashMap(*(np.asarray(z[k], dtype=np.int64) for k in MAP_KEYS))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{p / 'maps.npz'}: unreadable partition maps ({e})") from None
    if maps.num_parts != meta["num_parts"] or maps.num_nodes != meta["data"]["num_nodes"]:
        raise DataError(f"{p / 'maps.npz'}: maps for {maps.num_nodes} nodes / M={maps.num_parts} disagree with "
                        f"metadata.json ({meta['data']['num_nodes']} nodes / M={meta['num_parts']})")
    try:
        maps.check()
    except ConfigError as e:
        raise DataError(f"{p / 'maps.npz'}: {e}") from None
    _check_sum(p / "maps.npz", sums, hashlib.sha256(data).hexdigest())
    measures = {}
    if (p / "measures.json").exists():
        try:
            data = (p / "measures.json").read_bytes()
            measures = json.loads(data)
        except (OSError, ValueError) as e:
            raise DataError(f"{p / 'measures.json'}: unreadable ({e})") from None
        _check_sum(p / "measures.json", sums, hashlib.sha256(data).hexdigest())
    if (p / "comm.npz").exists():  # not read here, but the artifact's record of C, read by its users
        _check_sum(p / "comm.npz", sums, checksum.sha256_file(p / "comm.npz"))
    return Partition(path=p, metadata=meta, maps=maps, measures=measures)


def _content_digest(meta: dict) -> str:
    """The SHA-256 of ``metadata.json``'s content but its ``sha256`` record, in a canonical form
    (what a flipped byte changes, not its layout)."""
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _recorded_sums(meta: dict, meta_file: Path) -> dict | None:
    """The checksums ``metadata.json`` records, once its own content is checked against its
    record; None for an artifact written before checksums (loaded unchecked)."""
    sums = meta.get("sha256")
    if sums is None:
        return None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise DataError(f"{meta_file}: its checksum record is damaged, the file is corrupt; {_AGAIN}")
    _check_sum(meta_file, sums, _content_digest(meta), name="metadata.json")
    return sums


def _check_sum(path: Path, sums: dict | None, found: str, name: str | None = None) -> None:
    expected = None if sums is None else sums.get(name or path.name)
    if expected is not None and expected != found:
        raise DataError(f"{checksum.Corrupt(path, expected, found)}; {_AGAIN}")


def check_metadata(meta: dict, path: Path, *, source_hash: Optional[str] = None, num_nodes: Optional[int] = None,
                   num_parts: Optional[int] = None) -> None:
    """ConfigError / DataError with one line when the artifact does not fit the run."""
    data = meta.get("data", {})
    if source_hash is not None and data.get("source_hash") != source_hash:
        raise DataError(f"{path}: partition was made for data set {data.get('name')!r} (source hash "
                        f"{str(data.get('source_hash'))[:12]}), not this one (source hash {str(source_hash)[:12]}); "
                        f"re-run tgdist partition for this data")
    if num_nodes is not None and data.get("num_nodes") != num_nodes:
        raise DataError(f"{path}: partition covers {data.get('num_nodes')} nodes, the data set has {num_nodes}")
    if num_parts is not None and meta.get("num_parts") != num_parts:
        raise ConfigError(f"{path}: partition was made for {meta.get('num_parts')} trainers, this run has {num_parts}; "
                          f"re-run tgdist partition with partition.num_parts={num_parts}")
