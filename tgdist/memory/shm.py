"""Shared-memory segments, doorbells and liveness checks for the memory daemon (DistTGL 3.3).

Three small pieces the daemon and its trainers share:

- ``Segment``: a named POSIX shared-memory segment (``/dev/shm/<name>`` on Linux), created with
  ``O_EXCL`` and mode 0600, mapped once, and cut into typed NumPy/torch views by a ``Layout``.
  We call ``shm_open`` directly instead of ``multiprocessing.shared_memory`` because the latter
  registers every attach with the resource tracker on Python < 3.13, which then unlinks segments
  that other processes still use and warns about "leaked" ones. Here the daemon (or whoever finds
  it dead) unlinks, explicitly, on every exit path.
- ``Doorbell``: a 32-bit counter in shared memory. The poster bumps it after publishing a request;
  the waiter spins briefly, then sleeps on the counter with ``futex(FUTEX_WAIT)`` (Linux) so a post
  wakes it at once without a busy loop; elsewhere it falls back to short sleeps. Every sleep is
  bounded, so a lost wake-up costs at most one sleep interval and liveness checks keep running.
- ``alive(pid, start_time)``: liveness of a peer from ``/proc/<pid>/stat``. ``os.kill(pid, 0)``
  alone reports a killed child that its parent has not reaped yet (a zombie) as alive, and cannot
  tell a recycled pid; the state letter and the start time can.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
ALIGN = 64  # cache line: no two fields written by different processes share one


# ------------------------------------------------------------------------------------------------
# Layouts and segments


@dataclass(frozen=True)
class Field:
    name: str
    dtype: np.dtype
    shape: tuple
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Byte layout of one segment: fields in order, each aligned to 64 bytes. Pure: both sides
    compute the same layout from the same parameters, so no offsets travel between processes."""

    fields: tuple
    size: int

    @staticmethod
    def of(spec: list[tuple[str, object, tuple]]) -> "Layout":
        out, off = [], 0
        for name, dtype, shape in spec:
            f = Field(name, np.dtype(dtype), tuple(int(s) for s in shape), off)
            out.append(f)
            off += -(-f.nbytes // ALIGN) * ALIGN
        return Layout(tuple(out), max(off, ALIGN))

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)


def check_name(name: str) -> str:
    if not NAME_RE.match(name) or len(name) > 200:
        raise ValueError(f"shared-memory name {name!r}: use letters, digits, '_', '-', '.' (at most 200)")
    return name


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode)
    return os.open(os.path.join(SHM_DIR, name), flags, mode)  # pragma: no cover


def shm_unlink(name: str) -> bool:
    """Remove a segment's name; True if it existed. Mappings stay valid until unmapped."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


class Segment:
    """One mapped shared-memory segment with typed views (``array``/``tensor``) by field name."""

    def __init__(self, name: str, fd: int, size: int, layout: Layout | None, created: bool):
        self.name, self.size, self.layout, self.created = name, size, layout, created
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._arrays: dict[str, np.ndarray] = {}

    @classmethod
    def create(cls, name: str, layout: Layout) -> "Segment":
        """Create ``name`` exclusively (an existing segment of that name is an error), mode 0600."""
        check_name(name)
        try:
            fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise FileExistsError(f"shared-memory segment {SHM_DIR}/{name} already exists "
                                  f"(another run with the same run id?)") from None
        try:
            os.fchmod(fd, 0o600)  # independent of the umask
            os.ftruncate(fd, layout.size)
        except BaseException:
            os.close(fd)
            shm_unlink(name)
            raise
        return cls(name, fd, layout.size, layout, True)

    @classmethod
    def attach(cls, name: str, layout: Layout | None = None) -> "Segment":
        check_name(name)
        fd = _shm_open(name, os.O_RDWR, 0)
        size = os.fstat(fd).st_size
        if layout is not None and size < layout.size:
            os.close(fd)
            raise ValueError(f"shared-memory segment {name} has {size} bytes, expected {layout.size}")
        return cls(name, fd, size, layout, False)

    def array(self, name: str) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None:
            f = self.layout[name]
            count = int(np.prod(f.shape, dtype=np.int64))
            a = np.frombuffer(self.mm, dtype=f.dtype, count=count, offset=f.offset).reshape(f.shape)
            self._arrays[name] = a
        return a

    def tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.array(name))

    def close(self) -> None:
        """Unmap if nothing still views the mapping; otherwise the mapping lives until those views go."""
        self._arrays.clear()
        try:
            self.mm.close()
        except BufferError:
            pass


def list_segments(prefix: str) -> list[str]:
    """Names under ``/dev/shm`` starting with ``prefix`` (Linux; empty elsewhere)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:  # pragma: no cover
        return []


