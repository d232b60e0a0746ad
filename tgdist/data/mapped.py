"""One copy of a processed graph per machine: a folder of ``.npy`` files every rank maps read-only.

The processed-graph cache used to be one ``.npz`` that each process read whole into its own memory:
M ranks on a machine held M copies of the events, the T-CSR and every feature. A cache entry is now
a folder::

    {name}-{key}/
        manifest.json        version, the graph's scalars, and per array: file, dtype, shape, bytes,
                             BLAKE2b digest; sealed with the BLAKE2b digest of all of that
        src.npy dst.npy t.npy node_map.npy edge_feat.npy ... tcsr_indptr.npy tcsr_nbr.npy ...

Every process maps the files with ``np.load(mmap_mode="r")``: the pages live once in the machine's
page cache and are shared by every process that maps them (a process's PSS counts its share only),
and pages nobody touches are never read. Features larger than memory are read from the map as the
batches ask for them; the page cache keeps what is hot.

Building, once per cache folder, whatever the number of processes and machines that ask:
- an exclusive ``flock`` on ``.{name}-{key}.lock`` beside the folder serialises builders. The
  kernel drops the lock when its holder dies, even by SIGKILL, so no lock outlives a builder;
- the files are written into ``.{name}-{key}.part-{host}-{pid}/`` and the finished folder is
  renamed into place (atomic on one file system); the manifest is written last. A folder under the
  final name is therefore complete; a builder killed half-way leaves a ``.part`` folder that the
  next lock holder removes;
- a folder under the final name is checked before its first use on a machine (see ``ensure``): its
  manifest against the manifest's own checksum and its files' sizes always, their digests once per
  machine and boot (a stamp in the temporary folder records that the files, by inode, size and
  times, were found intact). A damaged entry (an edited manifest, a truncated or changed file) is
  moved aside and rebuilt under the lock, never used.
- a disk that fills while an entry is written is one ``NoSpaceError`` naming the entry, with nothing
  of the entry left behind (the caller reads the graph into memory instead).

On a shared file system (NFS v4, Lustre, GPFS: ``flock`` is honoured across machines there) every
machine maps the one folder, and the first process anywhere builds it: never two writers. No
node-local copy is made: each machine's page cache holds the pages its ranks touch, which is the
copy per machine a node-local file would give, without a second write of the data.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from tgdist.errors import DataError

log = logging.getLogger(__name__)

MAP_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 24


def digest_file(path: Path) -> str:
    """BLAKE2b (32 bytes) of a file's bytes, read in 16 MiB chunks: about twice SHA-256's speed,
    which matters for the tens of GB a large stream's features take."""
    h = hashlib.blake2b(digest_size=32)
    buf = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def machine_id() -> str:
    """What tells this machine apart: ``$TGDIST_MACHINE_ID`` when set (tests simulate machines with
    it), else the host name and this boot's id (a reboot empties the page cache and /tmp)."""
    override = os.environ.get("TGDIST_MACHINE_ID")
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}:{boot}"


@contextmanager
def file_lock(path: Path, what: str, wait_note: float = 5.0):
    """An exclusive ``flock`` on ``path`` (created if missing) for the block. A waiter says once,
    after ``wait_note`` seconds, what it waits for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, noted = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if not noted and time.monotonic() - start > wait_note:
                log.info("waiting for another process to finish %s (lock %s)", what, path)
                noted = True
            time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _npy(folder: Path, name: str) -> Path:
    return folder / f"{name}.npy"


def _manifest_checksum(manifest: dict) -> str:
    """BLAKE2b of a manifest without its ``checksum``, in a canonical JSON form: what seals the
    graph's scalars (``meta``: its node count, bipartite flag...) and the arrays' dtypes and shapes,
    which no file digest covers."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


class NoSpaceError(OSError):
    """The disk holding the cache filled while an entry was written (numpy says only "N requested
    and M written"); nothing of the entry is left behind."""

    def __init__(self, folder: Path, needed: int | None):
        try:
            free = f"{shutil.disk_usage(folder.parent).free:,} bytes free there"
        except OSError:
            free = "free space unknown"
        need = f"{needed:,} bytes needed, " if needed is not None else ""
        super().__init__(errno.ENOSPC, f"no space left on device writing the cache entry at {folder} "
                                       f"({need}{free})")


def _out_of_space(e: BaseException) -> bool:
    """A write that failed for want of room: ENOSPC, or numpy's short write (``ndarray.tofile``
    reports "N requested and M written" without an errno)."""
    if not isinstance(e, OSError):
        return False
    if e.errno == errno.ENOSPC:
        return True
    return e.errno is None and bool(re.fullmatch(r"\d+ requested and \d+ written", str(e)))