# ------------------------------------------------------------------------------------------------
# Liveness


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # pragma: no cover - /proc unreadable
        return ("?", 0)
    rest = raw[raw.rfind(b")") + 2:].split()  # the command name may contain spaces and ')'
    return rest[0].decode(), int(rest[19])


def start_time(pid: int) -> int:
    st = proc_stat(pid) if os.path.isdir("/proc") else None
    return st[1] if st else 0


def alive(pid: int, start: int = 0) -> bool:
    """Is ``pid`` running (not a zombie) and the same process that had ``start`` (0: any)?"""
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X", "x"):
            return False
        return not start or not st[1] or st[1] == start
    try:  # pragma: no cover - no /proc
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# ------------------------------------------------------------------------------------------------
# Doorbells: futex on Linux, bounded sleeps elsewhere


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word lives in a shared mapping


def _load_futex():
    if _SYS_FUTEX is None or not platform.system() == "Linux" or os.environ.get("TGDIST_NO_FUTEX"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        probe = ctypes.c_int32(0)
        if fn(ctypes.c_long(_SYS_FUTEX), ctypes.byref(probe), ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(1),
              None, None, ctypes.c_long(0)) < 0:
            return None
        return fn
    except (OSError, AttributeError):  # pragma: no cover
        return None


_futex = _load_futex()


def has_futex() -> bool:
    return _futex is not None


class Doorbell:
    """A 32-bit counter in shared memory that posters bump and waiters sleep on."""

    def __init__(self, word: np.ndarray):
        assert word.dtype == np.int32 and word.shape == (1,)
        self.word = word
        self.addr = ctypes.c_void_p(word.ctypes.data)

    def value(self) -> int:
        return int(self.word[0])

    def ring(self) -> None:
        # Not atomic across processes: two posters may store the same value. The waiter compares
        # against the value it saw before checking its condition, so it still wakes, and in the
        # worst interleaving it sleeps one bounded interval.
        self.word[0] = (int(self.word[0]) + 1) & 0x7FFFFFFF
        if _futex is not None:
            _futex(ctypes.c_long(_SYS_FUTEX), self.addr, ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(0x7FFFFFFF),
                   None, None, ctypes.c_long(0))

    def sleep(self, seen: int, seconds: float) -> None:
        """Sleep up to ``seconds`` unless the counter moved away from ``seen``."""
        if _futex is None:
            time.sleep(seconds)
            return
        ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
        r = _futex(ctypes.c_long(_SYS_FUTEX), self.addr, ctypes.c_long(_FUTEX_WAIT), ctypes.c_long(seen),
                   ctypes.byref(ts), None, ctypes.c_long(0))
        if r < 0 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):  # pragma: no cover
            time.sleep(seconds)


class Backoff:
    """Spin for ``spin_s``, then sleep on the doorbell with intervals growing to ``max_sleep_s``.

    Call ``pause(seen)`` after a fruitless check (``seen`` = the doorbell value read *before* the
    check) and ``reset()`` after progress. With futex waits a post ends the sleep at once, so the
    cap only bounds a lost wake-up and the spacing of liveness checks; without futex it bounds the
    added latency, hence a smaller cap there.
    """

    def __init__(self, bell: Doorbell, spin_s: float = 100e-6, max_sleep_s: float | None = None):
        self.bell, self.spin_s = bell, spin_s
        self.max_sleep_s = max_sleep_s if max_sleep_s is not None else (0.02 if has_futex() else 0.002)
        self.reset()

    def reset(self) -> None:
        self.first = None
        self.interval = 50e-6

    def pause(self, seen: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if now - self.first < self.spin_s:
            # Give the core away if anything else is runnable (an oversubscribed machine), else
            # this returns at once and the poll goes on.
            os.sched_yield()
            return
        self.bell.sleep(seen, self.interval)
        self.interval = min(self.interval * 2, self.max_sleep_s)