def write(folder: Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write ``arrays`` (name -> array, C order) and ``meta`` (JSON) as a cache folder at ``folder``,
    atomically: files go to a ``.part`` folder beside it, renamed into place when complete. The
    caller holds ``lock_path(folder)``. A disk that fills is a ``NoSpaceError``; whatever failed,
    no file of the entry is left (the ``.part`` folder and any ``.npy`` not yet moved in removed)."""
    folder = Path(folder)
    part = folder.parent / f".{folder.name}.part-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    try:
        part.mkdir(parents=True)
        files = {}
        for name, a in arrays.items():
            if isinstance(a, Path):  # an .npy the builder wrote beside the folder (streamed features): moved in
                path = _npy(part, name)
                os.replace(a, path)
                with open(path, "rb") as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(f)
                files[name] = {"dtype": dtype.str, "shape": list(shape), "bytes": path.stat().st_size,
                               "blake2b": digest_file(path)}
                continue
            a = np.asarray(a)
            if a.dtype == object:
                raise ValueError(f"array {name!r} holds Python objects; a mapped cache holds plain arrays")
            path = _npy(part, name)
            np.save(path, a, allow_pickle=False)
            files[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "bytes": path.stat().st_size,
                           "blake2b": digest_file(path)}
        manifest = {"version": MAP_VERSION, "built_on": machine_id(), "meta": meta, "arrays": files}
        manifest["checksum"] = _manifest_checksum(manifest)
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.chmod(part, 0o755)  # mkdtemp-like modes would hide a shared cache from other users
        try:
            os.rename(part, folder)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(folder)  # a damaged entry the caller chose to replace
            os.rename(part, folder)
    except BaseException as e:
        shutil.rmtree(part, ignore_errors=True)
        for a in arrays.values():  # spooled files not moved in yet
            if isinstance(a, Path):
                a.unlink(missing_ok=True)
        if _out_of_space(e) and not isinstance(e, NoSpaceError):
            needed = sum(np.asarray(a).nbytes + 128 for a in arrays.values() if not isinstance(a, Path))
            raise NoSpaceError(folder, needed) from None
        raise
    return folder


def spool_path(folder: Path, name: str) -> Path:
    """Where a builder writes array ``name`` before ``write`` moves it in: beside the folder (one
    file system, so the move is a rename), named so that a killed build's file is removed as stale."""
    return folder.parent / f".{folder.name}.part-{socket.gethostname()}-{os.getpid()}.{name}.npy"


def remove(path: Path) -> None:
    """A file or a folder, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class NpyAppender:
    """An ``.npy`` file of rows ``[n, *row_shape]`` written block by block while ``n`` is unknown:
    a 128-byte header is reserved and written with the final row count by ``close``."""

    HEADER = 128

    def __init__(self, path: Path, dtype, row_shape: tuple):
        self.path, self.dtype, self.row_shape, self.rows = Path(path), np.dtype(dtype), tuple(row_shape), 0
        self.f = open(self.path, "wb")
        self.f.write(b"\0" * self.HEADER)

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: rows of shape {block.shape[1:]}, expected {self.row_shape}")
        self.f.write(block.tobytes())
        self.rows += block.shape[0]

    def close(self) -> Path:
        d = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
             "shape": (self.rows, *self.row_shape)}
        text = repr(d).encode("latin1")
        pad = self.HEADER - 10 - len(text) - 1
        if pad < 0:
            raise ValueError(f"{self.path}: header of {len(text)} bytes does not fit")
        self.f.seek(0)
        self.f.write(b"\x93NUMPY\x01\x00" + (self.HEADER - 10).to_bytes(2, "little") + text + b" " * pad + b"\n")
        self.f.close()
        return self.path

    def discard(self) -> None:
        if not self.f.closed:
            self.f.close()
        self.path.unlink(missing_ok=True)


def lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def _manifest(folder: Path) -> dict:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise DataError(f"{folder}: no {MANIFEST} (not a complete cache entry)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{folder}/{MANIFEST}: unreadable ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("arrays"), dict) or "meta" not in m:
        raise DataError(f"{folder}/{MANIFEST}: not a tgdist cache manifest")
    if int(m.get("version", 0)) > MAP_VERSION:
        raise DataError(f"{folder}: written by a newer tgdist (mapped format {m['version']} > {MAP_VERSION})")
    if "checksum" not in m:
        raise DataError(f"{folder}/{MANIFEST}: has no checksum (written by an older tgdist)")
    if m["checksum"] != _manifest_checksum(m):
        raise DataError(f"{folder}/{MANIFEST}: does not match its checksum (its meta or its list of arrays was "
                        f"edited): the entry is damaged")
    return m


def _check_sizes(folder: Path, manifest: dict) -> list[tuple]:
    """The files' identities (for the stamp), or a DataError naming the first file that is missing
    or of another size than the manifest says (a truncated copy, a partial rsync)."""
    ids = []
    for name, info in sorted(manifest["arrays"].items()):
        path = _npy(folder, name)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise DataError(f"{folder}: {path.name} is missing") from None
        if st.st_size != info["bytes"]:
            raise DataError(f"{folder}: {path.name} holds {st.st_size:,} bytes, the manifest says {info['bytes']:,}")
        ids.append((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return ids


def _stamp(folder: Path, ids: list[tuple]) -> Path:
    key = hashlib.blake2b(json.dumps([str(folder.resolve()), machine_id(), ids]).encode(), digest_size=16).hexdigest()
    return Path(tempfile.gettempdir()) / f"tgdist-verified-{os.getuid()}" / key


def verify(folder: Path, manifest: dict | None = None) -> None:
    """Every file of a cache folder against its manifest's size and digest; a DataError names the
    first that differs."""
    manifest = manifest or _manifest(folder)
    _check_sizes(folder, manifest)
    for name, info in sorted(manifest["arrays"].items()):
        found = digest_file(_npy(folder, name))
        if found != info["blake2b"]:
            raise DataError(f"{folder}: {name}.npy does not match its checksum (expected blake2b "
                            f"{info['blake2b'][:12]}..., found {found[:12]}...): the entry is damaged")


def _verified_here(folder: Path) -> bool:
    """The folder is complete and this machine found its files intact since it booted."""
    try:
        manifest = _manifest(folder)
        ids = _check_sizes(folder, manifest)
    except DataError:
        return False
    return _stamp(folder, ids).exists()


def _stamp_intact(folder: Path) -> None:
    stamp = _stamp(folder, _check_sizes(folder, _manifest(folder)))
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError as e:  # a full or read-only temporary folder: the entry is checked again next time
        log.debug("could not record %s as checked (%s)", folder, e.strerror or e)


def _verify_and_stamp(folder: Path) -> None:
    verify(folder)
    _stamp_intact(folder)


def load(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays of a cache folder, mapped read-only (an empty array is read: it has no pages to
    map), and its meta. Sizes are checked; digests are ``verify``'s."""
    folder = Path(folder)
    manifest = _manifest(folder)
    _check_sizes(folder, manifest)
    arrays = {}
    for name, info in manifest["arrays"].items():
        path = _npy(folder, name)
        empty = int(np.prod(info["shape"])) == 0
        try:
            a = np.load(path, mmap_mode=None if empty else "r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable ({e})") from None
        if a.dtype.str != info["dtype"] or list(a.shape) != info["shape"]:
            raise DataError(f"{path}: holds {a.dtype} {a.shape}, the manifest says {info['dtype']} {info['shape']}")
        arrays[name] = np.asarray(a)  # a plain read-only ndarray over the map (what numba and torch take)
    return arrays, manifest["meta"]


def ensure(folder: Path, build: Callable[[], tuple[dict[str, np.ndarray], dict]], what: str = "the graph"
           ) -> tuple[dict[str, np.ndarray], dict, bool]:
    """The cache folder's arrays (mapped) and meta, built first by ``build`` when no intact entry is
    there; the third value says whether this process built it. Safe for any number of processes
    on any number of machines at once (see the module's docstring).

    An entry that fails any check (its manifest's checksum, a file's size, digest, dtype or shape)
    is moved aside under the lock, with a warning saying why, and built again: never served, and
    never refused run after run. A disk that fills while building is a ``NoSpaceError``, with
    nothing of the entry left."""
    folder = Path(folder)
    if _verified_here(folder):
        try:
            arrays, meta = load(folder)
            return arrays, meta, False
        except DataError:  # replaced under us, or damaged past its stamp: settled under the lock
            pass
    built = False
    with file_lock(lock_path(folder), f"building {what} in {folder}"):
        for stale in folder.parent.glob(f".{folder.name}.part-*"):  # a builder that died: the lock is ours now
            log.info("removing %s, left by a build that did not finish", stale)
            remove(stale)
        if folder.exists():
            try:
                if not _verified_here(folder):  # a process before us may have checked it
                    _verify_and_stamp(folder)
                arrays, meta = load(folder)
                return arrays, meta, False
            except DataError as e:
                log.warning("%s; building it again", e)
                aside = folder.parent / f".{folder.name}.damaged-{os.getpid()}"
                os.rename(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)
        try:
            arrays, meta = build()
            write(folder, arrays, meta)
        except BaseException as e:  # a source that cannot be read leaves nothing behind, its lock file neither
            lock_path(folder).unlink(missing_ok=True)
            if _out_of_space(e) and not isinstance(e, NoSpaceError):  # the builder's own spooled files
                raise NoSpaceError(folder, None) from None
            raise
        del arrays
        _stamp_intact(folder)  # hashed as they were written
        built = True
        arrays, meta = load(folder)
    return arrays, meta, built
